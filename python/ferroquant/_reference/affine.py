"""Seed 001 (shrew ``quantize``) in plain NumPy, float64 throughout."""

from __future__ import annotations

from typing import Tuple

import ml_dtypes
import numpy as np

from .blockwise import round_half_away

_RANGE = {
    (8, "symmetric"): (-127.0, 127.0),
    (8, "asymmetric"): (-128.0, 127.0),
    (4, "symmetric"): (-7.0, 7.0),
    (4, "asymmetric"): (-8.0, 7.0),
}


def compute_scale_zp(data: np.ndarray, bits: int, mode: str) -> Tuple[float, float]:
    """``compute_scale_zp``: (scale, zero point) of a float64 group."""
    if data.size == 0:
        return 1.0, 0.0
    qmin, qmax = _RANGE[(bits, mode)]
    if mode == "symmetric":
        amax = float(np.max(np.abs(data), initial=0.0))
        return (1.0 if amax < 1e-30 else amax / qmax), 0.0
    lo, hi = float(np.min(data)), float(np.max(data))
    with np.errstate(over="ignore"):
        rng = hi - lo
    scale = 1.0 if rng < 1e-30 else rng / (qmax - qmin)
    zp = float(round_half_away(np.array([qmin - lo / scale]))[0])
    return scale, zp


def _codes(data: np.ndarray, scale: float, zp: float, bits: int, mode: str) -> np.ndarray:
    qmin, qmax = _RANGE[(bits, mode)]
    inv = 0.0 if abs(scale) < 1e-30 else 1.0 / scale
    with np.errstate(over="ignore", invalid="ignore"):
        y = data * inv  # a multiply, rounded ...
        y = y + zp  # ... then an add, rounded (no fused multiply-add)
    return np.clip(round_half_away(y), qmin, qmax).astype(np.int8)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Two codes a byte, element 2i in the low nibble; odd tail's high nibble 0."""
    c = codes.astype(np.uint8) & 0x0F
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def quantize_affine(
    x: np.ndarray, bits: int, mode: str, granularity: str
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_tensor``: (data, scales, zero_points); int4 data packed."""
    data = np.asarray(x).astype(np.float64).reshape(-1)
    shape = np.shape(x)
    if granularity == "per_channel" and len(shape) > 0:
        rows = shape[0]
        cs = data.size // rows if rows else 0
        scales, zps = np.ones(rows), np.zeros(rows)
        codes = np.zeros(data.size, np.int8)
        for r in range(rows):
            g = data[r * cs : (r + 1) * cs]
            scales[r], zps[r] = compute_scale_zp(g, bits, mode)
            codes[r * cs : (r + 1) * cs] = _codes(g, scales[r], zps[r], bits, mode)
    else:
        s, z = compute_scale_zp(data, bits, mode)
        scales, zps = np.array([s]), np.array([z])
        codes = _codes(data, s, z, bits, mode)
    return (pack_int4(codes) if bits == 4 else codes), scales, zps


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of :func:`pack_int4`: ``n`` sign-extended codes."""
    out = np.empty(2 * packed.size, np.int16)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return (((out ^ 8) - 8)[:n]).astype(np.int8)


def _round_once(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> dtype, rounded once to nearest even (exact for f16 in NumPy;
    for bfloat16 through float32 rounded to odd, which keeps one rounding)."""
    if dtype in ("float64", "float32", "float16"):
        with np.errstate(over="ignore"):  # beyond the dtype's range is inf, as in Rust
            return values.astype(dtype)
    f = values.astype(np.float32)
    back = f.astype(np.float64)
    inexact = back != values
    toward_zero = np.where(np.abs(back) > np.abs(values), f.view(np.uint32) - 1, f.view(np.uint32))
    odd = np.where(inexact, toward_zero | 1, f.view(np.uint32)).astype(np.uint32).view(np.float32)
    return odd.astype(ml_dtypes.bfloat16)


def dequantize_affine(
    data: np.ndarray,
    scales: np.ndarray,
    zps: np.ndarray,
    shape: Tuple[int, ...],
    bits: int,
    granularity: str,
    dtype: str = "float32",
) -> np.ndarray:
    """``dequantize_tensor``: ``(q - zp) * scale`` in float64, rounded once to ``dtype``."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    q = (unpack_int4(data, n) if bits == 4 else data).astype(np.float64)
    if granularity == "per_channel" and len(shape) > 0:
        rows = shape[0]
        cs = n // rows if rows else 0
        s = np.repeat(scales, cs)
        z = np.repeat(zps, cs)
    else:
        s = np.full(n, scales[0])
        z = np.full(n, zps[0])
    with np.errstate(invalid="ignore", over="ignore"):
        values = (q - z) * s
    return _round_once(values, dtype).reshape(shape)
