"""The kernels as NumPy functions: the only module that imports the native one.

Each function checks and prepares its arguments (dtype, layout), calls one
native kernel (which releases the GIL and may use ferroquant's thread pool),
and wraps the bare arrays it gets back into the frozen dataclasses of
:mod:`ferroquant.types`.
"""

from __future__ import annotations

import warnings
from typing import Any, List

import numpy as np

from . import _ferroquant as _native
from ._checks import float_input, positive_int, readonly
from ._checks import scale_dtype as _scale_dtype
from .errors import PrecisionWarning
from .types import BlockwiseQuantized

__all__ = [
    "dequantize_blockwise",
    "get_num_threads",
    "quantize_blockwise",
    "set_num_threads",
    "simd_isa",
    "supported_isas",
]


def quantize_blockwise(
    x: Any, block_size: int = 64, scale_dtype: Any = np.float16
) -> BlockwiseQuantized:
    """Blockwise 8-bit quantization (SPEC §1, seed 000).

    The flattened input is cut into blocks of ``block_size`` (the last may be
    shorter); each block gets ``scale = max|x| / 127`` (1.0 for an all-zero
    block) and codes ``clamp(round(v / scale), -127, 127)``, computed in f32.

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
    bs = positive_int(block_size, "block_size")
    sdt = _scale_dtype(scale_dtype)
    codes, scales, lossy = _native.quantize_blockwise(arr, bs, sdt == np.float32)
    if lossy:
        warnings.warn(
            f"{lossy} of {scales.size} blocks have max |x| below ~7.8e-3, so their float16 "
            "scale is subnormal or zero and lost precision; pass scale_dtype=np.float32 "
            "to keep it",
            PrecisionWarning,
            stacklevel=2,
        )
    return BlockwiseQuantized(
        data=readonly(codes), scales=readonly(scales), shape=arr.shape, block_size=bs
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


def set_num_threads(n: int) -> None:
    """Set how many threads the kernels use (>= 1). Results do not depend on it.

    Raises:
        TypeError: ``n`` is not an integer.
        InvalidConfigError: ``n < 1``.
    """
    _native.set_num_threads(positive_int(n, "n"))


def get_num_threads() -> int:
    """How many threads the kernels use (``FERROQUANT_NUM_THREADS`` or the CPU count)."""
    return int(_native.get_num_threads())


def simd_isa() -> str:
    """The instruction set the kernels run on: ``"avx512"``, ``"avx2"`` or ``"scalar"``.

    Chosen once at import from what the CPU supports; ``FERROQUANT_SIMD=scalar``
    (or ``avx2``) set before import caps it.
    """
    return str(_native.simd_isa())


def supported_isas() -> List[str]:
    """Every instruction set this CPU can run the kernels on, scalar first."""
    return [str(s) for s in _native.supported_isas()]
