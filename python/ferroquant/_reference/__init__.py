"""Plain-NumPy reference implementations of the seed kernels: the test oracle.

One module per family, written for clarity and never used on the production
path. Each function follows its seed line by line in the seed's precision,
with the SPEC's deviations.
"""

from .affine import dequantize_affine, pack_int4, quantize_affine, unpack_int4
from .blockwise import dequantize_blockwise, quantize_blockwise, round_half_away

__all__ = [
    "dequantize_affine",
    "dequantize_blockwise",
    "pack_int4",
    "quantize_affine",
    "quantize_blockwise",
    "round_half_away",
    "unpack_int4",
]
