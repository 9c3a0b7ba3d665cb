"""Dynamic activation quantization (SPEC §3, seed 002): a scale computed from the
values being quantized, per tensor or per row, by max-abs or a percentile.

``scale = statistic / clip`` (clip 127 for int8, 7 for int4; 0 when the statistic is
0), codes ``clamp(round(v / scale), -clip, clip)`` in float32, all zero when the
scale is 0. The percentile statistic is the element of rank ``ceil(p·n) - 1`` of the
sorted ``|x|``, found by O(n) selection.
"""

from __future__ import annotations

import math
import operator
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Tuple, Union

import numpy as np

from . import _ferroquant as _native
from ._base import (
    Quantized,
    Record,
    check_codes,
    check_scales,
    f32_ratio,
    first_true,
    unpack_int4,
)
from ._checks import (
    any_masked,
    beyond_f32,
    describe,
    exact_float,
    exact_int,
    exact_value,
    float32_shape,
    float_for_f32,
    float_input,
    held,
    is_array_of,
    readonly,
    real_scalar,
    renamed,
    round_f32,
    shape_tuple,
    short_repr,
    source_dtype,
    to_float32,
    warn,
)
from .errors import InvalidConfigError, NonFiniteError, PrecisionWarning, ShapeMismatchError

__all__ = [
    "CalibStats",
    "DynQuantTensor",
    "MaxAbs",
    "Percentile",
    "SmoothQuantConfig",
    "compute_scale",
    "compute_smooth_factors",
    "dynamic_quantize_int4",
    "dynamic_quantize_int8",
    "dynamic_quantize_int8_per_row",
    "quantization_mae",
    "smooth_activations",
    "smooth_weights",
]

FORMATS = ("int8_per_tensor", "int8_per_row", "int4_per_tensor")


@dataclass(frozen=True)
class MaxAbs(Record):
    """Scale from the largest ``|x|`` (seed 002's ``DynamicScaleMode::MaxAbs``)."""

    scheme: ClassVar[str] = "max-abs"


@dataclass(frozen=True)
class Percentile(Record):
    """Scale from the ``p``-th percentile of ``|x|``, ``p`` in (0, 1] (0.99: the
    99th), more robust to outliers than :class:`MaxAbs`.

    Raises:
        InvalidConfigError: ``p`` is not a number in (0, 1].
    """

    p: float

    scheme: ClassVar[str] = "percentile"
    _params: ClassVar[Tuple[str, ...]] = ("p",)

    def __post_init__(self) -> None:
        p = self.p
        if not real_scalar(p):
            raise InvalidConfigError(
                f"p must be a real number (int, float, NumPy scalar, Fraction or Decimal) "
                f"in (0, 1], got {short_repr(p)}"
            )
        try:
            p = exact_float(p)
        except Exception:  # too large for a float, or a broken __float__
            raise InvalidConfigError(f"p must be in (0, 1], got {short_repr(self.p)}") from None
        # A long double, Fraction or Decimal just above 1 rounds to 1.0: its upper
        # bound is checked as given. (Nothing else is compared as given: a caller's
        # denormals-are-zero flag would read a float32 subnormal as 0, and a float
        # subclass may compare as it likes.)
        given = exact_value(self.p)
        if not (0.0 < p <= 1.0) or (given is not None and given > 1):
            raise InvalidConfigError(f"p must be in (0, 1], got {short_repr(self.p)}")
        object.__setattr__(self, "p", p)


ScaleMode = Union[MaxAbs, Percentile]


def _percentile(mode: Any) -> Any:
    """The native argument for a scale mode: None (max-abs) or p."""
    if isinstance(mode, MaxAbs):
        return None
    if isinstance(mode, Percentile):
        return mode.p
    raise TypeError(f"mode must be MaxAbs() or Percentile(p), got {type(mode).__name__}")


@dataclass(frozen=True, eq=False, repr=False)
class DynQuantTensor(Quantized):
    """A dynamically quantized tensor (SPEC §3, seed 002's ``DynQuantTensor``).

    Attributes:
        data: ``int8[n]`` codes, or for ``int4_per_tensor`` ``uint8[ceil(n / 2)]``,
            two codes a byte (element ``2i`` in the low nibble).
        scales: ``float32[k]``: one per tensor, one per row for ``int8_per_row``
            (none when the per-row input is empty).
        shape: the input's shape.
        format: ``"int8_per_tensor"``, ``"int8_per_row"`` or ``"int4_per_tensor"``.
        dtype: the dtype the input had (the quantize functions record it; ``ferroquant
            dequantize`` restores it, while :meth:`dequantize` returns float32 as the
            seed does). Provenance, not part of the value: not compared by ``==``.
    """

    data: np.ndarray
    scales: np.ndarray
    shape: Tuple[int, ...]
    format: str = "int8_per_tensor"
    dtype: str = field(default="float32", compare=False)

    scheme: ClassVar[str] = "dynamic"
    _arrays: ClassVar[Tuple[str, ...]] = ("data", "scales")
    _params: ClassVar[Tuple[str, ...]] = ("shape", "format", "dtype")
    _later_params: ClassVar[Tuple[str, ...]] = ("dtype",)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidConfigError(
                f"format must be one of {', '.join(FORMATS)}, got {self.format!r}"
            )
        shape = shape_tuple(self.shape, dtype=self.dtype, at_least=4)  # float32 values
        n = math.prod(shape)
        int4 = self.format == "int4_per_tensor"
        want_dtype, want_len = (np.uint8, -(-n // 2)) if int4 else (np.int8, n)
        data, scales = self.data, self.scales
        if not isinstance(data, np.ndarray) or data.dtype != want_dtype:
            raise TypeError(
                f"data must be a {np.dtype(want_dtype).name} array for {self.format}, "
                f"got {describe(data)}"
            )
        if not is_array_of(scales, np.float32):
            raise TypeError(f"scales must be a float32 array, got {describe(scales)}")
        if self.format == "int8_per_row":
            if len(shape) != 2:
                raise ShapeMismatchError(f"shape: int8_per_row needs a 2-D shape, got {shape}")
            k = shape[0] if n else 0
        else:
            k = 1
        if data.shape != (want_len,):
            raise ShapeMismatchError(
                f"data: expected shape ({want_len},) for shape {shape}, got {data.shape}"
            )
        if scales.shape != (k,):
            raise ShapeMismatchError(
                f"scales: expected shape ({k},) for {self.format} of {shape}, got {scales.shape}"
            )
        data, scales = held(data), held(scales)
        clip = 7 if int4 else 127
        check_scales(scales, clip, dtype=source_dtype(self.dtype))
        if int4 and n % 2 and data.size and data[-1] >> 4:
            raise InvalidConfigError("the unused high nibble of the last byte must be 0")
        check_codes(data, n, -clip, clip, int4)
        # SPEC §3: a group whose scale is 0 is all zeros (any other code would
        # dequantize to 0 all the same: a value no kernel makes). Zero by the bits
        # (check_scales refused -0.0): under a caller's denormals-are-zero flag a
        # subnormal scale compares equal to 0.
        zero = scales.view(np.uint32) == 0
        if data.size and zero.any():
            bad = first_true(zero & data.reshape(k, -1).any(axis=1))
            if bad is not None:
                where = f" (row {bad})" if self.format == "int8_per_row" else ""
                raise InvalidConfigError(
                    f"data: the codes of a group whose scale is 0 must be 0, got a "
                    f"nonzero code{where}"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "dtype", source_dtype(self.dtype))

    @property
    def label(self) -> str:
        """The registry name of the scheme that made this value (``dynamic-int8``,
        ``dynamic-int8-per-row`` or ``dynamic-int4``)."""
        return {
            "int8_per_tensor": "dynamic-int8",
            "int8_per_row": "dynamic-int8-per-row",
            "int4_per_tensor": "dynamic-int4",
        }[self.format]

    @property
    def bits(self) -> int:
        """Bits per code: 8 or 4."""
        return 4 if self.format == "int4_per_tensor" else 8

    def element_count(self) -> int:
        """Number of values (not packed bytes)."""
        return math.prod(self.shape)

    def memory_bytes(self) -> int:
        """Bytes held: data (packed for int4) + 4 a scale."""
        return int(self.data.size + 4 * self.scales.size)

    def size_bytes(self) -> int:
        """Same as :meth:`memory_bytes`."""
        return self.memory_bytes()

    def compression_ratio(self) -> float:
        """``4·n / memory_bytes()`` in f32, as the seed (1.0 when nothing is held)."""
        return f32_ratio(4 * self.element_count(), self.memory_bytes())

    def values(self) -> np.ndarray:
        """The int8 codes in the input's shape (int4 unpacked, sign-extended), as a new
        array of the caller's own."""
        if self.format == "int4_per_tensor":
            # Unpacked straight into the new array (a copy of it doubled the peak).
            return unpack_int4(self.data, self.element_count()).reshape(self.shape)
        return np.array(self.data, np.int8).reshape(self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 values ``code * scale`` in the input's shape."""
        n = self.element_count()
        group = (self.shape[1] if self.format == "int8_per_row" else n) if n else 0
        flat = _native.dequantize_groups(
            self.data, n, group, self.scales, self.format == "int4_per_tensor"
        )
        return flat.reshape(self.shape)

    def _repr_fields(self) -> str:
        src = "" if self.dtype == "float32" else f", dtype={self.dtype}"
        return f"format={self.format}{src}"


def compute_scale(x: Any, clip_val: float, mode: ScaleMode = MaxAbs()) -> float:
    """Seed 002's ``compute_scale`` over all of ``x``: ``statistic / clip_val``, 0.0 for
    empty or all-zero input. The quotient is float32's, as the seed's: a ``clip_val``
    so small that it overflows (a subnormal clip, say) gives ``inf``.

    Raises:
        TypeError: ``x`` is not a floating array, or ``mode`` is not a scale mode.
        InvalidConfigError: ``clip_val`` is not finite and > 0 in float32.
        NonFiniteError: ``x`` holds NaN or an infinity.
    """
    p = _percentile(mode)
    if not real_scalar(clip_val):
        raise TypeError(f"clip_val must be a real number, got {type(clip_val).__name__}")
    # Rounded once, natively (beyond float32's range: inf): NumPy's float32() would
    # flush a subnormal clip to 0 under a caller's flush-to-zero.
    try:
        clip = round_f32(clip_val)
    except OverflowError:  # an int past float64's range
        clip = math.inf
    except Exception:  # a broken __float__
        raise InvalidConfigError(
            f"clip_val must be a float32 number, got {short_repr(clip_val)}"
        ) from None
    if not (math.isfinite(clip) and clip > 0):
        raise InvalidConfigError(
            f"clip_val must be finite and > 0 in float32, got {short_repr(clip_val)}"
        )
    arr = float_input(x, "x")
    try:
        return float(_native.compute_scale(arr, clip, p))
    except NonFiniteError as e:
        raise beyond_f32(e, arr) from None


def _quantize(x: Any, fmt: str, mode: Any, arg: str = "x") -> DynQuantTensor:
    p = _percentile(mode)
    arr = float_input(x, arg)
    float32_shape(arr.shape, arg)
    if fmt == "int8_per_row" and arr.ndim != 2:
        raise ShapeMismatchError(f"x2d must be a 2-D array, got {arr.ndim}-D shape {arr.shape}")
    try:
        data, scales = _native.quantize_dynamic(arr, fmt, p)
    except NonFiniteError as e:
        e = beyond_f32(e, arr)
        raise (e if arg == "x" else renamed(e, "x", arg)) from None
    return DynQuantTensor._trusted(
        data=readonly(data),
        scales=readonly(scales),
        shape=arr.shape,
        format=fmt,
        dtype=source_dtype(arr.dtype),
    )


def dynamic_quantize_int8(x: Any, mode: ScaleMode = MaxAbs()) -> DynQuantTensor:
    """int8 codes with one scale for the whole tensor (any shape).

    Raises:
        TypeError: ``x`` is not a floating array.
        NonFiniteError: ``x`` holds NaN or an infinity.
    """
    return _quantize(x, "int8_per_tensor", mode)


def dynamic_quantize_int8_per_row(x2d: Any, mode: ScaleMode = MaxAbs()) -> DynQuantTensor:
    """int8 codes with one scale per row of a 2-D array.

    Raises:
        ShapeMismatchError: ``x2d`` is not 2-D.
        TypeError / NonFiniteError: as :func:`dynamic_quantize_int8`.
    """
    return _quantize(x2d, "int8_per_row", mode, "x2d")


def dynamic_quantize_int4(x: Any, mode: ScaleMode = MaxAbs()) -> DynQuantTensor:
    """int4 codes in -7..7, packed two a byte, with one scale for the tensor."""
    return _quantize(x, "int4_per_tensor", mode)


def quantization_mae(original: Any, q: DynQuantTensor) -> float:
    """Seed 002's mean absolute error between ``original`` and ``q.dequantize()``,
    over the common length of the flattened arrays, accumulated in f32 in order."""
    if not isinstance(q, DynQuantTensor):
        raise TypeError(f"q must be a DynQuantTensor, got {type(q).__name__}")
    orig = float_input(original, "original").reshape(-1)  # read as f32 by the kernel
    n = q.element_count()
    group = (q.shape[1] if q.format == "int8_per_row" else n) if n else 0
    # The seed's iterator sum, in order in f32, of |x - code * scale|, in the crate,
    # each value dequantized as it is read (no temporary the size of the input).
    try:
        mae = _native.quantization_mae(
            orig, q.data, n, group, q.scales, q.format == "int4_per_tensor"
        )
    except NonFiniteError as e:
        raise beyond_f32(e, orig) from None
    return float(mae)


# -- SmoothQuant ----------------------------------------------------------------------


@dataclass(frozen=True)
class SmoothQuantConfig(Record):
    """Seed 002's SmoothQuant settings.

    Args:
        alpha: how much of the difficulty moves to the weights, in [0, 1].
        epsilon: floor of the factors (and offset before the powers); at least 1e-10
            is used.

    Raises:
        InvalidConfigError: ``alpha`` outside [0, 1] (the seed's ``InvalidAlpha``)
            or a non-finite ``epsilon``.
    """

    alpha: float = 0.5
    epsilon: float = 1e-5

    scheme: ClassVar[str] = "smooth-quant-config"
    _params: ClassVar[Tuple[str, ...]] = ("alpha", "epsilon")

    def __post_init__(self) -> None:
        given = {}
        for name in ("alpha", "epsilon"):
            v = getattr(self, name)
            if not real_scalar(v):
                raise InvalidConfigError(f"{name} must be a real number, got {short_repr(v)}")
            try:
                # The float whose float32 rounding is the value's own (a long double or
                # a large int can land on a float32 midpoint as a float64 first).
                object.__setattr__(self, name, float_for_f32(v))
            except Exception:  # float() refused it (too large, or a broken __float__)
                raise InvalidConfigError(
                    f"{name} must be a float32 number, got {short_repr(v)}"
                ) from None
            given[name] = v
        a = given["alpha"]
        # Also as given where that is exact: a long double, Fraction or Decimal just
        # above 1 is out (its float is 1.0). The float first: a Decimal NaN raises
        # on comparison.
        exact = exact_value(a)
        if not (0 <= self.alpha <= 1) or (exact is not None and not (0 <= exact <= 1)):
            raise InvalidConfigError(f"alpha must be in [0, 1], got {short_repr(a)}")
        eps32 = _native.round_f32(self.epsilon)
        if not (math.isfinite(eps32) and eps32 >= 0):
            raise InvalidConfigError(
                f"epsilon must be finite and >= 0 in float32, got {short_repr(given['epsilon'])}"
            )


def compute_smooth_factors(
    activations: Any, weights: Any, config: SmoothQuantConfig = SmoothQuantConfig()
) -> np.ndarray:
    """Seed 002's ``compute_smooth_factors``: ``float32[in]`` factors
    ``max((amax_j + eps)^alpha / (wmax_j + eps)^(1 - alpha), eps)`` from ``activations[tokens, in]``
    and ``weights[out, in]``, in f32 with ``f32::powf``.

    Raises:
        TypeError: an argument is not a floating array, or ``config`` not a
            SmoothQuantConfig.
        ShapeMismatchError: an argument is not 2-D or their ``in`` differ.
        NonFiniteError: an argument holds NaN or an infinity.
    """
    if not isinstance(config, SmoothQuantConfig):
        raise TypeError(f"config must be a SmoothQuantConfig, got {type(config).__name__}")
    a = float_input(activations, "activations")
    w = float_input(weights, "weights")
    for name, arr in (("activations", a), ("weights", w)):
        if arr.ndim != 2:
            raise ShapeMismatchError(f"{name} must be 2-D, got shape {arr.shape}")
    if a.shape[1] != w.shape[1]:
        raise ShapeMismatchError(
            f"weights: expected {a.shape[1]} input features (columns) as activations, "
            f"got {w.shape[1]}"
        )
    alpha, eps = _native.round_f32(config.alpha), _native.round_f32(config.epsilon)
    try:
        return _native.compute_smooth_factors(a, w, a.shape[1], alpha, eps)  # the caller's
    except NonFiniteError as e:
        raise beyond_f32(beyond_f32(e, a, "activations"), w, "weights") from None


def _smooth(x: Any, arg: str, s: Any, multiply: bool) -> np.ndarray:
    if isinstance(x, np.ma.MaskedArray) and any_masked(x):
        # As every float input: the masked values would be smoothed as values.
        raise TypeError(f"{arg} is a masked array with masked values; smooth {arg}.data instead")
    if isinstance(x, np.ndarray) and x.dtype.kind not in "fV":
        # Integer, bool, complex, object, ...: not a float array at all (general rules).
        raise TypeError(f"{arg} must be a writable C-contiguous float32 array, got {describe(x)}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError(f"{arg} must be a writable C-contiguous float32 array, got {describe(x)}")
    if not (x.flags.c_contiguous and x.flags.writeable):
        raise ValueError(f"{arg} must be a writable C-contiguous float32 array")
    # The factors: any float dtype or layout (f64/f16/bf16 rounded to f32 one by
    # one), read in place when they already are aligned contiguous float32.
    # (Shapes checked before the conversion: a wrong `s` of no elements and an
    # absurd shape would otherwise fail to allocate its float32 copy first.)
    factors = float_input(s, "s")
    if x.ndim != 2:
        raise ShapeMismatchError(f"{arg} must be 2-D, got shape {x.shape}")
    if factors.shape != (x.shape[1],):
        raise ShapeMismatchError(
            f"s: expected shape ({x.shape[1]},), one factor per column of {arg}, "
            f"got {factors.shape}"
        )
    factors = to_float32(factors)
    # Factors that share memory with the array (s = a[0]) are read as they were.
    if np.shares_memory(x, factors):
        factors = factors.copy()
    if x.flags.aligned:
        _native.smooth_in_place(x, arg, factors, multiply)
        return x
    # A misaligned buffer (a view at an odd byte offset): smoothed in an aligned
    # copy, written back only once every check has passed.
    work = np.empty_like(x)
    np.copyto(work, x)
    _native.smooth_in_place(work, arg, factors, multiply)
    np.copyto(x, work)
    return x


def smooth_activations(a: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``a[i, j] /= s[j]`` **in place** on a writable C-contiguous float32
    ``[tokens, in]`` array; returns ``a``. Nothing is modified on error.

    Any finite factor is taken as the seed takes it (a negative one flips signs).

    Raises:
        ValueError: ``a`` is a float array but not a writable C-contiguous float32 one.
        TypeError: ``a`` is an integer, bool, complex or object array, or ``s`` is
            not a floating array (any float dtype and layout is read, rounded to
            float32 value by value).
        ShapeMismatchError: ``a`` is not 2-D or ``s`` is not ``[in]``.
        NonFiniteError / InvalidConfigError: ``a`` or ``s`` holds NaN or inf, a
            factor is 0 (every quotient by it is ±inf or NaN), or a factor would
            take a finite value of ``a`` past float32's range (a subnormal factor,
            say; ``InvalidConfigError`` naming ``s`` and the element).
    """
    return _smooth(a, "a", s, False)


def smooth_weights(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``w[i, j] *= s[j]`` **in place** on a writable C-contiguous float32
    ``[out, in]`` array; returns ``w``. Errors as :func:`smooth_activations`, except
    that a factor of 0 is allowed (the column becomes 0, as in the seed)."""
    return _smooth(w, "w", s, True)


# -- Calibration statistics -----------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CalibStats(Quantized):
    """Seed 002's calibration statistics over every value of every batch.

    Attributes:
        min, max: exact float32 extremes.
        mean, std_dev: population mean and standard deviation, accumulated in f64.
        p99: the exact float32 ``|x|`` of rank ``ceil(0.99·n) - 1``.
        suggested_scale: ``p99 / 127``, else ``max|x| / 127``, else ``1 / 127``.

    Saved and loaded like the quantized values (``fq.save``, ``to_bytes``): a file
    entry with these six numbers and no arrays.
    """

    min: float
    max: float
    mean: float
    std_dev: float
    p99: float
    suggested_scale: float

    scheme: ClassVar[str] = "calib-stats"
    _arrays: ClassVar[Tuple[str, ...]] = ()
    # No arrays: hashable, as a frozen dataclass is.
    __hash__ = Quantized._field_hash  # type: ignore[assignment]
    _params: ClassVar[Tuple[str, ...]] = (
        "min",
        "max",
        "mean",
        "std_dev",
        "p99",
        "suggested_scale",
    )

    def __post_init__(self) -> None:
        for name in self._params:
            v = getattr(self, name)
            if not real_scalar(v):
                raise TypeError(f"{name} must be a real number, got {type(v).__name__}")
            try:
                v = round_f32(v)  # the seed's fields are f32: held as float32 values
            except Exception:  # too large for a float, or a broken __float__
                raise InvalidConfigError(f"{name} must be finite, got {short_repr(v)}") from None
            if not math.isfinite(v):
                raise InvalidConfigError(
                    f"{name} must be finite in float32, got {short_repr(getattr(self, name))}"
                )
            object.__setattr__(self, name, v)
        for name in ("std_dev", "p99", "suggested_scale"):
            if getattr(self, name) < 0:
                raise InvalidConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        lo, hi = self.min, self.max
        if lo > hi:
            raise InvalidConfigError(f"min ({lo}) must not exceed max ({hi})")
        # What collect() can give: every statistic lies within the values' range.
        if not lo <= self.mean <= hi:
            raise InvalidConfigError(
                f"mean ({self.mean}) must lie within [min, max] = [{lo}, {hi}]"
            )
        if self.std_dev > hi - lo:
            raise InvalidConfigError(
                f"std_dev ({self.std_dev}) must not exceed max - min ({hi - lo})"
            )
        max_abs = max(abs(lo), abs(hi))
        if self.p99 > max_abs:
            raise InvalidConfigError(
                f"p99 ({self.p99}) must not exceed the largest |value| ({max_abs}), "
                "the larger of |min| and |max|"
            )
        rule = _suggested_scale(self.p99, max_abs)
        if self.suggested_scale != rule and not (self.suggested_scale == 0.0 == max_abs):
            raise InvalidConfigError(
                f"suggested_scale ({self.suggested_scale}) must be {rule}: p99 / 127, else "
                "max|x| / 127, else 1 / 127 (0 for no values)"
            )

    def compression_ratio(self) -> float:
        """Statistics compress nothing: 1.0."""
        return 1.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._params)
        return f"CalibStats({fields})"

    @classmethod
    def collect(cls, batches: Any, *, total: Optional[int] = None) -> CalibStats:
        """Statistics of the values of ``batches`` (any iterable of float arrays,
        consumed once). Streams: holds the running sums and the largest |x| the
        exact p99 can still need (about 1 % of the values), not every value.

        The number of values decides which |x| the p99 needs. A list or tuple is
        sized first. For any other iterable pass ``total`` (the number of values
        it will yield, or more) to stream in the same memory. Without it, a
        stream whose largest values come first can need values let go earlier,
        so every |x| also goes to a spill (4 bytes a value: 1 MiB in memory,
        then an unnamed temporary file in ``tempfile.gettempdir()``, which passes
        over an unusable ``TMPDIR``), read once at the end only when needed. The
        p99 is exact either way; the spill's writes cost time and disk on every call
        without ``total`` (see the README).

        Raises:
            TypeError: a batch is not a floating array, or ``total`` not an int.
            InvalidConfigError: ``total`` is negative, or more values arrive than
                it announced.
            ShapeMismatchError: a list's batch holds more values than its shape
                said when the list was sized.
            NonFiniteError: a batch holds NaN or an infinity.

        Warns:
            PrecisionWarning: only if the spill was needed and its temporary file
                could not be created, written or read, or the process forked while
                streaming (the reason is named): the p99 returned is then an upper
                bound.
        """
        return _collect(batches, total)


def _spill_dir() -> Optional[str]:
    """Where a stream's spill goes: Python's temporary directory, which passes over an
    unusable ``TMPDIR`` (or ``None`` when there is none: the crate's own attempt then
    names the error)."""
    try:
        d = tempfile.gettempdir()
        return os.fsdecode(d) if isinstance(d, (str, bytes, os.PathLike)) else None
    except (OSError, TypeError):  # no usable temporary directory; a broken tempfile.tempdir
        return None


def _suggested_scale(p99: float, max_abs: float) -> float:
    """The seed's suggested scale in float32: ``p99 / 127``, else ``max|x| / 127``, else
    ``1 / 127``."""
    v = p99 if p99 > 0 else max_abs if max_abs > 0 else 1.0
    # Rounding the float64 quotient of two float32 values to float32 is the float32
    # quotient (53 >= 2·24 + 2 bits); rounded in the default environment, as every
    # scalar here (a caller's flush-to-zero flags aside).
    return float(_native.round_f32(v / 127.0))


def _size(batch: Any, k: int) -> int:
    try:
        dims = [operator.index(d) for d in np.shape(batch)]
    except (TypeError, ValueError) as e:  # ragged nested lists; a shape of non-integers
        raise TypeError(f"batches[{k}] must be a floating array: {e}") from None
    if any(d < 0 for d in dims):
        raise TypeError(f"batches[{k}] must be a floating array, got shape {tuple(dims)}")
    return math.prod(dims)


def _total(total: Any) -> Optional[int]:
    if total is None:
        return None
    n = exact_int(total, "total", "an int or None")
    if not 0 <= n < 2**64:
        raise InvalidConfigError(f"total must be a count of values, 0 to 2**64 - 1, got {n}")
    return n


def _collect(batches: Any, total: Any = None) -> CalibStats:
    """Stream the batches through the crate's ``CalibAccumulator`` (which keeps the
    running sums and only the largest |x| the exact p99 can still need)."""
    if isinstance(batches, (np.ndarray, np.generic, memoryview)):
        batches = (batches,)  # one batch, not one per row (or per scalar): same statistics
    else:
        try:
            iter(batches)  # for a one-shot iterator, itself: nothing is consumed
        except TypeError:
            raise TypeError(
                "batches must be an iterable of floating arrays (or one array), got "
                f"{type(batches).__name__}"
            ) from None
    announced = _total(total)
    if announced is None and isinstance(batches, (list, tuple)):
        announced = sum(_size(b, k) for k, b in enumerate(batches))
        if announced >= 2**64:  # only shapes that lie can add up to that
            raise ShapeMismatchError(
                f"batches: the shapes of the {type(batches).__name__}'s batches add up to "
                f"{announced} values, more than 2**64 - 1"
            )
    acc = _native.CalibAccumulator(announced, None if announced is not None else _spill_dir())
    try:
        for k, batch in enumerate(batches):
            try:
                arr = float_input(batch, f"batches[{k}]")
            except ValueError as e:  # ragged nested lists
                raise TypeError(f"batches[{k}] must be a floating array: {e}") from None
            before = acc.count()
            try:
                acc.push(arr)
            except InvalidConfigError:
                if total is not None:
                    raise
                # The count came from the batches' shapes, not from the caller.
                raise ShapeMismatchError(
                    f"batches[{k}]: the shapes of the {type(batches).__name__}'s batches "
                    f"added up to {announced} values, but its arrays hold "
                    f"{before + arr.size} by this one (the {type(batches).__name__} or a "
                    "batch changed, or a batch's shape lied, while it was read)"
                ) from None
            except NonFiniteError as e:
                i = e.index or 0
                v = float(arr.flat[i - before]) if 0 <= i - before < arr.size else math.nan
                what = (
                    f"{v!r}, beyond float32's range (infinite in the float32 working precision)"
                    if math.isfinite(v)
                    else "a non-finite value (NaN or ±inf)"
                )
                raise NonFiniteError(
                    f"batches[{k}] holds {what} at flat index {i - before} "
                    f"(index {i} over all batches)",
                    i,
                ) from None
    except BaseException:
        acc.discard()  # its temporary file, now: a traceback can outlive the call
        raise
    lo, hi, mean, std, p99, suggested, exact, spill_error = acc.finish()
    if not exact:
        warn(
            "CalibStats.collect: the p99 returned is an upper bound. The stream's "
            "length was not known, values the exact p99 needs were let go (its largest "
            f"values came first), and {spill_error or 'the spill of every value failed'}."
            " Pass total= (or a list of batches) to keep exactly what the p99 needs",
            PrecisionWarning,
        )
    return CalibStats(
        min=float(lo),
        max=float(hi),
        mean=float(mean),
        std_dev=float(std),
        p99=float(p99),
        suggested_scale=float(suggested),
    )
