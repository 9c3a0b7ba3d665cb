"""Plain-NumPy reference implementations of the seed kernels: the test oracle.

Written for clarity, never used on the production path. Each function follows
its seed line by line in the seed's precision, with the SPEC's deviations.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

F32 = np.float32


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Rust's ``f32::round`` / ``f64::round``: ties away from zero (NumPy's ``round``
    ties to even), and the sign of a zero result kept (``round(-0.3) == -0.0``)."""
    t = np.trunc(x)
    up = np.abs(x - t) >= x.dtype.type(0.5)
    return np.where(up, t + np.copysign(x.dtype.type(1), x), t).astype(x.dtype)


def quantize_blockwise(
    x: np.ndarray, block_size: int, scale_dtype: type = np.float16
) -> Tuple[np.ndarray, np.ndarray]:
    """Seed 000 ``BlockwiseQuantizer::compress``: (int8 codes, stored scales)."""
    flat = np.asarray(x).reshape(-1).astype(F32)
    n = flat.size
    nb = -(-n // block_size)
    codes = np.zeros(n, np.int8)
    scales: np.ndarray = np.zeros(nb, scale_dtype)
    for b in range(nb):
        block = flat[b * block_size : (b + 1) * block_size]
        max_abs = np.max(np.abs(block)) if block.size else F32(0)
        scale = F32(max_abs / F32(127)) if max_abs > 0 else F32(1)
        scales[b] = scale_dtype(scale)
        if scale > 0:
            with np.errstate(over="ignore"):
                q = np.clip(round_half_away(block / scale), -127, 127)
            codes[b * block_size : b * block_size + block.size] = q.astype(np.int8)
    return codes, scales


def dequantize_blockwise(codes: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """Seed 000 ``decompress``: ``code as f32 * f32(stored scale)``."""
    s = np.repeat(scales.astype(F32), block_size)[: codes.size]
    with np.errstate(over="ignore"):  # 127 * (f32::MAX / 127) may round past f32::MAX, as in Rust
        return codes.astype(F32) * s
