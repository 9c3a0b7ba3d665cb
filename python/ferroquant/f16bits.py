"""float16 bit patterns (SPEC §5; seed 004 stores f16 weights as ``u16`` bits).

IEEE binary16 with round to nearest even, exactly as the Rust ``half`` crate converts:
subnormal results, overflow to ±inf, and NaN quieted with the top of its payload kept.
F16C / AVX-512 do the conversion where the CPU has them; every path gives the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _ferroquant as _native
from ._checks import describe, is_array_of, kernel_layout

__all__ = ["fp16_bits_to_fp32", "fp32_to_fp16_bits"]


def fp32_to_fp16_bits(x: Any) -> np.ndarray:
    """``uint16`` array of ``x``'s shape: the binary16 bits of each float32 value,
    rounded to nearest even.

    Raises:
        TypeError: ``x`` is not a float32 array (convert other types first: a float64
            value rounded twice would not be the nearest half).
    """
    if isinstance(x, np.generic):
        x = np.asarray(x)  # a NumPy scalar: a 0-d array of its type
    if not is_array_of(x, np.float32):
        raise TypeError(f"x must be a float32 array, got {describe(x)}")
    arr = kernel_layout(x, np.dtype(np.float32))
    return _native.fp32_to_fp16_bits(arr).reshape(x.shape)


def fp16_bits_to_fp32(bits: Any) -> np.ndarray:
    """``float32`` array of ``bits``' shape: the value of each binary16 bit pattern
    (exact; NaN payloads kept, a signalling NaN quieted).

    Raises:
        TypeError: ``bits`` is not a uint16 array.
    """
    if isinstance(bits, np.generic):
        bits = np.asarray(bits)
    if not is_array_of(bits, np.uint16):
        raise TypeError(f"bits must be a uint16 array, got {describe(bits)}")
    arr = kernel_layout(bits, np.dtype(np.uint16))
    return _native.fp16_bits_to_fp32(arr).reshape(bits.shape)
