"""Blockwise 8-bit quantization with per-block scales (SPEC §1, seed 000).

The flattened input is cut into blocks of ``block_size`` (the last may be
shorter); each block gets ``scale = max|x| / 127`` (1.0 for an all-zero block)
and codes ``clamp(round(v / scale), -127, 127)``, computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Tuple

import numpy as np

from . import _ferroquant as _native
from ._base import Quantized, check_scales, f32_ratio
from ._checks import (
    beyond_f32,
    describe,
    float32_shape,
    float_input,
    held,
    is_array_of,
    positive_int,
    readonly,
    shape_tuple,
    source_dtype,
    warn,
)
from ._checks import scale_dtype as _scale_dtype
from .errors import InvalidConfigError, NonFiniteError, PrecisionWarning, ShapeMismatchError

__all__ = ["BlockwiseQuantized", "dequantize_blockwise", "quantize_blockwise"]


@dataclass(frozen=True, eq=False, repr=False)
class BlockwiseQuantized(Quantized):
    """Blockwise 8-bit codes with one scale per block (SPEC §1, seed 000).

    Attributes:
        data: int8 codes (-127..127) of the flattened input, length ``n``.
        scales: float16 (default) or float32 scales, one per block of ``block_size``,
            finite and >= 0.
        shape: the original shape.
        block_size: elements per block (the last block may be shorter).
        dtype: the dtype the input had (``"float32"``, ``"float16"``, ``"bfloat16"``
            or ``"float64"``); :func:`dequantize_blockwise` still returns float32,
            as the seed does.

    Arrays are held read-only; arrays given to the constructor in another layout
    (strided, unaligned, big-endian) are copied once into one the kernels read.
    """

    data: np.ndarray
    scales: np.ndarray
    shape: Tuple[int, ...]
    block_size: int
    dtype: str = "float32"

    scheme: ClassVar[str] = "blockwise8"
    _arrays: ClassVar[Tuple[str, ...]] = ("data", "scales")
    _params: ClassVar[Tuple[str, ...]] = ("shape", "dtype", "block_size")

    def __post_init__(self) -> None:
        shape = shape_tuple(self.shape, dtype=self.dtype, at_least=4)  # float32 values
        block_size = positive_int(self.block_size, "block_size")
        n = math.prod(shape)
        data, scales = self.data, self.scales
        if not isinstance(data, np.ndarray) or data.dtype != np.int8:
            raise TypeError(f"data must be an int8 array, got {describe(data)}")
        if not is_array_of(scales, np.float16, np.float32):
            raise TypeError(f"scales must be a float16 or float32 array, got {describe(scales)}")
        if data.shape != (n,):
            raise ShapeMismatchError(
                f"data: expected shape ({n},) for shape {shape}, got {data.shape}"
            )
        nb = -(-n // block_size)
        if scales.shape != (nb,):
            raise ShapeMismatchError(
                f"scales: expected shape ({nb},) for {n} elements in blocks of "
                f"{block_size}, got {scales.shape}"
            )
        data, scales = held(data), held(scales)
        check_scales(scales, 127, "block ", source_dtype(self.dtype))
        if data.size and data.min() < -127:
            bad = int(np.argmin(data))
            raise InvalidConfigError(f"data must hold codes in -127..127, got -128 at index {bad}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "dtype", source_dtype(self.dtype))
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scales", scales)

    @property
    def bits(self) -> int:
        """Bits per code: 8."""
        return 8

    @property
    def scale_dtype(self) -> np.dtype:
        """The dtype of the stored scales (float16 or float32)."""
        return self.scales.dtype

    def size_bytes(self) -> int:
        """Compressed size: ``n`` code bytes + 2 (or 4) bytes a scale."""
        return int(self.data.size + self.scales.size * self.scales.itemsize)

    def original_size_bytes(self) -> int:
        """Size of the input as float32: ``4 n`` (the seed's accounting, whatever ``dtype``)."""
        return int(self.data.size * 4)

    def compression_ratio(self) -> float:
        """``original_size_bytes() / size_bytes()``, computed in f32 as the seed does."""
        return f32_ratio(self.original_size_bytes(), self.size_bytes())

    def dequantize(self) -> np.ndarray:
        """The float32 reconstruction in the original shape (see ``dequantize_blockwise``)."""
        return dequantize_blockwise(self)

    def _repr_fields(self) -> str:
        return f"block_size={self.block_size}, scale_dtype={self.scales.dtype.name}"


def quantize_blockwise(
    x: Any, block_size: int = 64, scale_dtype: Any = np.float16
) -> BlockwiseQuantized:
    """Blockwise 8-bit quantization (SPEC §1, seed 000).

    Args:
        x: float32, float64, float16 or bfloat16 array of any shape.
        block_size: elements per block, >= 1.
        scale_dtype: ``np.float16`` (default, 2 bytes a block) or ``np.float32``.

    Returns:
        A :class:`BlockwiseQuantized`.

    Raises:
        TypeError: ``x`` is not a floating array.
        InvalidConfigError: ``block_size < 1``, a bad ``scale_dtype``, or a block
            whose scale overflows float16 (max|x| above ~8.3e6).
        NonFiniteError: ``x`` holds NaN or an infinity (``.index`` says where).

    Warns:
        PrecisionWarning: with float16 scales, some blocks (max|x| below ~7.8e-3)
            got a subnormal or zero scale and lost precision.
    """
    arr = float_input(x, "x")
    float32_shape(arr.shape, "x")
    bs = positive_int(block_size, "block_size")
    sdt = _scale_dtype(scale_dtype)
    try:
        codes, scales, lossy = _native.quantize_blockwise(arr, bs, sdt == np.float32)
    except NonFiniteError as e:
        raise beyond_f32(e, arr) from None
    if lossy:
        warn(
            f"{lossy} of {scales.size} blocks have max |x| below ~7.8e-3, so their float16 "
            "scale is subnormal or zero and lost precision; pass scale_dtype=np.float32 "
            "to keep it",
            PrecisionWarning,
        )
    return BlockwiseQuantized._trusted(
        data=readonly(codes),
        scales=readonly(scales),
        shape=arr.shape,
        block_size=bs,
        dtype=source_dtype(arr.dtype),
    )


def dequantize_blockwise(q: BlockwiseQuantized) -> np.ndarray:
    """Reconstruct float32 values in ``q.shape``: ``code * float32(stored scale)``.

    Raises:
        TypeError: ``q`` is not a :class:`BlockwiseQuantized`.
    """
    if not isinstance(q, BlockwiseQuantized):
        raise TypeError(f"q must be a BlockwiseQuantized, got {type(q).__name__}")
    flat = _native.dequantize_blockwise(q.data, q.block_size, q.scales)
    return flat.reshape(q.shape)
