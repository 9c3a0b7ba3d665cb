"""Seed 004 (sensorlm ``quantization/int8.rs``) in plain NumPy, float32, line by
line; with the SPEC's deviations (codes held as int8)."""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from .blockwise import round_half_away

F32 = np.float32


def ptq_quantize(w: np.ndarray, scale: Optional[float] = None) -> Tuple[np.ndarray, np.float32]:
    """``QuantizedWeights::from_f32``: ``max(scale or max|w| / 127, 1e-8)`` and the
    codes ``clamp(round(w / s), -127, 127)``, all in float32."""
    x = np.asarray(w).reshape(-1).astype(F32)
    max_abs = np.abs(x).max() if x.size else F32(0)
    s = F32(max_abs) / F32(127) if scale is None else F32(scale)
    s = max(s, F32(1e-8))
    with np.errstate(over="ignore", divide="ignore"):
        q = round_half_away(x / s)
    return np.clip(q, -127, 127).astype(np.int8), F32(s)


def ptq_dequantize(q: np.ndarray, scale: float) -> np.ndarray:
    """``q as f32 * scale``."""
    return q.astype(F32) * F32(scale)


def weight_range(w: np.ndarray) -> Tuple[np.float32, np.float32]:
    """``Calibrator::record_layer``'s min and max of the float32 weights."""
    x = np.asarray(w).reshape(-1).astype(F32)
    # First of equal values, as the seed's f32::min / f32::max folds (0.0 or -0.0).
    return x[np.argmin(x)], x[np.argmax(x)]
