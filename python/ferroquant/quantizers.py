"""Built-in quantizers, registered by name at import (SPEC §6): the one table of names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np

from ._checks import is_float_dtype, positive_int, scale_dtype
from .affine import QuantConfig, QuantizedTensor, dequantize, quantize
from .blockwise import BlockwiseQuantized, dequantize_blockwise, quantize_blockwise
from .registry import register_quantizer

__all__ = ["Affine", "Blockwise8"]


@dataclass(frozen=True)
class Blockwise8:
    """``blockwise8``: blockwise int8 codes with one float16 (or float32) scale per block.

    Args:
        block_size: elements per block (>= 1).
        scale_dtype: ``np.float16`` or ``np.float32``.
    """

    block_size: int = 64
    scale_dtype: Any = np.float16
    name: str = field(default="blockwise8", init=False)
    kind: str = field(default="weight", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_size", positive_int(self.block_size, "block_size"))
        object.__setattr__(self, "scale_dtype", scale_dtype(self.scale_dtype))

    def fits(self, shape: Tuple[int, ...], dtype: np.dtype) -> Optional[str]:
        """Why an array of this shape and dtype is not quantized with this scheme, or None."""
        if not is_float_dtype(np.dtype(dtype)):
            return f"dtype {np.dtype(dtype)} is not floating"
        return None

    def quantize(self, x: Any) -> BlockwiseQuantized:
        """:func:`ferroquant.quantize_blockwise` with this quantizer's parameters."""
        return quantize_blockwise(x, self.block_size, self.scale_dtype)

    def dequantize(self, q: Any) -> np.ndarray:
        """:func:`ferroquant.dequantize_blockwise` (TypeError unless a BlockwiseQuantized)."""
        return dequantize_blockwise(q)


register_quantizer("blockwise8", Blockwise8)


@dataclass(frozen=True)
class Affine:
    """``int8``, ``int4``, ``...-per-channel``, ``...-asym``: seed 001's affine schemes.

    Args:
        bits: 8 or 4.
        mode: ``"symmetric"`` or ``"asymmetric"``.
        granularity: ``"per_tensor"`` or ``"per_channel"``.
    """

    bits: int = 8
    mode: str = "symmetric"
    granularity: str = "per_tensor"
    kind: str = field(default="weight", init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", QuantConfig(self.bits, self.mode, self.granularity))

    @property
    def name(self) -> str:
        """The registry name (``int8``, ``int4-per-channel-asym``, ...)."""
        return self.config.name  # type: ignore[attr-defined]

    def fits(self, shape: Tuple[int, ...], dtype: np.dtype) -> Optional[str]:
        """Why an array of this shape and dtype is not quantized with this scheme, or None."""
        if not is_float_dtype(np.dtype(dtype)):
            return f"dtype {np.dtype(dtype)} is not floating"
        return None

    def quantize(self, x: Any) -> QuantizedTensor:
        """:func:`ferroquant.quantize` with this quantizer's config."""
        return quantize(x, self.config)  # type: ignore[attr-defined]

    def dequantize(self, q: Any) -> np.ndarray:
        """:func:`ferroquant.dequantize` (TypeError unless a QuantizedTensor)."""
        return dequantize(q)


def _affine_factory(bits: int, mode: str, granularity: str) -> Any:
    def factory() -> Affine:
        return Affine(bits, mode, granularity)

    factory.__doc__ = f"The {QuantConfig(bits, mode, granularity).name} quantizer."
    return factory


for _bits in (8, 4):
    for _gran in ("per_tensor", "per_channel"):
        for _mode in ("symmetric", "asymmetric"):
            register_quantizer(
                QuantConfig(_bits, _mode, _gran).name, _affine_factory(_bits, _mode, _gran)
            )
