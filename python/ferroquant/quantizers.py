"""Built-in quantizers, registered by name at import (SPEC §6): the one table of names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

import numpy as np

from ._checks import is_float_dtype, positive_int, scale_dtype
from .affine import QuantConfig, QuantizedTensor, dequantize, quantize
from .bitnet import BitNetConfig, QuantizedActivations, dequantize_activations, quantize_activations
from .blockwise import BlockwiseQuantized, dequantize_blockwise, quantize_blockwise
from .dynamic import (
    DynQuantTensor,
    MaxAbs,
    Percentile,
    dynamic_quantize_int4,
    dynamic_quantize_int8,
    dynamic_quantize_int8_per_row,
)
from .errors import InvalidConfigError
from .ptq import QuantizedWeights
from .registry import register_quantizer

__all__ = ["Affine", "BitNetAct", "Blockwise8", "Dynamic", "PTQInt8"]


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


_DYNAMIC = {
    "dynamic-int8": ("int8_per_tensor", dynamic_quantize_int8),
    "dynamic-int8-per-row": ("int8_per_row", dynamic_quantize_int8_per_row),
    "dynamic-int4": ("int4_per_tensor", dynamic_quantize_int4),
}


@dataclass(frozen=True)
class Dynamic:
    """``dynamic-int8``, ``dynamic-int8-per-row``, ``dynamic-int4``: seed 002's dynamic
    quantization (a scale from the values themselves).

    Args:
        name: one of the three names.
        percentile: ``None`` for max-abs scales, else ``p`` in (0, 1].
    """

    name: str = "dynamic-int8"
    percentile: Optional[float] = None
    kind: str = field(default="activation", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in _DYNAMIC:
            raise InvalidConfigError(
                f"name must be one of {', '.join(_DYNAMIC)}, got {self.name!r}"
            )
        mode = MaxAbs() if self.percentile is None else Percentile(self.percentile)
        object.__setattr__(self, "mode", mode)

    def fits(self, shape: Tuple[int, ...], dtype: np.dtype) -> Optional[str]:
        """Why an array of this shape and dtype is not quantized with this scheme, or None."""
        if not is_float_dtype(np.dtype(dtype)):
            return f"dtype {np.dtype(dtype)} is not floating"
        if self.name == "dynamic-int8-per-row" and len(shape) != 2:
            return f"{self.name} needs a 2-D tensor, got {len(shape)}-D"
        return None

    def quantize(self, x: Any) -> DynQuantTensor:
        """Quantize with this scheme's function and scale mode."""
        return _DYNAMIC[self.name][1](x, self.mode)  # type: ignore[attr-defined]

    def dequantize(self, q: Any) -> np.ndarray:
        """``q.dequantize()`` (TypeError unless a DynQuantTensor)."""
        if not isinstance(q, DynQuantTensor):
            raise TypeError(f"q must be a DynQuantTensor, got {type(q).__name__}")
        return q.dequantize()


def _dynamic_factory(name: str) -> Any:
    def factory(percentile: Optional[float] = None) -> Dynamic:
        return Dynamic(name, percentile)

    factory.__doc__ = f"The {name} quantizer (percentile=None: max-abs scales)."
    return factory


for _name in _DYNAMIC:
    register_quantizer(_name, _dynamic_factory(_name))


@dataclass(frozen=True)
class BitNetAct:
    """``bitnet-act``: seed 003's per-token activation quantization.

    Args:
        activation_bits: 2..8.
        per_token_activation: one scale per token (else per batch item).
    """

    activation_bits: int = 8
    per_token_activation: bool = True
    name: str = field(default="bitnet-act", init=False)
    kind: str = field(default="activation", init=False)

    def __post_init__(self) -> None:
        cfg = BitNetConfig(self.activation_bits, self.per_token_activation)
        object.__setattr__(self, "config", cfg)

    def fits(self, shape: Tuple[int, ...], dtype: np.dtype) -> Optional[str]:
        """Why an array of this shape and dtype is not quantized with this scheme, or None."""
        if not is_float_dtype(np.dtype(dtype)):
            return f"dtype {np.dtype(dtype)} is not floating"
        if len(shape) not in (2, 3):
            return f"bitnet-act needs a 2-D or 3-D tensor, got {len(shape)}-D"
        return None

    def quantize(self, x: Any) -> QuantizedActivations:
        """:func:`ferroquant.quantize_activations` with this quantizer's config."""
        return quantize_activations(x, self.config)  # type: ignore[attr-defined]

    def dequantize(self, q: Any) -> np.ndarray:
        """:func:`ferroquant.dequantize_activations`."""
        return dequantize_activations(q)


register_quantizer("bitnet-act", BitNetAct)


@dataclass(frozen=True)
class PTQInt8:
    """``ptq-int8``: seed 004's post-training int8 (one float32 scale a tensor,
    ``max|w| / 127`` unless given).

    Args:
        scale: a fixed scale (finite, > 0), or None to take it from each tensor.
    """

    scale: Optional[float] = None
    name: str = field(default="ptq-int8", init=False)
    kind: str = field(default="weight", init=False)

    def __post_init__(self) -> None:
        if self.scale is not None:  # checked now, not at the first tensor
            QuantizedWeights.from_f32("", np.zeros(1, np.float32), scale=self.scale)

    def fits(self, shape: Tuple[int, ...], dtype: np.dtype) -> Optional[str]:
        """Why an array of this shape and dtype is not quantized with this scheme, or None."""
        if not is_float_dtype(np.dtype(dtype)):
            return f"dtype {np.dtype(dtype)} is not floating"
        return None

    def quantize(self, x: Any, name: str = "") -> QuantizedWeights:
        """:meth:`ferroquant.QuantizedWeights.from_f32` of ``x`` in its own shape."""
        return QuantizedWeights.from_f32(name, x, scale=self.scale)

    def dequantize(self, q: Any) -> np.ndarray:
        """``q.dequantize()`` (TypeError unless a QuantizedWeights)."""
        if not isinstance(q, QuantizedWeights):
            raise TypeError(f"q must be a QuantizedWeights, got {type(q).__name__}")
        return q.dequantize()


register_quantizer("ptq-int8", PTQInt8)
