"""ferroquant: the fastest trustworthy way to quantize NumPy arrays.

Bit-exact ports of reference quantization kernels, in Rust with runtime SIMD
dispatch and a private thread pool, exposed as zero-copy NumPy functions.

>>> import numpy as np, ferroquant as fq
>>> q = fq.quantize_blockwise(np.linspace(-1, 1, 1000, dtype=np.float32))
>>> q.data.dtype, q.scales.dtype, round(q.compression_ratio(), 2)
(dtype('int8'), dtype('float16'), 3.88)
"""

from __future__ import annotations

import os as _os
import warnings as _warnings

from . import quantizers as _quantizers  # noqa: F401  (registers the built-in quantizers)
from ._ferroquant import __version__
from .errors import (
    EmptyInputError,
    FormatError,
    InvalidConfigError,
    NonFiniteError,
    PrecisionWarning,
    QuantizationError,
    ShapeMismatchError,
)
from .functional import (
    dequantize_blockwise,
    get_num_threads,
    quantize_blockwise,
    set_num_threads,
    simd_isa,
    supported_isas,
)
from .quantizers import Blockwise8
from .registry import Quantizer, get_quantizer, list_quantizers, register_quantizer
from .serialization import load, load_bytes, save, save_bytes
from .types import BlockwiseQuantized

__all__ = [
    "Blockwise8",
    "BlockwiseQuantized",
    "EmptyInputError",
    "FormatError",
    "InvalidConfigError",
    "NonFiniteError",
    "PrecisionWarning",
    "QuantizationError",
    "Quantizer",
    "ShapeMismatchError",
    "__version__",
    "dequantize_blockwise",
    "get_num_threads",
    "get_quantizer",
    "list_quantizers",
    "load",
    "load_bytes",
    "quantize_blockwise",
    "register_quantizer",
    "save",
    "save_bytes",
    "set_num_threads",
    "simd_isa",
    "supported_isas",
]


def _check_thread_env() -> None:
    # The native pool reads FERROQUANT_NUM_THREADS itself; here a bad value is
    # reported instead of being silently replaced by the CPU count.
    raw = _os.environ.get("FERROQUANT_NUM_THREADS")
    if raw is None:
        return
    try:
        ok = int(raw.strip()) >= 1
    except ValueError:
        ok = False
    if not ok:
        _warnings.warn(
            f"FERROQUANT_NUM_THREADS={raw!r} is not an integer >= 1; using "
            f"{get_num_threads()} threads",
            RuntimeWarning,
            stacklevel=2,
        )


_check_thread_env()
