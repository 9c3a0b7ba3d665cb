"""float16 bit patterns (SPEC §5; seed 004 stores f16 weights as ``u16`` bits).

IEEE binary16 with round to nearest even, exactly as the Rust ``half`` crate converts:
subnormal results, overflow to ±inf, and NaN quieted with the top of its payload kept.
F16C / AVX-512 do the conversion where the CPU has them; every path gives the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _ferroquant as _native
from ._checks import describe, float_input, is_array_of, kernel_layout

__all__ = ["fp16_bits_to_fp32", "fp32_to_fp16_bits"]


def fp32_to_fp16_bits(x: Any) -> np.ndarray:
    """``uint16`` array of ``x``'s shape: the binary16 bits of each value read as
    float32, rounded to nearest even.

    float16, bfloat16 and float64 input is read as float32 first, as every kernel
    reads its input (SPEC's general rules): exactly for float16 and bfloat16; a
    float64 value is rounded to float32 and then to float16, which can differ by
    one unit from rounding it to float16 directly. A float64 value past
    float32's range is ±inf (the bits of infinity).

    Raises:
        TypeError: ``x`` is not a floating array (float32, float64, float16 or bfloat16).
    """
    arr = float_input(x, "x")
    return _native.fp32_to_fp16_bits(arr).reshape(arr.shape)


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
