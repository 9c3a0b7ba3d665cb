"""The base of every quantized result dataclass.

A family declares its dataclass fields, which of them are arrays
(``_arrays``; those in ``_optional`` may be ``None``) and which are JSON
parameters (``_params``), and its ``scheme`` tag; :class:`Quantized` then
gives it value equality, a one-line ``repr``,
``nbytes``, the record used by the file format, ``to_bytes`` / ``from_bytes``,
and registers the scheme with :mod:`ferroquant._format` when the class is
defined. The family's ``__post_init__`` validates what a user passes; kernel
results skip that through :meth:`Quantized._trusted`, so small calls stay cheap.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type, TypeVar

import ml_dtypes
import numpy as np

from . import _ferroquant as _native
from . import _format
from ._checks import FLOAT_DTYPES, _nearest_f32, kernel_layout, owned
from .errors import FormatError, InvalidConfigError

Q = TypeVar("Q", bound="Quantized")
R = TypeVar("R", bound="Record")


def arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Same dtype, same shape, same values (NaN never appears in a valid value)."""
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def f32_ratio(original: int, compressed: int) -> float:
    """The seeds' ``original as f32 / compressed as f32`` (1.0 when nothing is held)."""
    if compressed == 0:
        return 1.0
    return float(np.float32(original) / np.float32(compressed))


def unpack_int4(data: np.ndarray, n: int) -> np.ndarray:
    """Sign-extended int4 nibbles of ``data``, low nibble first, ``n`` values.

    Written in place into the one output array (no temporaries the size of it).
    """
    out = np.empty(2 * data.size, np.int8)
    u = out.view(np.uint8)
    np.bitwise_and(data, 0x0F, out=u[0::2])
    np.right_shift(data, 4, out=u[1::2])
    np.bitwise_xor(u, 8, out=u)
    np.subtract(out, 8, out=out)
    return out[:n]


def first_int4_outside(data: np.ndarray, n: int, lo: int, hi: int) -> Optional[Tuple[int, int]]:
    """(index, code) of the first of the ``n`` packed int4 codes outside ``lo..hi``,
    or None; a slice at a time, so checking a file's codes never unpacks them all."""
    codes = np.arange(256, dtype=np.int16)
    low, high = ((codes & 15) ^ 8) - 8, ((codes >> 4) ^ 8) - 8
    bad = ((low < lo) | (low > hi)) | ((high < lo) | (high > hi))
    step = 1 << 20
    for start in range(0, data.size, step):
        part = data[start : start + step]
        hits = np.flatnonzero(bad[part])
        for b in hits[:2]:  # at most the unused high nibble of an odd tail, then a real one
            i = start + int(b)
            for k, code in ((2 * i, int(low[data[i]])), (2 * i + 1, int(high[data[i]]))):
                if k < n and not lo <= code <= hi:
                    return k, code
    return None


def check_codes(data: np.ndarray, n: int, lo: int, hi: int, int4: bool) -> None:
    """InvalidConfigError naming the first of the ``n`` codes of ``data`` (packed two a
    byte when ``int4``) outside ``lo..hi``; nothing the size of the codes is made."""
    if int4:
        found = first_int4_outside(data, n, lo, hi)
    elif data.size and (data.min() < lo or data.max() > hi):
        k = int(np.flatnonzero((data < lo) | (data > hi))[0])
        found = k, int(data[k])
    else:
        found = None
    if found is not None:
        raise InvalidConfigError(
            f"data must hold codes in {lo}..{hi}, got {found[1]} at index {found[0]}"
        )


#: float32's largest finite value.
F32_MAX = np.float32(np.finfo(np.float32).max)


def first_true(mask: np.ndarray) -> Optional[int]:
    """The flat index of ``mask``'s first True, None if there is none."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


#: The largest magnitude of each source dtype that float32 holds: the largest a
#: kernel sees (they read every source as float32).
SOURCE_MAX = {
    name: np.float32(min(float(F32_MAX), float(ml_dtypes.finfo(dt).max)))
    for name, dt in FLOAT_DTYPES.items()
}


@functools.cache
def _largest_scale(dtype: str, divisor: int, scale_dtype: str) -> Any:
    """``SOURCE_MAX[dtype] / divisor`` rounded as the kernels round a scale, to the
    nearest float32 (and float16 scales from that to the nearest float16: past
    float16's range, every finite float16 scale is in reach), whatever rounding
    mode the caller has set: NumPy's division and casts follow it, so under
    ``FE_DOWNWARD`` a scale the kernels made for float32's largest value was refused."""
    exact = Fraction(float(SOURCE_MAX[dtype])) / divisor
    largest = np.array([_nearest_f32(exact)], np.float32)  # exact: a float32 value
    if np.dtype(scale_dtype) == np.float16:
        bits = _native.fp32_to_fp16_bits(largest)  # rounds natively, to nearest
        return bits.view(np.float16)[0]
    return largest.astype(np.dtype(scale_dtype))[0]


def check_scales(scales: np.ndarray, divisor: int, where: str = "", dtype: str = "float32") -> None:
    """InvalidConfigError naming the first scale that is NaN, infinite or negative
    (-0.0 included), or larger than any scale ``max|x| / divisor`` (in float32, as the
    kernels make it) of a finite ``dtype`` input: its largest value / ``divisor``. A
    larger one could only come from a hand-made or corrupt value, and dequantizes past
    anything the source held (to inf in float32). ``where`` names the group kind in the
    message ("block ")."""
    if not scales.size:
        return
    bad = first_true(~(np.isfinite(scales) & (scales >= 0) & ~np.signbit(scales)))
    if bad is not None:
        raise InvalidConfigError(
            f"scales must be finite and >= 0, got {scales[bad]} at {where}{bad}"
        )
    top = SOURCE_MAX[dtype]
    largest = _largest_scale(dtype, divisor, scales.dtype.str)
    bad = first_true(scales > largest)
    if bad is not None:
        raise InvalidConfigError(
            f"scales must be at most {largest} ({dtype}'s largest value {top:g} / "
            f"{divisor}, the largest scale a finite {dtype} input gives), got "
            f"{scales[bad]} at {where}{bad}"
        )


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


#: Module names of this package start with this.
_PACKAGE = __name__.rpartition(".")[0] + "."


def _rebuild(cls: Type[Q], fields: Dict[str, Any]) -> Q:
    """Unpickle: every array is copied into a private read-only one. Arrays over
    buffers passed out of band (protocol 5) are the caller's memory; and an array
    pickle or ``copy.deepcopy`` made from its own bytes may also be reachable
    elsewhere in what was loaded (``deepcopy((q.data, q))`` hands the caller the
    very array the copy of ``q`` holds), whose owner could make it writable again.
    The fields are then checked as the constructor checks a caller's: a pickle is
    bytes from elsewhere, and a value built from a corrupt one without the checks
    would dequantize to garbage and save a file that ``load`` refuses. The checks
    are ferroquant's class's (the first in ``cls``'s MRO): a subclass's own
    ``__init__`` or ``__post_init__`` is not run again, as the value it made is
    being restored, not made."""
    fields = dict(fields)
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise TypeError(f"a pickled {cls.__name__} with fields it does not have: {unknown[:5]}")
    for name in cls._arrays:
        arr = fields.get(name)
        if isinstance(arr, np.ndarray):
            out = kernel_layout(arr)  # native order, aligned, C order: a copy, or ``arr``
            fields[name] = owned(np.array(out, subok=False) if out is arr else out)
    ours = next(k for k in cls.__mro__ if k.__module__.startswith(_PACKAGE))
    own = dataclasses.fields(ours)
    checked = ours(**{f.name: fields[f.name] for f in own if f.init and f.name in fields})
    if cls is ours:
        return checked
    fields.update((f.name, getattr(checked, f.name)) for f in own)
    return cls._trusted(**fields)


def ratio_text(ratio: float, digits: int) -> str:
    """A compression ratio for a repr: ``3.88x``, or ``n/a`` for an empty tensor's
    (the seed's 0 / 0 is NaN: there is nothing to compress)."""
    return "n/a" if ratio != ratio else f"{ratio:.{digits}f}x"


class Record:
    """What the file format needs of a frozen dataclass: its scheme tag, which
    fields are arrays and which JSON parameters, and ``to_bytes`` /
    ``from_bytes``. :class:`Quantized` adds value equality and the rest; the
    settings dataclasses (``QuantConfig``, ``MaxAbs``, ...) and ``QuantStats``
    use this alone and keep their dataclass equality and hashing."""

    scheme: ClassVar[str]
    _arrays: ClassVar[Tuple[str, ...]] = ()
    _params: ClassVar[Tuple[str, ...]] = ()
    #: Array fields that may be ``None`` (left out of the record when they are).
    _optional: ClassVar[Tuple[str, ...]] = ()
    #: Parameters added to the record after files were first written: always
    #: written, and a file without one gets the field's default.
    _later_params: ClassVar[Tuple[str, ...]] = ()

    #: The tag files record for this class, when ``scheme`` is a field of its own
    #: (the seed's ``QuantizedModel.scheme``) rather than the class's tag.
    _tag: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_tag" in cls.__dict__:
            _format.register_scheme(cls.__dict__["_tag"], cls)
        elif "scheme" in cls.__dict__:
            _format.register_scheme(cls.scheme, cls)

    @property
    def label(self) -> str:
        """The registry name of the scheme that made this value (the scheme tag by default)."""
        return self.scheme

    @property
    def nbytes(self) -> int:
        """Bytes actually held by the arrays."""
        arrays = (getattr(self, a) for a in self._arrays)
        return int(sum(a.nbytes for a in arrays if a is not None))

    def _record(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """Arrays and JSON-able parameters that describe this value completely."""
        return (
            {a: getattr(self, a) for a in self._arrays if getattr(self, a) is not None},
            {p: _jsonable(getattr(self, p)) for p in self._params},
        )

    @classmethod
    def _from_record(
        cls: Type[R], arrays: Mapping[str, np.ndarray], params: Mapping[str, Any]
    ) -> R:
        """Rebuild from a record read from untrusted bytes: the constructor
        validates everything; whatever it refuses is a FormatError."""
        try:
            return cls(**arrays, **params)
        except MemoryError:
            raise
        except Exception as e:  # untrusted input: whatever the class refuses is a FormatError
            raise _format.as_format_error(cls.scheme, e) from None

    def to_bytes(self) -> bytes:
        """Serialize to safetensors bytes (see :func:`ferroquant.save`)."""
        return _format.dump_bytes({_format.SINGLE: self}, None)

    @classmethod
    def from_bytes(cls: Type[R], data: bytes) -> R:
        """Inverse of :meth:`to_bytes`; raises FormatError on bad bytes."""
        out = _format.parse_bytes(data)
        if list(out) != [_format.SINGLE]:
            raise FormatError(f"bytes hold tensors {sorted(out)[:5]}, not one serialized value")
        value = out[_format.SINGLE]
        if not isinstance(value, cls):
            raise FormatError(f"bytes hold a {type(value).__name__}, not a {cls.__name__}")
        return value


class Quantized(Record):
    """Base class of ferroquant's frozen result dataclasses (see the module docs)."""

    @classmethod
    def _trusted(cls: Type[Q], **fields: Any) -> Q:
        """Build from arrays a kernel just made (read-only, consistent): no re-validation."""
        obj = object.__new__(cls)
        # A frozen dataclass without slots keeps its fields in __dict__; writing
        # it directly skips __setattr__ (and dataclasses.fields) on every call.
        obj.__dict__.update(fields)
        return obj

    def compression_ratio(self) -> float:  # pragma: no cover - every family overrides it
        raise NotImplementedError

    def _repr_fields(self) -> str:
        """Family-specific ``key=value`` pairs for ``repr`` (besides shape, scheme, ratio)."""
        return ""

    def __repr__(self) -> str:
        extra = self._repr_fields()
        return (
            f"{type(self).__name__}(shape={getattr(self, 'shape', None)}, "
            f"scheme={self.label!r}{', ' + extra if extra else ''}, "
            f"ratio={ratio_text(self.compression_ratio(), 2)})"
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, np.ndarray):
            return False  # not NumPy's elementwise comparison: a value is not an array
        if type(other) is not type(self):
            return NotImplemented
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if not f.compare:
                continue  # provenance, not part of the value (QuantizedWeights.dtype)
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in self._arrays:
                if (a is None or b is None) and a is not b:
                    return False
                if a is not None and not arrays_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal by value, not hashable

    def _field_hash(self) -> int:
        """``__hash__`` for a value that holds no arrays: its compared fields, as ``==``
        reads them (a subclass sets ``__hash__ = Quantized._field_hash``)."""
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        return hash((type(self), *(getattr(self, f.name) for f in fields if f.compare)))

    # NumPy defers to this class in `array == value` (no elementwise comparison).
    __array_ufunc__ = None

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        # pickle and copy.deepcopy rebuild the arrays as fresh, private copies;
        # _rebuild makes them read-only again, as the original's were.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return (_rebuild, (type(self), fields))
