"""Dynamic activation quantization (SPEC §3, seed 002): a scale computed from the
values being quantized, per tensor or per row, by max-abs or a percentile.

``scale = statistic / clip`` (clip 127 for int8, 7 for int4; 0 when the statistic is
0), codes ``clamp(round(v / scale), -clip, clip)`` in float32, all zero when the
scale is 0. The percentile statistic is the element of rank ``ceil(p·n) - 1`` of the
sorted ``|x|``, found by O(n) selection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Tuple, Union

import numpy as np

from . import _ferroquant as _native
from ._base import Quantized, f32_ratio, unpack_int4
from ._checks import float_input, held, readonly, shape_tuple
from .errors import InvalidConfigError, ShapeMismatchError

__all__ = [
    "DynQuantTensor",
    "MaxAbs",
    "Percentile",
    "compute_scale",
    "dynamic_quantize_int4",
    "dynamic_quantize_int8",
    "dynamic_quantize_int8_per_row",
    "quantization_mae",
]

FORMATS = ("int8_per_tensor", "int8_per_row", "int4_per_tensor")


@dataclass(frozen=True)
class MaxAbs:
    """Scale from the largest ``|x|`` (seed 002's ``DynamicScaleMode::MaxAbs``)."""


@dataclass(frozen=True)
class Percentile:
    """Scale from the ``p``-th percentile of ``|x|``, ``p`` in (0, 1] (0.99: the
    99th), more robust to outliers than :class:`MaxAbs`.

    Raises:
        InvalidConfigError: ``p`` is not a number in (0, 1].
    """

    p: float

    def __post_init__(self) -> None:
        p = self.p
        if isinstance(p, (bool, np.bool_)) or not isinstance(
            p, (int, float, np.floating, np.integer)
        ):
            raise InvalidConfigError(f"p must be a number in (0, 1], got {p!r}")
        p = float(p)
        if not (0.0 < p <= 1.0):
            raise InvalidConfigError(f"p must be in (0, 1], got {p}")
        object.__setattr__(self, "p", p)


ScaleMode = Union[MaxAbs, Percentile]


def _percentile(mode: Any) -> Any:
    """The native argument for a scale mode: None (max-abs) or p."""
    if isinstance(mode, MaxAbs):
        return None
    if isinstance(mode, Percentile):
        return mode.p
    raise TypeError(f"mode must be MaxAbs() or Percentile(p), got {type(mode).__name__}")


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"array of dtype {x.dtype}"
    return type(x).__name__


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
    """

    data: np.ndarray
    scales: np.ndarray
    shape: Tuple[int, ...]
    format: str = "int8_per_tensor"

    scheme: ClassVar[str] = "dynamic"
    _arrays: ClassVar[Tuple[str, ...]] = ("data", "scales")
    _params: ClassVar[Tuple[str, ...]] = ("shape", "format")

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidConfigError(
                f"format must be one of {', '.join(FORMATS)}, got {self.format!r}"
            )
        shape = shape_tuple(self.shape)
        n = math.prod(shape)
        int4 = self.format == "int4_per_tensor"
        want_dtype, want_len = (np.uint8, -(-n // 2)) if int4 else (np.int8, n)
        data, scales = self.data, self.scales
        if not isinstance(data, np.ndarray) or data.dtype != want_dtype:
            raise TypeError(
                f"data must be a {np.dtype(want_dtype).name} array for {self.format}, "
                f"got {_describe(data)}"
            )
        if not isinstance(scales, np.ndarray) or scales.dtype.newbyteorder("=") != np.float32:
            raise TypeError(f"scales must be a float32 array, got {_describe(scales)}")
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
        ok = np.isfinite(scales) & (scales >= 0) & ~np.signbit(scales)
        if scales.size and not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise InvalidConfigError(f"scales must be finite and >= 0, got {scales[bad]} at {bad}")
        clip = 7 if int4 else 127
        if data.size:
            codes = unpack_int4(data, n) if int4 else data
            if codes.size and (codes.min() < -clip or codes.max() > clip):
                bad = int(np.flatnonzero(np.abs(codes.astype(np.int16)) > clip)[0])
                raise InvalidConfigError(
                    f"data must hold codes in -{clip}..{clip}, got {int(codes[bad])} at index {bad}"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scales", scales)

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
        """The int8 codes in the input's shape (int4 unpacked, sign-extended)."""
        n = self.element_count()
        codes = unpack_int4(self.data, n) if self.format == "int4_per_tensor" else self.data
        return np.array(codes, np.int8).reshape(self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 values ``code * scale`` in the input's shape."""
        n = self.element_count()
        group = (self.shape[1] if self.format == "int8_per_row" else n) if n else 0
        flat = _native.dequantize_groups(
            self.data, n, group, self.scales, self.format == "int4_per_tensor"
        )
        return flat.reshape(self.shape)

    def _repr_fields(self) -> str:
        return f"format={self.format}"


def compute_scale(x: Any, clip_val: float, mode: ScaleMode = MaxAbs()) -> float:
    """Seed 002's ``compute_scale`` over all of ``x``: ``statistic / clip_val``, 0.0 for
    empty or all-zero input.

    Raises:
        TypeError: ``x`` is not a floating array, or ``mode`` is not a scale mode.
        NonFiniteError: ``x`` holds NaN or an infinity.
    """
    p = _percentile(mode)
    arr = float_input(x, "x")
    clip = float(np.float32(clip_val))
    return float(_native.compute_scale(arr, clip, p))


def _quantize(x: Any, fmt: str, mode: Any, arg: str = "x") -> DynQuantTensor:
    p = _percentile(mode)
    arr = float_input(x, arg)
    if fmt == "int8_per_row" and arr.ndim != 2:
        raise ShapeMismatchError(f"x2d must be a 2-D array, got {arr.ndim}-D shape {arr.shape}")
    data, scales = _native.quantize_dynamic(arr, fmt, p)
    return DynQuantTensor._trusted(
        data=readonly(data), scales=readonly(scales), shape=arr.shape, format=fmt
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
    orig = float_input(original, "original").reshape(-1).astype(np.float32)
    rec = q.dequantize().reshape(-1)
    n = min(orig.size, rec.size)
    if n == 0:
        return 0.0
    err = np.abs(orig[:n] - rec[:n])
    # The seed's iterator sum adds in order in f32: cumsum reproduces that order.
    total = np.cumsum(err, dtype=np.float32)[-1]
    return float(np.float32(total) / np.float32(n))
