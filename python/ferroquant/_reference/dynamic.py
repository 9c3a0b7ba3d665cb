"""Seeds 002 (oxibonsai ``dynamic_quant``) and 003 (bitnet ``quantize_activations``)
in plain NumPy, float32, line by line; with the SPEC's deviations (exact f64
percentile rank, int4 packed, per-token flag honoured)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from typing import Any, Iterable, Optional, Tuple

import numpy as np

from .affine import pack_int4
from .blockwise import round_half_away

F32 = np.float32


def percentile_rank(p: float, n: int) -> int:
    """``ceil(p·n) - 1`` from one f64 multiplication, clamped to ``[0, n - 1]``."""
    return min(max(math.ceil(p * n) - 1, 0), n - 1)


def compute_scale(x: np.ndarray, clip_val: float, p: Optional[float] = None) -> np.float32:
    """``compute_scale``: max |x| (``p is None``) or the sorted |x| at the percentile
    rank, over ``clip_val``; 0 for empty input or a zero statistic."""
    data = np.asarray(x).reshape(-1).astype(F32)
    if data.size == 0:
        return F32(0)
    a = np.abs(data)
    stat = a.max() if p is None else np.sort(a)[percentile_rank(p, a.size)]
    if stat == 0:
        return F32(0)
    with np.errstate(over="ignore"):  # beyond f32's range is inf, as in Rust
        return F32(stat / F32(clip_val))


def _codes(x: np.ndarray, scale: np.float32, clip: int) -> np.ndarray:
    if scale == 0:
        return np.zeros(x.size, np.int8)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        q = round_half_away(x / scale)
    q = np.clip(q, -clip, clip)
    return np.nan_to_num(q, nan=0.0).astype(np.int8)


def dynamic_quantize(
    x: np.ndarray, fmt: str, p: Optional[float] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """(data, scales) for ``int8_per_tensor``, ``int8_per_row`` or ``int4_per_tensor``."""
    arr = np.asarray(x)
    flat = arr.reshape(-1).astype(F32)
    clip = 7 if fmt == "int4_per_tensor" else 127
    if fmt == "int8_per_row":
        rows, cols = arr.shape
        if flat.size == 0:
            return np.zeros(0, np.int8), np.zeros(0, F32)
        codes = np.zeros(flat.size, np.int8)
        scales = np.zeros(rows, F32)
        for r in range(rows):
            row = flat[r * cols : (r + 1) * cols]
            scales[r] = compute_scale(row, clip, p)
            codes[r * cols : (r + 1) * cols] = _codes(row, scales[r], clip)
        return codes, scales
    scale = compute_scale(flat, clip, p)
    codes = _codes(flat, scale, clip)
    if fmt == "int4_per_tensor":
        return pack_int4(codes), np.array([scale], F32)
    return codes, np.array([scale], F32)


def quantization_mae(original: np.ndarray, reconstructed: np.ndarray) -> np.float32:
    """Mean of |o - r| over the common length, summed in order in f32."""
    o = np.asarray(original).reshape(-1).astype(F32)
    r = np.asarray(reconstructed).reshape(-1).astype(F32)
    n = min(o.size, r.size)
    if n == 0:
        return F32(0)
    total = F32(0)
    for a, b in zip(o[:n], r[:n], strict=True):
        total = F32(total + F32(abs(F32(a - b))))
    return F32(total / F32(n))


def bitnet_quantize(
    x: np.ndarray, bits: int = 8, per_token: bool = True
) -> Tuple[np.ndarray, np.ndarray]:
    """``quantize_activations``: (int8 codes in x's shape, float32 scales)."""
    arr = np.asarray(x)
    b, s = (arr.shape[0], 1) if arr.ndim == 2 else arr.shape[:2]
    groups = b * s if per_token else b
    flat = arr.reshape(-1).astype(F32)
    m = (1 << (bits - 1)) - 1
    g = flat.size // groups if groups else 0
    codes = np.zeros(flat.size, np.int8)
    scales = np.zeros(groups, F32)
    for k in range(groups):
        row = flat[k * g : (k + 1) * g]
        abs_max = np.abs(row).max() if row.size else F32(0)
        scale = F32(abs_max / F32(m)) if abs_max > 0 else F32(1)
        scales[k] = scale
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            q = round_half_away(row / scale)
        q = np.clip(q, -m, m)
        codes[k * g : (k + 1) * g] = np.nan_to_num(q, nan=0.0).astype(np.int8)
    return codes.reshape(arr.shape), scales


def dequantize_groups(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """``q as f32 * scale`` of each element's group."""
    flat = np.asarray(codes).reshape(-1)
    out = np.zeros(flat.size, F32)
    for k, s in enumerate(scales):
        seg = flat[k * group : (k + 1) * group]
        with np.errstate(over="ignore"):  # code * scale may round past f32's max: inf
            out[k * group : (k + 1) * group] = seg.astype(F32) * F32(s)
    return out


def _libm_powf() -> Any:
    """The C library's ``powf``, which Rust's ``f32::powf`` calls on Linux. (NumPy's
    float32 ``power`` may use its own vectorized approximation instead.)"""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    powf = libm.powf
    powf.argtypes = [ctypes.c_float, ctypes.c_float]
    powf.restype = ctypes.c_float
    return powf


def smooth_factors(
    activations: np.ndarray, weights: np.ndarray, alpha: float, epsilon: float
) -> np.ndarray:
    """``compute_smooth_factors``: per input feature, in f32 with the C ``powf``."""
    powf = _libm_powf()
    a = np.abs(np.asarray(activations, F32)).max(axis=0, initial=F32(0))
    w = np.abs(np.asarray(weights, F32)).max(axis=0, initial=F32(0))
    eps = F32(max(F32(epsilon), F32(1e-10)))
    al = F32(alpha)
    out = np.zeros(a.size, F32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for j in range(a.size):
            num = F32(powf(F32(a[j] + eps), al))
            den = F32(powf(F32(w[j] + eps), F32(F32(1) - al)))
            # Rust's f32::max: a NaN quotient (inf / inf) gives the other operand,
            # where Python's max() would keep the NaN.
            out[j] = np.fmax(F32(num / den), eps)
    return out


def calib_stats(batches: Iterable[np.ndarray]) -> Tuple[float, ...]:
    """``CalibStats::collect`` with f64 sums: (min, max, mean, std, p99, suggested)."""
    values = [np.asarray(b, F32).reshape(-1) for b in batches]
    allv = np.concatenate(values) if values else np.zeros(0, F32)
    if allv.size == 0:
        return (0.0,) * 6
    n = allv.size
    mean = float(np.sum(allv, dtype=np.float64) / n)
    var = float(np.sum((allv.astype(np.float64) - mean) ** 2) / n)
    a = np.sort(np.abs(allv))
    p99 = a[percentile_rank(0.99, n)]
    if p99 > 0:
        sug = F32(p99 / F32(127))
    elif a[-1] > 0:
        sug = F32(a[-1] / F32(127))
    else:
        sug = F32(F32(1) / F32(127))
    # The seed folds with f32::min / f32::max, which keep the first of equal values:
    # of 0.0 and -0.0, whichever comes first (np.min/np.max may give the other).
    return (
        float(allv[np.argmin(allv)]),
        float(allv[np.argmax(allv)]),
        float(F32(mean)),
        float(F32(math.sqrt(var))),
        float(p99),
        float(sug),
    )


def w8a8(weight: np.ndarray, weight_scales: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Seed 002's ``w8a8_matvec`` (1-D ``x``, one scale) or its batched form (2-D ``x``,
    a scale per row), with the sum in exact integers: ``float32[out]`` or
    ``float32[tokens, out]``."""
    w = np.asarray(weight, np.int8)
    xs = np.asarray(x, F32)
    rows = xs.reshape(1, -1) if xs.ndim == 1 else xs
    if xs.ndim == 1:
        codes, scales = dynamic_quantize(xs, "int8_per_tensor")
        codes = codes.reshape(1, -1)
    else:
        codes, scales = dynamic_quantize(rows, "int8_per_row")
        codes = codes.reshape(rows.shape)
    out = np.zeros((rows.shape[0], w.shape[0]), F32)
    for t in range(rows.shape[0]):
        for o in range(w.shape[0]):
            acc = sum(
                int(a) * int(b) for a, b in zip(w[o].tolist(), codes[t].tolist(), strict=True)
            )
            # `acc as f32 * w_scale * act_scale`, each product rounded to f32.
            out[t, o] = F32(F32(F32(acc) * weight_scales[o]) * scales[t])
    return out[0] if xs.ndim == 1 else out
