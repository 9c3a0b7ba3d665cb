"""BitNet activation quantization (SPEC §4, seed 003): per-token (or per batch item)
max-abs int8, and the straight-through estimator's fake quantization.

``scale = max|x| / (2^(bits-1) - 1)``, 1.0 for an all-zero group; codes
``clamp(round(v / scale), -max, max)``; values ``code * scale``, all in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Tuple

import numpy as np

from . import _ferroquant as _native
from ._base import Quantized, Record, check_scales, f32_ratio
from ._checks import (
    beyond_f32,
    describe,
    exact_int,
    float32_shape,
    float_input,
    held,
    is_array_of,
    readonly,
    shape_tuple,
    source_dtype,
)
from .errors import InvalidConfigError, NonFiniteError, ShapeMismatchError

__all__ = [
    "BitNetConfig",
    "QuantizedActivations",
    "dequantize_activations",
    "quantize_activations",
    "quantize_ste",
]


@dataclass(frozen=True)
class BitNetConfig(Record):
    """Seed 003's activation settings.

    Args:
        activation_bits: 2..8 (codes in ``±(2^(bits-1) - 1)``).
        per_token_activation: one scale per token (else one per batch item).

    Raises:
        InvalidConfigError: ``activation_bits`` outside 2..8.
        TypeError: a setting of the wrong type.
    """

    activation_bits: int = 8
    per_token_activation: bool = True

    scheme: ClassVar[str] = "bitnet-config"
    _params: ClassVar[Tuple[str, ...]] = ("activation_bits", "per_token_activation")

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation_bits", _bits(self.activation_bits, "activation_bits"))
        flag = _flag(self.per_token_activation, "per_token_activation")
        object.__setattr__(self, "per_token_activation", flag)


def _bits(value: Any, arg: str) -> int:
    """``value`` as a bit width in 2..8, checked under the caller's name ``arg``."""
    b = exact_int(value, arg)
    if not 2 <= b <= 8:
        raise InvalidConfigError(f"{arg} must be in 2..8, got {b}")
    return b


def _flag(value: Any, arg: str) -> bool:
    """``value`` as a bool (NumPy's included), checked under the name ``arg``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg} must be a bool, got {type(value).__name__}")
    return bool(value)


def _dims(shape: Tuple[int, ...], arg: str = "x") -> Tuple[int, int, int]:
    if len(shape) == 2:
        return shape[0], 1, shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    raise InvalidConfigError(
        f"{arg} must be [batch, hidden] or [batch, seq, hidden], got {len(shape)}-D shape {shape}"
    )


@dataclass(frozen=True, eq=False, repr=False)
class QuantizedActivations(Quantized):
    """Seed 003's ``QuantizedActivations``.

    Attributes:
        data: ``int8`` codes in the input's shape.
        scales: ``float32``: ``batch·seq`` scales per token, else ``batch``.
        shape: ``(batch, hidden)`` or ``(batch, seq, hidden)``.
        per_token: whether scales are per token.
        bits: the activation bits the codes were made with (2..8).
        dtype: the dtype the input had (``quantize_activations`` records it;
            ``ferroquant dequantize`` restores it, while ``dequantize_activations``
            returns float32 as the seed does). Provenance: not compared by ``==``.
    """

    data: np.ndarray
    scales: np.ndarray
    shape: Tuple[int, ...]
    per_token: bool = True
    bits: int = 8
    dtype: str = field(default="float32", compare=False)

    scheme: ClassVar[str] = "bitnet-act"
    _arrays: ClassVar[Tuple[str, ...]] = ("data", "scales")
    _params: ClassVar[Tuple[str, ...]] = ("shape", "per_token", "bits", "dtype")
    _later_params: ClassVar[Tuple[str, ...]] = ("dtype",)

    def __post_init__(self) -> None:
        shape = shape_tuple(self.shape, dtype=self.dtype, at_least=4)  # float32 values
        b, s, _ = _dims(shape, "shape")
        # Checked under this class's own field names, then as a config.
        cfg = BitNetConfig(_bits(self.bits, "bits"), _flag(self.per_token, "per_token"))
        data, scales = self.data, self.scales
        if not isinstance(data, np.ndarray) or data.dtype != np.int8:
            raise TypeError(f"data must be an int8 array, got {describe(data)}")
        if not is_array_of(scales, np.float32):
            raise TypeError(f"scales must be a float32 array, got {describe(scales)}")
        if data.shape != shape:
            raise ShapeMismatchError(f"data: expected shape {shape}, got {data.shape}")
        k = b * s if cfg.per_token_activation else b
        if scales.shape != (k,):
            raise ShapeMismatchError(
                f"scales: expected shape ({k},) for {shape}, got {scales.shape}"
            )
        data, scales = held(data), held(scales)
        m = (1 << (cfg.activation_bits - 1)) - 1
        check_scales(scales, m, dtype=source_dtype(self.dtype))
        if data.size and (data.min() < -m or data.max() > m):
            bad = int(np.flatnonzero(np.abs(data.astype(np.int16)).reshape(-1) > m)[0])
            raise InvalidConfigError(
                f"data must hold codes in -{m}..{m}, "
                f"got {int(data.reshape(-1)[bad])} at index {bad}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "per_token", cfg.per_token_activation)
        object.__setattr__(self, "bits", cfg.activation_bits)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "dtype", source_dtype(self.dtype))

    @property
    def batch_size(self) -> int:
        """``shape[0]``."""
        return self.shape[0]

    @property
    def seq_len(self) -> int:
        """``shape[1]`` of a 3-D input, 1 for 2-D."""
        return self.shape[1] if len(self.shape) == 3 else 1

    @property
    def hidden_dim(self) -> int:
        """The last dimension."""
        return self.shape[-1]

    @property
    def numel(self) -> int:
        """Number of values."""
        return math.prod(self.shape)

    def size_bytes(self) -> int:
        """Bytes held: one a code + 4 a scale."""
        return int(self.data.size + 4 * self.scales.size)

    def compression_ratio(self) -> float:
        """``4·numel / size_bytes()`` in f32."""
        return f32_ratio(4 * self.numel, self.size_bytes())

    def dequantize(self) -> np.ndarray:
        """See :func:`dequantize_activations`."""
        return dequantize_activations(self)

    def _repr_fields(self) -> str:
        src = "" if self.dtype == "float32" else f", dtype={self.dtype}"
        return f"per_token={self.per_token}, bits={self.bits}{src}"


def _groups(x: Any, config: Any) -> Tuple[np.ndarray, int]:
    """``x`` ready for the kernels, and how many groups (scales) ``config`` makes of it."""
    if not isinstance(config, BitNetConfig):
        raise TypeError(f"config must be a BitNetConfig, got {type(config).__name__}")
    arr = float_input(x, "x")
    float32_shape(arr.shape, "x")
    b, s, _ = _dims(arr.shape)
    return arr, b * s if config.per_token_activation else b


def quantize_activations(x: Any, config: BitNetConfig = BitNetConfig()) -> QuantizedActivations:
    """Per-token (or per batch item) max-abs quantization of ``[batch, hidden]`` or
    ``[batch, seq, hidden]`` activations.

    Raises:
        TypeError: ``x`` is not a floating array or ``config`` not a BitNetConfig.
        InvalidConfigError: ``x`` is not 2-D or 3-D.
        NonFiniteError: ``x`` holds NaN or an infinity.
    """
    arr, groups = _groups(x, config)
    try:
        data, scales = _native.quantize_bitnet(arr, groups, config.activation_bits)
    except NonFiniteError as e:
        raise beyond_f32(e, arr) from None
    return QuantizedActivations._trusted(
        data=readonly(data.reshape(arr.shape)),
        scales=readonly(scales),
        shape=arr.shape,
        per_token=config.per_token_activation,
        bits=config.activation_bits,
        dtype=source_dtype(arr.dtype),
    )


def dequantize_activations(q: QuantizedActivations) -> np.ndarray:
    """float32 values ``code * scale`` in ``q.shape``."""
    if not isinstance(q, QuantizedActivations):
        raise TypeError(f"q must be a QuantizedActivations, got {type(q).__name__}")
    n = q.numel
    group = n // q.scales.size if q.scales.size else 0
    flat = _native.dequantize_groups(q.data.reshape(-1), n, group, q.scales, False)
    return flat.reshape(q.shape)


def quantize_ste(x: Any, config: BitNetConfig = BitNetConfig()) -> np.ndarray:
    """The straight-through estimator's forward pass: quantize, then dequantize (float32),
    fused so that only a slab of codes exists at a time: about a million, or one group
    (a token, or with ``per_token_activation=False`` a batch item) where that is more.

    Raises: as :func:`quantize_activations`.
    """
    arr, groups = _groups(x, config)
    try:
        flat = _native.fake_quantize_bitnet(arr, groups, config.activation_bits)
    except NonFiniteError as e:
        raise beyond_f32(e, arr) from None
    return flat.reshape(arr.shape)
