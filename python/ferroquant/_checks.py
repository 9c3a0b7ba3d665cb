"""Argument checks shared by the public API: one place, one wording."""

from __future__ import annotations

import math
import operator
import os
import reprlib
import sys
import warnings
import weakref
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from itertools import repeat
from typing import Any, Dict, Optional, Tuple, Type

import ml_dtypes
import numpy as np

from . import _ferroquant as _native
from .errors import InvalidConfigError, NonFiniteError, QuantizationError, ShapeMismatchError

_MAX_INT = 2**63 - 1

#: The most dimensions a NumPy array can have (64 from NumPy 2, 32 before).
MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32

#: dtypes the kernels read natively (bfloat16 comes from ml_dtypes).
FLOAT_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")

#: The float dtypes by name, bfloat16 included without relying on NumPy's name lookup.
FLOAT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

#: The names of the native-order float dtypes, looked up without ``np.dtype.name``
#: (a property that builds its string on every call, ~3 us).
_NAME_OF = {dt: name for name, dt in FLOAT_DTYPES.items()}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def exact_int(value: Any, arg: str, kind: str = "an integer") -> int:
    """``value`` as an int: a Python or NumPy integer (``__index__``), never a bool,
    a float or a string; TypeError naming ``arg`` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg} must be {kind}, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{arg} must be {kind}, got {type(value).__name__}") from None


def positive_int(value: Any, arg: str) -> int:
    """Return ``value`` as an int >= 1, or raise TypeError / InvalidConfigError naming ``arg``."""
    n = exact_int(value, arg)
    if n < 1:
        raise InvalidConfigError(f"{arg} must be an integer >= 1, got {n}")
    if n > _MAX_INT:
        raise InvalidConfigError(f"{arg} must be at most 2**63 - 1, got {n}")
    return n


def shape_tuple(
    shape: Any, arg: str = "shape", dtype: Any = "float64", at_least: int = 1
) -> Tuple[int, ...]:
    """A shape as a tuple of ints NumPy can represent for an array of ``dtype`` (the
    one the values came from) and for elements of ``at_least`` bytes (what
    ``dequantize`` returns), or TypeError / ShapeMismatchError.

    Only true integers are sizes: ``2.7`` or the string ``"25"`` are refused,
    not truncated or split into digits.
    """
    if isinstance(shape, np.ndarray):
        if shape.ndim != 1:
            raise TypeError(f"{arg} must be a 1-D sequence of ints, got a {shape.ndim}-d array")
        shape = shape.tolist()
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"{arg} must be a tuple of ints, got {type(shape).__name__}")
    dims = []
    for d in shape:
        if isinstance(d, (bool, np.bool_)):
            raise TypeError(f"{arg} must hold ints, got bool")
        try:
            dims.append(operator.index(d))
        except TypeError:
            raise TypeError(f"{arg} must hold ints, got {type(d).__name__} {d!r}") from None
    if len(dims) > MAX_NDIM:
        raise ShapeMismatchError(
            f"{arg} has {len(dims)} dimensions; NumPy supports at most {MAX_NDIM}"
        )
    if any(d < 0 or d > _MAX_INT for d in dims):
        raise ShapeMismatchError(f"{arg} must hold sizes in 0..2**63-1, got {tuple(dims)}")
    # NumPy refuses shapes whose non-zero dimensions span more than 2**63 - 1
    # bytes even when another dimension is 0: every shape an input of `dtype` can
    # have passes (a dtype not yet checked counts as the widest, 8 bytes).
    name = _NAME_OF.get(dtype) if isinstance(dtype, np.dtype) else dtype
    span = FLOAT_DTYPES[name].itemsize if isinstance(name, str) and name in FLOAT_DTYPES else 8
    span = max(span, at_least)
    for d in dims:
        span *= max(d, 1)
    if span > _MAX_INT:
        raise ShapeMismatchError(f"{arg} {tuple(dims)} is larger than NumPy can represent")
    return tuple(dims)


def float32_shape(shape: Tuple[int, ...], arg: str) -> None:
    """ShapeMismatchError naming ``arg`` for an empty input whose shape NumPy cannot
    hold in float32, the dtype its values come back in: float16 (0, 2**61) is an
    array, its float32 values would not be. (A non-empty one fails to allocate.)"""
    if 0 in shape:
        shape_tuple(shape, arg, "float32")


def beyond_f32(e: NonFiniteError, arr: np.ndarray, only: Optional[str] = None) -> NonFiniteError:
    """``e``, or, when the value it points at in the float64 ``arr`` is finite (past
    float32's range, so ±inf in the float32 working precision), the same error
    saying so: "holds a non-finite value (NaN or ±inf)" would not be true. With
    ``only``, ``e`` must name that argument (``arr`` is that argument's array)."""
    i, text = e.index, str(e)
    arg, sep, _ = text.partition(" holds a non-finite value")
    if arr.dtype != np.float64 or i is None or not sep or not 0 <= i < arr.size:
        return e
    if only is not None and arg != only:
        return e
    v = float(arr.flat[i])
    if not math.isfinite(v):
        return e
    return NonFiniteError(
        f"{arg} holds {v!r} at flat index {i}, beyond float32's range: the kernel works "
        "in float32, where it is infinite (non-finite input)",
        i,
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def source_dtype(value: Any, arg: str = "dtype") -> str:
    """Normalize the dtype a value was quantized from to its name (float32, ...).

    Strings must be one of the four names exactly (files store them so, and a
    string is never handed to NumPy's dtype parser); a ``np.dtype`` or a NumPy
    scalar type such as ``np.float16`` is accepted and named.
    """
    name: Optional[str] = None
    if isinstance(value, np.dtype):
        name = _NAME_OF.get(value)  # the common case: np.dtype.name takes microseconds
        if name is not None:
            return name
    if isinstance(value, str):
        name = str(value)
    elif isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
        try:
            name = np.dtype(value).name
        except Exception:  # an exotic scalar type: not a float dtype
            name = None
    if name not in FLOAT_DTYPES:
        raise InvalidConfigError(
            f"{arg} must be one of {', '.join(FLOAT_DTYPE_NAMES)}, got {_short(value)}"
        )
    return name


def is_float_dtype(dt: np.dtype) -> bool:
    """Whether ``dt`` is one of the floating dtypes the kernels read natively."""
    return dt.name in FLOAT_DTYPE_NAMES or (dt.kind == "f" and dt.itemsize in (2, 4, 8))


#: Native-byte-order dtypes the kernels read in place.
_READY = frozenset(dt.newbyteorder("=") for dt in FLOAT_DTYPES.values())


def kernel_layout(arr: np.ndarray, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """``arr`` itself if the kernels can read it in place (C-contiguous, aligned,
    native byte order), else one copy that they can. Never modifies ``arr``."""
    dt = arr.dtype if dtype is None else dtype
    if not dt.isnative:
        dt = dt.newbyteorder("=")
    if arr.dtype == dt and arr.flags.c_contiguous and arr.flags.aligned:
        return arr
    # Not np.ascontiguousarray: it keeps misaligned buffers misaligned.
    out = np.empty(arr.shape, dt)
    out[...] = arr
    return out


def to_float32(arr: np.ndarray) -> np.ndarray:
    """``arr`` (as ``float_input`` returns it) as float32, rounded natively in the
    default floating-point environment: NumPy's ``astype`` runs under the caller's
    flags, and flush-to-zero would turn subnormal results into zeros. Values beyond
    float32's range become ±inf."""
    if arr.dtype == np.float32:
        return arr
    return _native.to_float32(arr).reshape(arr.shape)


def _exact(value: Any) -> Optional[Fraction]:
    """``value`` as an exact rational, or None (not finite, or not a real number)."""
    if isinstance(value, (int, np.integer)):
        return Fraction(int(value))  # NumPy integers compare with floats in float64
    try:
        return Fraction(*value.as_integer_ratio())
    except (AttributeError, TypeError, ValueError, OverflowError):
        return None


def _nearest_f32(q: Fraction) -> float:
    """The float32 nearest to ``q`` (ties to even; ±inf from 2**128 - 2**103 on, as
    IEEE rounding overflows), in exact integer arithmetic: no floating-point flag
    of the caller's can touch it."""
    a = abs(q)
    if a == 0:
        return 0.0
    n, d = a.numerator, a.denominator
    e = n.bit_length() - d.bit_length()  # 2**(e - 1) < a < 2**(e + 1)
    if (n << max(0, -e)) < (d << max(0, e)):
        e -= 1  # now 2**e <= a < 2**(e + 1)
    quantum = max(e, -126) - 23  # float32's spacing at a (subnormal spacing below 2**-126)
    num, den = (n, d << quantum) if quantum >= 0 else (n << -quantum, d)
    m, rem = divmod(num, den)
    if 2 * rem > den or (2 * rem == den and m & 1):
        m += 1
    r = math.ldexp(m, quantum)  # exact: m <= 2**24
    if r >= 2.0**128:
        r = math.inf
    return -r if q < 0 else r


def _narrow_float(value: Any) -> Optional[float]:
    """A float32, bfloat16 or float16 scalar's finite value read from its bits, or
    None for other values: ``float()`` widens in hardware, and under a caller's
    denormals-are-zero flag that reads a subnormal as 0."""
    if isinstance(value, np.float32):
        bits, e_bits, m_bits = int(value.view(np.uint32)), 8, 23
    elif isinstance(value, np.float16):
        bits, e_bits, m_bits = int(value.view(np.uint16)), 5, 10
    elif isinstance(value, np.generic) and value.dtype == FLOAT_DTYPES["bfloat16"]:
        bits, e_bits, m_bits = int(value.view(np.uint16)), 8, 7
    else:
        return None
    e = (bits >> m_bits) & ((1 << e_bits) - 1)
    if e == (1 << e_bits) - 1:
        return None  # inf or NaN: float() keeps them
    m, bias = bits & ((1 << m_bits) - 1), (1 << (e_bits - 1)) - 1
    v = math.ldexp(m | (1 << m_bits) if e else m, max(e, 1) - bias - m_bits)  # exact
    return -v if bits >> (e_bits + m_bits) else v


def real_scalar(value: Any) -> bool:
    """Whether ``value`` is a real number a float parameter takes: an int, a float, a
    NumPy integer or float scalar (ml_dtypes' bfloat16 included), a ``Fraction`` or a
    ``Decimal``; never a bool or a time delta."""
    if isinstance(value, (bool, np.bool_, np.timedelta64)):
        return False
    if isinstance(value, (int, float, np.integer, np.floating, Fraction, Decimal)):
        return True
    return isinstance(value, np.generic) and value.dtype == FLOAT_DTYPES["bfloat16"]


def exact_value(value: Any) -> Any:
    """``value`` where it is held more precisely than a float and compares exactly (a
    long double, or a ``Fraction`` / ``Decimal``, subclasses copied to the base type so
    their comparisons are the base's), else None: a bound is then checked on it too,
    as it may lie past the bound by less than ``float(value)`` rounds away."""
    try:
        if isinstance(value, Fraction):
            return Fraction(value.numerator, value.denominator)
        if isinstance(value, Decimal):
            return Decimal(value)
    except Exception:  # a subclass whose fields are broken
        return None
    if isinstance(value, np.floating) and value.dtype.itemsize > 8:
        return value
    return None


def exact_float(value: Any) -> float:
    """``float(value)``, but a float32/float16/bfloat16 scalar is read from its bits,
    so a caller's denormals-are-zero flag cannot turn a subnormal into 0."""
    narrow = _narrow_float(value)
    return float(value) if narrow is None else narrow


def short_repr(value: Any) -> str:
    """``repr(value)`` shortened for a message (an int past Python's 4300-digit
    conversion limit, or whose repr fails, by its type)."""
    try:
        return reprlib.repr(value)
    except Exception:
        if isinstance(value, int):
            return f"an int of {value.bit_length()} bits"
        return f"a value of type {type(value).__name__}"


def float_for_f32(value: Any) -> float:
    """``float(value)``, moved one float64 step toward ``value`` where ``float(value)``
    lands exactly on a float32 rounding boundary that ``value`` itself is not on (a
    long double, a large int, a Fraction): rounding the result to float32 then gives
    ``value``'s own single rounding. A float is returned as it is, so storing the result
    and reading it back is stable. Raises what ``float(value)`` raises."""
    if type(value) is float:
        return value
    f = exact_float(value)  # a narrow scalar is a float32 value: returned just below
    if not math.isfinite(f):
        return f
    # Within half a float64 step of f, the value rounds as f does unless f is itself a
    # float32 rounding boundary (its two float64 neighbours round apart); a float32
    # value is never one. Only boundaries need the exact arithmetic below.
    r = _native.round_f32(f)
    if r == f or _native.round_f32(math.nextafter(f, -math.inf)) == _native.round_f32(
        math.nextafter(f, math.inf)
    ):
        return f
    q = _exact(value)
    if q is None or q == 0:
        return f  # a signed zero keeps its sign
    want = _nearest_f32(q)
    if r == want:
        return f
    g = math.nextafter(f, math.inf if q > Fraction(f) else -math.inf)
    return g if _native.round_f32(g) == want else f


def round_f32(value: Any) -> float:
    """A real number rounded once to float32, as a Python float, whatever the
    caller's floating-point flags (see :func:`float_for_f32`). Raises what
    ``float(value)`` raises."""
    return float(_native.round_f32(float_for_f32(value)))


def float_input(x: Any, arg: str) -> np.ndarray:
    """Prepare a floating input for the kernels without changing the caller's array.

    float32/float64/float16/bfloat16 arrays that are C-contiguous, aligned and
    in native byte order pass through untouched (the kernel reads them in
    place); other layouts cost one copy. Other dtypes raise ``TypeError``
    naming ``arg``.
    """
    if type(x) is np.ndarray and x.dtype in _READY:
        flags = x.flags
        if flags.c_contiguous and flags.aligned:
            return x  # the common case, checked first: small calls stay cheap
    if isinstance(x, np.ma.MaskedArray) and any_masked(x):
        # The kernels read every value: a masked outlier would set the scale.
        raise TypeError(
            f"{arg} is a masked array with masked values, which would be read as "
            f"values; pass {arg}.filled(fill_value) or {arg}.compressed()"
        )
    try:
        # A subclass as a plain array, through NumPy's own `view`: its `shape`,
        # `dtype` or `reshape` may say other than its memory holds (np.matrix
        # keeps two dimensions through every reshape).
        arr = np.ndarray.view(x, np.ndarray) if isinstance(x, np.ndarray) else np.asarray(x)
    except ValueError as e:  # a ragged nested list
        raise TypeError(f"{arg} must be a floating array: {e}") from None
    if arr.ndim >= 2 and _is_rows(x) and _masked_inside(x, arr.ndim - 1):
        # np.asarray drops the masks of the rows of a list: refused as the
        # masked array itself is (a masked element of a flat list becomes NaN).
        raise TypeError(
            f"{arg} holds a masked array with masked values, which would be read as "
            f"values; fill or drop them first"
        )
    dt = arr.dtype
    if not is_float_dtype(dt):
        raise TypeError(
            f"{arg} must be a floating array (float32, float64, float16 or bfloat16), "
            f"got dtype {dt}"
        )
    return kernel_layout(arr)


def any_masked(x: np.ma.MaskedArray) -> bool:
    """Whether ``x`` has a masked value. A structured array's (one mask a field)
    says no: its dtype is refused anyway, with a message naming the argument."""
    mask = np.ma.getmask(x)
    if mask is np.ma.nomask or mask.dtype.names is not None:
        return False
    return bool(mask.any())


def _is_rows(x: Any) -> bool:
    """Whether NumPy converts ``x`` row by row: a list, a tuple or another
    ``collections.abc.Sequence`` (a deque, a UserList) that is not itself an
    array, a string or a buffer (those convert whole, with no rows to hide)."""
    t = type(x)
    if t is list or t is tuple:
        return True
    return isinstance(x, Sequence) and not isinstance(x, _WHOLE)


_WHOLE = (str, bytes, bytearray, memoryview, range, np.ndarray)


def _masked_inside(x: Sequence[Any], depth: int) -> bool:
    """Whether the nested sequences ``x`` hold, within ``depth`` levels, a
    masked array with a masked value. Rows are tested, scalars never visited:
    the last level is one C-level ``isinstance`` sweep."""
    masked = np.ma.MaskedArray
    if any(map(isinstance, x, repeat(masked))):
        if any(isinstance(e, masked) and any_masked(e) for e in x):
            return True
    if depth > 1:
        for e in x:
            if _is_rows(e) and _masked_inside(e, depth - 1):
                return True
    return False


def scale_dtype(value: Any) -> np.dtype:
    """Normalize a ``scale_dtype`` argument to float16 or float32."""
    if value is None:  # NumPy reads None as float64: named as given
        raise InvalidConfigError("scale_dtype must be numpy.float16 or numpy.float32, got None")
    try:
        dt = np.dtype(value)
    except (TypeError, ValueError, SyntaxError):  # NumPy's parser raises all three
        raise InvalidConfigError(
            f"scale_dtype must be numpy.float16 or numpy.float32, got {value!r}"
        ) from None
    if dt not in (np.dtype(np.float16), np.dtype(np.float32)):
        # A container NumPy reads as a structured dtype ({} as `[]`) is named as given.
        shown = repr(value) if dt.names is not None or isinstance(value, (dict, list)) else dt
        raise InvalidConfigError(f"scale_dtype must be numpy.float16 or numpy.float32, got {shown}")
    return dt


def is_array_of(x: Any, *dtypes: Any) -> bool:
    """Whether ``x`` is an ndarray of one of ``dtypes`` in either byte order."""
    if not isinstance(x, np.ndarray):
        return False
    try:
        native = x.dtype.newbyteorder("=")
    except (TypeError, ValueError):  # NumPy 2's new-style dtypes (StringDType) have no byte order
        return False
    return native in [np.dtype(d) for d in dtypes]


def describe(x: Any) -> str:
    """How an argument is named in a TypeError: an array by dtype and shape, else its type."""
    if isinstance(x, np.ndarray):
        return f"array of dtype {x.dtype} and shape {x.shape}"
    return type(x).__name__


_BASE = np.ndarray.base.__get__
_FLAGS = np.ndarray.flags.__get__


def readonly(arr: np.ndarray) -> np.ndarray:
    """Mark an array this library created as read-only (results are frozen) and return
    it; one that owns its memory is handed out as a view, which NumPy will not let
    anyone make writable again (its owner would allow it)."""
    base = _BASE(arr)
    if isinstance(base, np.ndarray) and _BASE(base) is None:
        base.setflags(write=False)  # a reshape of a buffer it made: that buffer too
    arr.setflags(write=False)  # (setflags: no flags object built, on every result)
    return arr.view() if base is None else arr


#: Arrays this package allocated, filled and made read-only without handing them
#: out writable (a file's tensors as they are read), by id, with a weak reference
#: that drops the entry when the array goes.
_OWNED: Dict[int, weakref.ref[np.ndarray]] = {}


def owned(arr: np.ndarray) -> np.ndarray:
    """Mark ``arr``, which this package just allocated and filled, read-only and
    private, and return a view of it to hold: a value built on the view may keep it
    without a copy, and NumPy lets no view of a read-only owner become writable.
    Only for arrays no caller has seen, and whose memory is their own."""
    arr.flags.writeable = False
    key = id(arr)

    def forget(_ref: weakref.ref[np.ndarray]) -> None:
        _OWNED.pop(key, None)

    _OWNED[key] = weakref.ref(arr, forget)
    return arr.view()


def _private(arr: np.ndarray) -> bool:
    """Whether nothing can write ``arr``'s memory: it and every array it views are
    read-only, down to memory that is immutable (``bytes``) or that this package
    owns (a file's tensors as read, its private copies: NumPy lets no view of a
    read-only owner become writable again). Read-only memory a caller owns is not
    private: its owner may set ``writeable`` again and change it."""
    # NumPy's own descriptors: a subclass may override `base` or `flags`.
    a: Any = arr
    last = arr
    while isinstance(a, np.ndarray):
        if _FLAGS(a).writeable:
            return False
        last, a = a, _BASE(a)
    if a is None:
        # Not the output cache's buffers: a read-only one may also back a writable
        # output (a dequantized array) that the caller holds.
        ref = _OWNED.get(id(last))
        return ref is not None and ref() is last
    return isinstance(a, bytes)


def held(arr: np.ndarray) -> np.ndarray:
    """The array a frozen value holds for ``arr``: ``arr`` itself if the kernels can
    read it in place and nothing can change it, else one read-only private copy in
    a layout the kernels read; a plain ndarray either way (``np.matrix`` and other
    subclasses change how reshaping and comparison work). Validate the result, not
    ``arr``: a copy made first cannot change between the check and its use. The
    caller's array keeps its flags.
    """
    out = kernel_layout(arr)
    if out is arr:
        if _private(arr):
            return arr if type(arr) is np.ndarray else arr.view(np.ndarray)
        out = np.array(arr, order="C", subok=False)
    # A private copy: held through a read-only view, as `readonly` hands results out.
    return owned(out)


def warn(message: str, category: Type[Warning]) -> None:
    """``warnings.warn`` attributed to the first caller outside this package,
    however deep inside it (registry, CLI helpers, ...) the warning is raised."""
    frame = sys._getframe(1)
    level = 2
    while frame.f_back is not None and os.path.dirname(
        os.path.abspath(frame.f_code.co_filename)
    ).startswith(_PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)


def renamed(e: QuantizationError, old: str, new: str) -> QuantizationError:
    """The same error with the argument it names changed (``x`` -> ``weight``)."""
    text = str(e)
    if text.startswith(old + " "):
        text = new + text[len(old) :]
    if isinstance(e, NonFiniteError):
        return NonFiniteError(text, e.index)
    return type(e)(text)
