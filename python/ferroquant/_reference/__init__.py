"""Plain-NumPy reference implementations of the seed kernels: the test oracle.

One module per family, written for clarity and never used on the production
path. Each function follows its seed line by line in the seed's precision,
with the SPEC's deviations.
"""

from .affine import dequantize_affine, pack_int4, quantize_affine, unpack_int4
from .blockwise import dequantize_blockwise, quantize_blockwise, round_half_away
from .dynamic import (
    bitnet_quantize,
    calib_stats,
    compute_scale,
    dequantize_groups,
    dynamic_quantize,
    percentile_rank,
    quantization_mae,
    smooth_factors,
    w8a8,
)
from .f16bits import fp16_bits_to_fp32, fp32_to_fp16_bits
from .ptq import ptq_dequantize, ptq_quantize, weight_range

__all__ = [
    "bitnet_quantize",
    "calib_stats",
    "compute_scale",
    "dequantize_affine",
    "dequantize_blockwise",
    "dequantize_groups",
    "dynamic_quantize",
    "fp16_bits_to_fp32",
    "fp32_to_fp16_bits",
    "pack_int4",
    "percentile_rank",
    "ptq_dequantize",
    "ptq_quantize",
    "quantization_mae",
    "quantize_affine",
    "quantize_blockwise",
    "round_half_away",
    "smooth_factors",
    "unpack_int4",
    "w8a8",
    "weight_range",
]
