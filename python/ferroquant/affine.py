"""Affine int8 / int4 quantization, per tensor or per channel (SPEC §2, seed 001).

Math in float64, exactly as the seed: symmetric ``scale = amax / qmax`` (1.0 if
``amax < 1e-30``), zero point 0; asymmetric ``scale = (max - min) / (qmax - qmin)``
(1.0 if the range is below 1e-30), ``zp = round(qmin - min / scale)``; codes
``clamp(round(v * inv + zp), qmin, qmax)`` with ``inv = 1 / scale`` (0 if
``|scale| < 1e-30``); values ``(q - zp) * scale``. int4 codes are packed two a
byte, element ``2i`` in the low nibble (the ONNX convention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterable, Mapping, Optional, Tuple

import ml_dtypes
import numpy as np

from . import _ferroquant as _native
from ._base import Quantized, Record, check_codes, first_true, ratio_text, unpack_int4
from ._checks import (
    FLOAT_DTYPES,
    beyond_f32,
    describe,
    float_input,
    held,
    is_array_of,
    is_float_dtype,
    kernel_layout,
    readonly,
    renamed,
    shape_tuple,
    short_repr,
    source_dtype,
    to_float32,
)
from .errors import (
    FormatError,
    InvalidConfigError,
    NonFiniteError,
    QuantizationError,
    ShapeMismatchError,
)

__all__ = [
    "QuantConfig",
    "QuantStats",
    "QuantizedLinear",
    "QuantizedTensor",
    "dequantize",
    "quantization_stats",
    "quantize",
    "quantize_named_parameters",
]

_MODES = ("symmetric", "asymmetric")
_GRANULARITIES = ("per_tensor", "per_channel")
# The seed's (qmin, qmax) table.
_RANGE = {
    (8, "symmetric"): (-127, 127),
    (8, "asymmetric"): (-128, 127),
    (4, "symmetric"): (-7, 7),
    (4, "asymmetric"): (-8, 7),
}


# The largest finite value of each source dtype.
_SOURCE_MAX = {name: float(ml_dtypes.finfo(dt).max) for name, dt in FLOAT_DTYPES.items()}


def _check_reach(scales: np.ndarray, zps: np.ndarray, config: QuantConfig, dtype: str) -> None:
    """InvalidConfigError naming the first group whose codes would dequantize beyond
    anything the seed's math makes from a finite ``dtype`` input. Quantizing maps the
    group's range onto ``qmin..qmax`` with a zero point rounded by at most half a code,
    so the extreme codes reach at most ``max·(1 + 1/(qmax - qmin))`` (float64 slack
    on top); a larger scale or zero point is hand-made or corrupt."""
    span = config.qmax - config.qmin
    # In halves, so float64's limit (past its own largest value) stays finite. An
    # infinite scale (a float64 range that overflowed, as the seed's math gives it)
    # is not judged here.
    half_limit = _SOURCE_MAX[dtype] / 2 * (1 + 1 / span) * (1 + 1e-9)
    with np.errstate(over="ignore"):  # an inf reach is reported below
        half_reach = np.maximum(np.abs(config.qmin - zps), np.abs(config.qmax - zps)) * (scales / 2)
    bad = first_true((half_reach > half_limit) & np.isfinite(scales))
    if bad is not None:
        raise InvalidConfigError(
            f"scales and zero_points: group {bad} (scale {scales[bad]}, zero point "
            f"{zps[bad]}) dequantizes codes {config.qmin}..{config.qmax} up to "
            f"{2 * half_reach[bad]:.4g}, beyond what a finite {dtype} input gives (its "
            f"largest value {_SOURCE_MAX[dtype]:.4g}, and a step)"
        )


@dataclass(frozen=True)
class QuantConfig(Record):
    """Seed 001's ``QuantConfig``: code width, mode and granularity.

    Args:
        bits: 8 or 4.
        mode: ``"symmetric"`` (zero point 0) or ``"asymmetric"``.
        granularity: ``"per_tensor"`` or ``"per_channel"`` (one scale per index of axis 0).

    Raises:
        InvalidConfigError: any other value.
    """

    bits: int = 8
    mode: str = "symmetric"
    granularity: str = "per_tensor"

    scheme: ClassVar[str] = "quant-config"
    _params: ClassVar[Tuple[str, ...]] = ("bits", "mode", "granularity")

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)):
            raise InvalidConfigError(f"bits must be 8 or 4, got {self.bits!r}")
        if int(self.bits) not in (8, 4):
            raise InvalidConfigError(f"bits must be 8 or 4, got {self.bits!r}")
        object.__setattr__(self, "bits", int(self.bits))
        if isinstance(self.mode, str):
            object.__setattr__(self, "mode", str(self.mode))
        if isinstance(self.granularity, str):
            object.__setattr__(self, "granularity", str(self.granularity))
        if self.mode not in _MODES:
            raise InvalidConfigError(f"mode must be one of {_MODES}, got {self.mode!r}")
        if self.granularity not in _GRANULARITIES:
            raise InvalidConfigError(
                f"granularity must be one of {_GRANULARITIES}, got {self.granularity!r}"
            )

    @classmethod
    def int8(cls) -> QuantConfig:
        """int8, symmetric, per tensor (the default)."""
        return cls(8, "symmetric", "per_tensor")

    @classmethod
    def int8_per_channel(cls) -> QuantConfig:
        """int8, symmetric, per channel."""
        return cls(8, "symmetric", "per_channel")

    @classmethod
    def int4(cls) -> QuantConfig:
        """int4, symmetric, per tensor."""
        return cls(4, "symmetric", "per_tensor")

    @classmethod
    def int4_per_channel(cls) -> QuantConfig:
        """int4, symmetric, per channel."""
        return cls(4, "symmetric", "per_channel")

    def asymmetric(self) -> QuantConfig:
        """A new config, the same but asymmetric."""
        return QuantConfig(self.bits, "asymmetric", self.granularity)

    @property
    def qmin(self) -> int:
        """The smallest code: int8 -127 (asymmetric -128), int4 -7 (asymmetric -8)."""
        return _RANGE[(self.bits, self.mode)][0]

    @property
    def qmax(self) -> int:
        """The largest code: 127 or 7."""
        return _RANGE[(self.bits, self.mode)][1]

    @property
    def name(self) -> str:
        """The registry name of this configuration (``int8``, ``int4-per-channel-asym``, ...)."""
        return (
            f"int{self.bits}"
            + ("-per-channel" if self.granularity == "per_channel" else "")
            + ("-asym" if self.mode == "asymmetric" else "")
        )

    def _json(self) -> Dict[str, Any]:
        return {"bits": self.bits, "mode": self.mode, "granularity": self.granularity}

    @classmethod
    def _from_json(cls, value: Any) -> QuantConfig:
        if not isinstance(value, dict) or set(value) != {"bits", "mode", "granularity"}:
            raise FormatError(
                f"config must be an object with exactly bits, mode and granularity, got {value!r}"
            )
        try:
            return cls(**value)
        except InvalidConfigError as e:
            raise FormatError(f"invalid config: {e}") from None


def _finite_f32(arr: np.ndarray, arg: str) -> np.ndarray:
    """``arr`` as float32, or NonFiniteError naming ``arg`` and the first flat index
    holding NaN, ±inf, or a value beyond float32's range."""
    f = to_float32(arr)
    ok = np.isfinite(f)
    if not ok.all():
        index = int(np.flatnonzero(~ok.reshape(-1))[0])
        e = NonFiniteError(
            f"{arg} holds a non-finite value (NaN or ±inf) at flat index {index}", index
        )
        raise beyond_f32(e, arr)
    return f


def _groups(shape: Tuple[int, ...], config: QuantConfig) -> int:
    if config.granularity == "per_channel" and shape:
        return shape[0]
    return 1


@dataclass(frozen=True, eq=False, repr=False)
class QuantizedTensor(Quantized):
    """Affine-quantized codes with float64 scales and zero points (SPEC §2).

    Attributes:
        data: ``int8[numel]`` codes, or for int4 ``uint8[ceil(numel / 2)]``, two
            codes a byte (element ``2i`` in the low nibble, two's complement; the
            unused high nibble of an odd-length array is 0).
        scales: ``float64[k]``, one per group (k = 1 per tensor, ``shape[0]`` per channel).
        zero_points: ``float64[k]`` (integer values; 0 when symmetric).
        shape: the original shape.
        dtype: the original dtype; :func:`dequantize` returns it.
        config: the :class:`QuantConfig` used.
    """

    data: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    shape: Tuple[int, ...]
    dtype: str = "float32"
    config: QuantConfig = field(default_factory=QuantConfig)

    scheme: ClassVar[str] = "affine"
    _arrays: ClassVar[Tuple[str, ...]] = ("data", "scales", "zero_points")
    _params: ClassVar[Tuple[str, ...]] = ("shape", "dtype", "config")

    def __post_init__(self) -> None:
        if not isinstance(self.config, QuantConfig):
            raise TypeError(f"config must be a QuantConfig, got {type(self.config).__name__}")
        config = self.config
        shape = shape_tuple(self.shape, dtype=self.dtype)
        n = math.prod(shape)
        k = _groups(shape, config)
        want = (np.int8, (n,)) if config.bits == 8 else (np.uint8, (-(-n // 2),))
        data, scales, zps = self.data, self.scales, self.zero_points
        if not isinstance(data, np.ndarray) or data.dtype != want[0]:
            raise TypeError(
                f"data must be a {np.dtype(want[0]).name} array for {config.bits}-bit codes, "
                f"got {describe(data)}"
            )
        for name, arr in (("scales", scales), ("zero_points", zps)):
            if not is_array_of(arr, np.float64):
                raise TypeError(f"{name} must be a float64 array, got {describe(arr)}")
            if arr.shape != (k,):
                raise ShapeMismatchError(
                    f"{name}: expected shape ({k},) for shape {shape} {config.granularity}, "
                    f"got {arr.shape}"
                )
        if data.shape != want[1]:
            raise ShapeMismatchError(
                f"data: expected shape {want[1]} for {n} {config.bits}-bit codes, got {data.shape}"
            )
        data, scales, zps = held(data), held(scales), held(zps)
        dtype = source_dtype(self.dtype)
        # > 0 (+inf included, NaN not) from the bits: a float compare would read a
        # subnormal scale as 0 under a caller's denormals-are-zero flag.
        bits = scales.astype(np.float64, copy=False).view(np.uint64)
        positive = (bits - np.uint64(1)) < np.uint64(0x7FF0_0000_0000_0000)
        if scales.size and not positive.all():
            bad = int(np.flatnonzero(~positive)[0])
            raise InvalidConfigError(f"scales must be > 0, got {scales[bad]} at group {bad}")
        # Only a float64 range can overflow the f64 scale (the seed's math then gives
        # inf); any narrower source keeps it finite.
        if dtype != "float64" and scales.size and np.isinf(scales).any():
            bad = int(np.flatnonzero(np.isinf(scales))[0])
            raise InvalidConfigError(
                f"scales must be finite for a {dtype} source, got {scales[bad]} at group {bad}"
            )
        # Integral by the bits, as the scales: a subnormal is not an integer under any flags.
        z64 = zps.astype(np.float64, copy=False)
        integral = z64.view(np.uint64) == np.round(z64).view(np.uint64)
        if zps.size and not (np.isfinite(zps).all() and integral.all()):
            raise InvalidConfigError("zero_points must be finite integers")
        if config.mode == "symmetric" and zps.size and (zps != 0).any():
            raise InvalidConfigError("zero_points must be 0 for a symmetric config")
        if scales.size:
            _check_reach(scales, zps, config, dtype)
        check_codes(data, n, config.qmin, config.qmax, config.bits == 4)
        if config.bits == 4 and n % 2 == 1 and data[-1] >> 4 != 0:
            raise InvalidConfigError("the unused high nibble of the last byte must be 0")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "scales", scales)
        object.__setattr__(self, "zero_points", zps)

    @property
    def bits(self) -> int:
        """Bits per code (8 or 4)."""
        return self.config.bits

    def numel(self) -> int:
        """Number of values: the product of ``shape``."""
        return int(math.prod(self.shape))

    def size_bytes(self) -> int:
        """Bytes of codes: ``numel`` for int8, ``ceil(numel / 2)`` for int4 (the seed's count)."""
        n = self.numel()
        return n if self.config.bits == 8 else -(-n // 2)

    def compression_ratio(self) -> float:
        """``4 * numel / size_bytes()`` in float64 as the seed computes it: NaN (0/0)
        when empty, as the seed's f64 division gives."""
        size = self.size_bytes()
        return float(self.numel() * 4) / float(size) if size else math.nan

    def values(self) -> np.ndarray:
        """The codes as ``int8[numel]``, unpacked for int4."""
        if self.config.bits == 8:
            return self.data
        return readonly(unpack_int4(self.data, self.numel()))

    def dequantize(self) -> np.ndarray:
        """Values ``(q - zp) * scale`` in the original shape and dtype (:func:`dequantize`)."""
        return dequantize(self)

    @property
    def label(self) -> str:
        """The registry name of the scheme that made this value (e.g. ``int4-per-channel``)."""
        return self.config.name

    def _repr_fields(self) -> str:
        return f"dtype={self.dtype}"

    def _record(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        arrays, _ = super()._record()
        params = {"shape": list(self.shape), "dtype": self.dtype, "config": self.config._json()}
        return arrays, params

    @classmethod
    def _from_record(
        cls, arrays: Mapping[str, np.ndarray], params: Mapping[str, Any]
    ) -> QuantizedTensor:
        p = dict(params)
        p["config"] = QuantConfig._from_json(p.get("config"))
        return super()._from_record(arrays, p)


def quantize(x: Any, config: QuantConfig = QuantConfig()) -> QuantizedTensor:
    """Affine quantization of ``x`` (SPEC §2, seed 001), computed in float64.

    Args:
        x: float32, float64, float16 or bfloat16 array of any shape (per channel:
            one scale per index of axis 0; a 0-d input is quantized per tensor).
        config: a :class:`QuantConfig` (default int8 symmetric per tensor).

    Returns:
        A :class:`QuantizedTensor`.

    Raises:
        TypeError: ``x`` is not a floating array, or ``config`` not a QuantConfig.
        NonFiniteError: ``x`` holds NaN or an infinity (``.index`` says where).
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    arr = float_input(x, "x")
    data, scales, zps = _native.quantize_affine(arr, config.bits, config.mode, config.granularity)
    return QuantizedTensor._trusted(
        data=readonly(data),
        scales=readonly(scales),
        zero_points=readonly(zps),
        shape=arr.shape,
        dtype=source_dtype(arr.dtype),
        config=config,
    )


def _dequantize_as(q: QuantizedTensor, dtype: str) -> np.ndarray:
    c = q.config
    flat = _native.dequantize_affine(
        q.data, list(q.shape), c.bits, c.mode, c.granularity, q.scales, q.zero_points, dtype
    )
    return flat.reshape(q.shape)


def dequantize(q: QuantizedTensor) -> np.ndarray:
    """Values ``(q - zp) * scale`` computed in float64, in ``q.shape`` and ``q.dtype``
    (float16 / bfloat16 are rounded once from the float64 result).

    Raises:
        TypeError: ``q`` is not a :class:`QuantizedTensor`.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    return _dequantize_as(q, q.dtype)


#: The slots ``QuantizedLinear`` fills itself: never taken from a pickled state.
_LINEAR_SLOTS = frozenset(("_bias", "_plan", "_weight_q"))
#: Its slots before ``_plan``, found in states pickled before ``__reduce__``.
_OLD_LINEAR_SLOTS = frozenset(("_native_head", "_native_tail"))


def _rebuild_linear(cls: type, weight_q: Any, bias: Any) -> QuantizedLinear:
    """Unpickle a :class:`QuantizedLinear` or a subclass of it: through the
    constructor's checks, whatever the subclass's own ``__init__`` takes."""
    if not (isinstance(cls, type) and issubclass(cls, QuantizedLinear)):
        raise TypeError(f"not a QuantizedLinear class: {cls!r}")
    layer = cls.__new__(cls)
    QuantizedLinear.__init__(layer, weight_q, bias)
    return layer


class QuantizedLinear:
    """A linear layer with a quantized weight (seed 001's ``QuantizedLinear``).

    ``forward(x) = x @ dequantize(W).T + bias`` in float32.

    Args:
        weight_q: a 2-D :class:`QuantizedTensor` of shape ``(out_features, in_features)``.
        bias: ``None`` or a float array of shape ``(out_features,)``.

    Raises:
        ShapeMismatchError: the weight is not 2-D or the bias does not match.
    """

    __slots__ = ("_bias", "_plan", "_weight_q")

    def __init__(self, weight_q: QuantizedTensor, bias: Optional[Any] = None) -> None:
        if not isinstance(weight_q, QuantizedTensor):
            raise TypeError(f"weight_q must be a QuantizedTensor, got {type(weight_q).__name__}")
        if len(weight_q.shape) != 2:
            raise ShapeMismatchError(
                f"weight_q: expected a 2-D (out_features, in_features) weight, "
                f"got shape {weight_q.shape}"
            )
        frozen_bias: Optional[np.ndarray] = None
        if bias is not None:
            b = float_input(bias, "bias")
            if b.shape != (weight_q.shape[0],):
                raise ShapeMismatchError(
                    f"bias: expected shape ({weight_q.shape[0]},), got {b.shape}"
                )
            frozen_bias = readonly(np.array(_finite_f32(b, "bias"), np.float32))
        # The kernel's arguments but ``x``, checked and prepared once (the tensor
        # and the bias are frozen): see ``forward``'s fast path.
        q, (out_f, in_f) = weight_q, weight_q.shape
        plan = _native.LinearPlan(
            q.data, q.config.bits, out_f, in_f, q.scales, q.zero_points, frozen_bias, q.dtype
        )
        # All three together, once everything above has passed: a failed call
        # leaves the layer as it was.
        self._weight_q, self._bias, self._plan = weight_q, frozen_bias, plan

    def __reduce__(self) -> Tuple[Any, ...]:
        # Pickled through the constructor, never as its slots: the layer is rebuilt
        # from the weight as the weight's own pickling restores it (buffers passed
        # out of band copied into private read-only arrays) and the bias as a
        # private read-only copy, and ``forward``'s prepared plan is rebuilt from
        # those. Pickled slots carried the cache as a plain tuple, pointing at the
        # caller's buffers after a protocol-5 load. A subclass keeps its class and
        # its own attributes (its ``__init__`` is not called).
        return (_rebuild_linear, (type(self), self._weight_q, self._bias), self._own_state())

    def _own_state(self) -> Optional[Dict[str, Any]]:
        """A subclass's own attributes (its ``__dict__`` and slots), or None."""
        state = dict(getattr(self, "__dict__", None) or {})
        for klass in type(self).__mro__:
            if klass is QuantizedLinear:
                break
            slots = klass.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{klass.__name__.lstrip('_')}{name}"  # a mangled private slot
                if hasattr(self, name):
                    state[name] = getattr(self, name)
        return state or None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            # Written before ``__reduce__``: object's default ``(dict or None, slots)``,
            # restored into a blank instance only (a built layer stays as it is).
            if (
                hasattr(self, "_plan")
                or len(state) != 2
                or not (state[0] is None or isinstance(state[0], dict))
                or not isinstance(state[1], dict)
                or "_weight_q" not in state[1]
            ):
                raise TypeError("QuantizedLinear: unrecognised pickled state")
            attrs = {**(state[0] or {}), **state[1]}
            QuantizedLinear.__init__(self, attrs.pop("_weight_q"), attrs.pop("_bias", None))
            for name in _LINEAR_SLOTS | _OLD_LINEAR_SLOTS:
                attrs.pop(name, None)
        elif (
            isinstance(state, dict) and not _LINEAR_SLOTS & state.keys() and hasattr(self, "_plan")
        ):
            attrs = state  # a subclass's own attributes, after _rebuild_linear
        else:
            raise TypeError("QuantizedLinear: unrecognised pickled state")
        for name, value in attrs.items():
            if not isinstance(name, str):
                raise TypeError("QuantizedLinear: unrecognised pickled state")
            try:
                setattr(self, name, value)
            except AttributeError as e:
                raise TypeError(f"QuantizedLinear: unrecognised pickled state ({e})") from None

    @classmethod
    def from_linear(
        cls,
        weight: Any,
        bias: Optional[Any] = None,
        config: QuantConfig = QuantConfig(),
    ) -> QuantizedLinear:
        """Quantize a float ``weight`` of shape ``(out_features, in_features)``.

        Raises:
            ShapeMismatchError: ``weight`` is not 2-D or ``bias`` does not match.
        """
        w = float_input(weight, "weight")
        if w.ndim != 2:
            raise ShapeMismatchError(
                f"weight: expected a 2-D (out_features, in_features) array, got shape {w.shape}"
            )
        try:
            weight_q = quantize(w, config)
        except QuantizationError as e:
            raise renamed(e, "x", "weight") from None
        return cls(weight_q, bias)

    @property
    def in_features(self) -> int:
        """Input features: ``weight.shape[1]``."""
        return int(self._weight_q.shape[1])

    @property
    def out_features(self) -> int:
        """Output features: ``weight.shape[0]``."""
        return int(self._weight_q.shape[0])

    @property
    def weight_quantized(self) -> QuantizedTensor:
        """The quantized weight."""
        return self._weight_q

    @property
    def bias(self) -> Optional[np.ndarray]:
        """The float32 bias, or None."""
        return self._bias

    def memory_savings_bytes(self) -> int:
        """``4 * numel - size_bytes()`` of the weight, as the seed counts it."""
        return 4 * self._weight_q.numel() - self._weight_q.size_bytes()

    def forward(self, x: Any) -> np.ndarray:
        """``x @ dequantize(W).T + bias`` for ``x`` of shape ``(..., in_features)``, float32.

        Fused: the weight is read at its quantized size and never dequantized whole. A
        few tokens take dot products that dequantize codes as they go; from 8 tokens on,
        panels of rows (up to 8 MiB of float32, at most a quarter of the weight) are
        dequantized exactly and multiplied by a blocked GEMM. Within float32 rounding of
        the unfused product, in a fixed order. A float16 or bfloat16 weight is used at
        the values :func:`dequantize` gives it (rounded to its dtype), so it always
        takes the panel path, in small panels for a few tokens: slower than a float32
        weight (about 10x at batch 1), still far faster than NumPy on the dequantized
        half-precision weight.

        Raises:
            ShapeMismatchError: ``x``'s last dimension is not ``in_features``.
            NonFiniteError: ``x`` holds NaN or an infinity (or a value beyond float32).
        """
        # The common call, a C-contiguous float32 token or batch, goes straight to
        # the kernel: the plan checks ``x`` itself and returns None for any other.
        # Between layers a model's weights evict the caches, and there each step
        # of the general path below costs microseconds of misses: 55-70 us in all
        # for a 4096-wide token after a 64 MiB copy (Zen 4), a tenth of an int4
        # 4096 x 4096 product; checking ``x`` here in Python still cost 15-20 us.
        out = self._plan(x)
        if out is not None:
            return out
        arr = float_input(x, "x")
        if arr.ndim == 0 or arr.shape[-1] != self.in_features:
            raise ShapeMismatchError(
                f"x: expected shape (..., {self.in_features}), got {arr.shape}"
            )
        # float64 / float16 / bfloat16 are converted value by value a block of tokens
        # at a time (beyond float32's range: inf, reported as non-finite).
        lead = arr.shape[:-1]
        tokens = math.prod(lead)
        out_f = self.out_features
        try:
            flat = self._plan.run(kernel_layout(arr).reshape(-1), tokens)
        except NonFiniteError as e:
            raise beyond_f32(e, arr, "x") from None
        try:
            return flat.reshape(*lead, out_f)
        except ValueError:  # no elements, but dims NumPy cannot multiply out
            raise ShapeMismatchError(
                f"x: the result's shape {(*lead, out_f)} is beyond what NumPy can hold"
            ) from None

    def __call__(self, x: Any) -> np.ndarray:
        """``self.forward(x)``, through the instance's class (a subclass's
        ``forward`` included)."""
        return self.forward(x)

    def __repr__(self) -> str:
        c = self._weight_q.config
        ratio = ratio_text(self._weight_q.compression_ratio(), 1)
        return (
            f"QuantizedLinear(in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={c.bits}, mode={c.mode!r}, granularity={c.granularity!r}, "
            f"bias={self._bias is not None}, ratio={ratio})"
        )


def _named(params: Any, config: Any) -> Iterable[Tuple[str, np.ndarray]]:
    """The entries of ``params`` as floating arrays, each checked (TypeError naming it)."""
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, got {type(params).__name__}")
    out = []
    for name, value in params.items():
        try:
            out.append((name, float_input(value, f"params[{name!r}]")))
        except (TypeError, ValueError) as e:
            raise TypeError(str(e) if "params[" in str(e) else f"params[{name!r}]: {e}") from None
    return out


def quantize_named_parameters(
    params: Mapping[str, Any],
    config: QuantConfig = QuantConfig(),
) -> Dict[str, QuantizedTensor]:
    """Quantize every entry of rank >= 2, in input order (seed 001).

    Raises:
        TypeError: ``params`` is not a mapping, an entry is not a floating array, or
            ``config`` is not a QuantConfig.
        NonFiniteError: an entry holds NaN or an infinity (the message names it).
    """
    out: Dict[str, QuantizedTensor] = {}
    for name, value in _named(params, config):
        if value.ndim >= 2:
            try:
                out[name] = quantize(value, config)
            except QuantizationError as e:
                raise renamed(e, "x", f"params[{name!r}]") from None
    return out


@dataclass(frozen=True)
class QuantStats(Record):
    """Seed 001's ``QuantStats``: what quantizing a model's parameters would save.

    ``compression_ratio`` is ``fp32_bytes / quantized_bytes`` in float64 (1.0 when
    nothing is held), as the seed computes it.
    """

    num_quantized: int
    num_fp32: int
    fp32_bytes: int
    quantized_bytes: int
    compression_ratio: float

    scheme: ClassVar[str] = "quant-stats"
    _params: ClassVar[Tuple[str, ...]] = (
        "num_quantized",
        "num_fp32",
        "fp32_bytes",
        "quantized_bytes",
        "compression_ratio",
    )

    def __post_init__(self) -> None:
        for name in self._params[:4]:
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} must be an integer, got {short_repr(v)}")
            if not 0 <= v < 2**64:
                raise InvalidConfigError(f"{name} must be in 0..2**64 - 1, got {v}")
            object.__setattr__(self, name, int(v))
        r = self.compression_ratio
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, (int, float, np.number)):
            raise TypeError(f"compression_ratio must be a number, got {short_repr(r)}")
        q = self.quantized_bytes
        want = float(self.fp32_bytes) / float(q) if q > 0 else 1.0
        if float(r) != want:
            raise InvalidConfigError(
                f"compression_ratio must be fp32_bytes / quantized_bytes = {want}, got {r}"
            )
        object.__setattr__(self, "compression_ratio", want)


def quantization_stats(
    params: Mapping[str, Any],
    config: QuantConfig = QuantConfig(),
) -> QuantStats:
    """The seed's accounting, without quantizing: every parameter counts 4 bytes an
    element in float32; one of rank >= 2 counts its code bytes (``numel`` or
    ``ceil(numel / 2)``) plus 16 bytes of metadata (``16 * shape[0]`` per channel),
    any other stays float32.
    """
    if not isinstance(config, QuantConfig):
        raise TypeError(f"config must be a QuantConfig, got {type(config).__name__}")
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a mapping of names to arrays, got {type(params).__name__}")
    shapes = []
    for name, value in params.items():  # only dtypes and shapes: no copy of any array
        try:
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        except ValueError as e:  # a ragged nested list
            raise TypeError(f"params[{name!r}] must be a floating array: {e}") from None
        if not is_float_dtype(arr.dtype):
            raise TypeError(
                f"params[{name!r}] must be a floating array (float32, float64, float16 or "
                f"bfloat16), got dtype {arr.dtype}"
            )
        shapes.append(list(arr.shape))
    stats = _native.quantization_stats(shapes, config.bits, config.mode, config.granularity)
    return QuantStats(*stats)
