"""Reference binary16 conversions (SPEC §5), bit by bit: IEEE round to nearest even,
and the Rust ``half`` crate's NaN rule (quiet bit set, the payload's top bits kept)."""

from __future__ import annotations

import numpy as np


def fp16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """float32 values of uint16 binary16 bit patterns."""
    b = np.asarray(bits, np.uint16).astype(np.uint32)
    sign, exp, man = (b >> 15) << 31, (b >> 10) & 0x1F, b & 0x3FF
    normal = sign | ((exp + (127 - 15)) << 23) | (man << 13)
    special = sign | 0x7F800000 | np.where(man != 0, 0x400000 | (man << 13), 0)
    # Subnormal halves (and zeros) are man * 2^-24, exact in float32.
    sub = (man.astype(np.float32) * np.float32(2.0**-24)).view(np.uint32) | sign
    out = np.where(exp == 31, special, np.where(exp == 0, sub, normal))
    return out.astype(np.uint32).view(np.float32)


def fp32_to_fp16_bits(x: np.ndarray) -> np.ndarray:
    """binary16 bits of float32 values, round to nearest even (NumPy's cast, which is
    IEEE's), with NaNs as ``half`` makes them."""
    f = np.asarray(x, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = f.astype(np.float16).view(np.uint16).copy()
    u = f.view(np.uint32)
    nan = np.isnan(f)
    sign = ((u >> 31) << 15).astype(np.uint16)
    payload = ((u & 0x7FFFFF) >> 13).astype(np.uint16)
    out[nan] = (sign | 0x7C00 | 0x0200 | payload)[nan]
    return out
