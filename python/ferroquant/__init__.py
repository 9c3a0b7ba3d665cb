"""ferroquant: the fastest trustworthy way to quantize NumPy arrays.

Bit-exact ports of reference quantization kernels, in Rust with runtime SIMD
dispatch and a private thread pool, exposed as zero-copy NumPy functions.

>>> import numpy as np, ferroquant as fq
>>> q = fq.quantize_blockwise(np.linspace(-1, 1, 1000, dtype=np.float32))
>>> q.data.dtype, q.scales.dtype, round(q.compression_ratio(), 2)
(dtype('int8'), dtype('float16'), 3.88)
"""

from __future__ import annotations

from . import quantizers as _quantizers  # noqa: F401  (registers the built-in quantizers)
from ._ferroquant import __version__
from ._runtime import (
    get_num_threads,
    get_output_cache,
    set_num_threads,
    set_output_cache,
    simd_isa,
    supported_isas,
    warn_about_environment,
)
from .affine import (
    QuantConfig,
    QuantizedLinear,
    QuantizedTensor,
    QuantStats,
    dequantize,
    quantization_stats,
    quantize,
    quantize_named_parameters,
)
from .bitnet import (
    BitNetConfig,
    QuantizedActivations,
    dequantize_activations,
    quantize_activations,
    quantize_ste,
)
from .blockwise import BlockwiseQuantized, dequantize_blockwise, quantize_blockwise
from .dynamic import (
    CalibStats,
    DynQuantTensor,
    MaxAbs,
    Percentile,
    SmoothQuantConfig,
    compute_scale,
    compute_smooth_factors,
    dynamic_quantize_int4,
    dynamic_quantize_int8,
    dynamic_quantize_int8_per_row,
    quantization_mae,
    smooth_activations,
    smooth_weights,
)
from .errors import (
    EmptyInputError,
    FormatError,
    InvalidConfigError,
    NonFiniteError,
    PrecisionWarning,
    QuantizationError,
    ShapeMismatchError,
)
from .f16bits import fp16_bits_to_fp32, fp32_to_fp16_bits
from .ptq import (
    Calibrator,
    LayerCalibration,
    QuantizedModel,
    QuantizedWeights,
    quantize_model_weights,
)
from .quantizers import Affine, BitNetAct, Blockwise8, Dynamic, PTQInt8
from .registry import Quantizer, get_quantizer, list_quantizers, register_quantizer
from .serialization import load, load_bytes, save, save_bytes
from .w8a8 import w8a8_matmul, w8a8_matvec

__all__ = [
    "Affine",
    "BitNetAct",
    "BitNetConfig",
    "Blockwise8",
    "BlockwiseQuantized",
    "CalibStats",
    "Calibrator",
    "DynQuantTensor",
    "Dynamic",
    "EmptyInputError",
    "FormatError",
    "InvalidConfigError",
    "LayerCalibration",
    "MaxAbs",
    "NonFiniteError",
    "PTQInt8",
    "Percentile",
    "PrecisionWarning",
    "QuantConfig",
    "QuantStats",
    "QuantizationError",
    "QuantizedActivations",
    "QuantizedLinear",
    "QuantizedModel",
    "QuantizedTensor",
    "QuantizedWeights",
    "Quantizer",
    "ShapeMismatchError",
    "SmoothQuantConfig",
    "__version__",
    "compute_scale",
    "compute_smooth_factors",
    "dequantize",
    "dequantize_activations",
    "dequantize_blockwise",
    "dynamic_quantize_int4",
    "dynamic_quantize_int8",
    "dynamic_quantize_int8_per_row",
    "fp16_bits_to_fp32",
    "fp32_to_fp16_bits",
    "get_num_threads",
    "get_output_cache",
    "get_quantizer",
    "list_quantizers",
    "load",
    "load_bytes",
    "quantization_mae",
    "quantization_stats",
    "quantize",
    "quantize_activations",
    "quantize_blockwise",
    "quantize_model_weights",
    "quantize_named_parameters",
    "quantize_ste",
    "register_quantizer",
    "save",
    "save_bytes",
    "set_num_threads",
    "set_output_cache",
    "simd_isa",
    "smooth_activations",
    "smooth_weights",
    "supported_isas",
    "w8a8_matmul",
    "w8a8_matvec",
]


warn_about_environment()
del warn_about_environment
