"""Post-training int8 (SPEC §5, seed 004): per-layer weight ranges, symmetric
per-tensor int8 weights with one float32 scale a layer, and a model of them saved
as the seed's JSON.

``scale = max(scale or max|w| / 127, 1e-8)`` and codes ``clamp(round(w / scale),
-127, 127)``, in float32 as the seed; values ``code * scale``. The ``.json`` files are
written and read by the Rust crate's ``serde`` structs, so they are the bytes the
seed's ``serde_json::to_string_pretty`` writes (float32 values in their shortest
round-trip form: ``0.1``, not ``0.10000000149011612``), and files from the seed
load here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np

from . import _ferroquant as _native
from . import _format
from ._base import SOURCE_MAX, Quantized
from ._checks import (
    beyond_f32,
    describe,
    exact_int,
    float32_shape,
    float_input,
    held,
    is_array_of,
    readonly,
    round_f32,
    shape_tuple,
    short_repr,
    source_dtype,
    to_float32,
)
from .errors import FormatError, InvalidConfigError, NonFiniteError, ShapeMismatchError

__all__ = [
    "Calibrator",
    "LayerCalibration",
    "QuantizedModel",
    "QuantizedWeights",
    "quantize_model_weights",
]

#: The scheme name :func:`quantize_model_weights` records (the seed's).
SCHEME = "symmetric_per_tensor_int8"
#: The smallest scale (the seed's ``.max(1e-8)``, in float32).
MIN_SCALE = float(np.float32(1e-8))
#: The file name for the model inside a native (safetensors) file.
MODEL_ENTRY = "model"
_MAX_USIZE = 2**64 - 1


def _text(value: Any, arg: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidConfigError(f"{arg} is not valid UTF-8 text: {value[:60]!r}") from None
    return str(value)


def _f32(value: Any, arg: str, positive: bool = False) -> float:
    """``value`` rounded to float32, as a Python float; InvalidConfigError unless
    finite (and > 0 when ``positive``) in float32."""
    if isinstance(value, (bool, np.bool_, str, bytes, np.ndarray)):
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}")
    try:
        # Any real scalar: int, float, NumPy and ml_dtypes scalars. Rounded once,
        # natively: NumPy's float32() would flush a subnormal to 0 under a
        # caller's flush-to-zero.
        v = round_f32(value)
    except OverflowError:
        v = math.inf
    except Exception:  # not a number, or a broken __float__
        raise TypeError(f"{arg} must be a number, got {type(value).__name__}") from None
    if not math.isfinite(v):
        raise InvalidConfigError(f"{arg} must be finite in float32, got {short_repr(value)}")
    if positive and not v > 0:
        raise InvalidConfigError(f"{arg} must be > 0 in float32, got {short_repr(value)}")
    return v


def _count(value: Any, arg: str) -> int:
    n = exact_int(value, arg)
    if not 0 <= n <= _MAX_USIZE:
        raise InvalidConfigError(f"{arg} must be in 0..2**64-1, got {n}")
    return n


def _f32_ratio(num: int, den: int) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.float32(num) / np.float32(den))


def _check_bias(bias: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """A held, flat, finite bias of ``shape[0]`` values."""
    if not shape:
        raise ShapeMismatchError(f"bias: a 0-d weight takes no bias, got shape {bias.shape}")
    b = held(bias).reshape(-1)
    if b.size != shape[0]:
        raise ShapeMismatchError(
            f"bias: expected {shape[0]} values (shape[0] of {shape}), got shape {bias.shape}"
        )
    finite = np.isfinite(b)
    if not finite.all():
        i = int(np.argmin(finite))
        raise NonFiniteError(f"bias holds a non-finite value (NaN or ±inf) at flat index {i}", i)
    return b


@dataclass(frozen=True, eq=False, repr=False)
class LayerCalibration(Quantized):
    """Calibration data of one layer (seed 004's ``LayerCalibration``); floats are
    float32 values, finite.

    Attributes:
        name: the layer's name.
        w_min, w_max: the smallest and largest weight (``w_min <= w_max``).
        act_min, act_max: activation range, ``act_min <= act_max`` (:class:`Calibrator`
            records the seed's weight-only placeholders -1 and 1).
    """

    name: str
    w_min: float
    w_max: float
    act_min: float
    act_max: float

    scheme: ClassVar[str] = "ptq-calibration"
    _arrays: ClassVar[Tuple[str, ...]] = ()
    # No arrays: hashable, as a frozen dataclass is.
    __hash__ = Quantized._field_hash  # type: ignore[assignment]
    _params: ClassVar[Tuple[str, ...]] = ("name", "w_min", "w_max", "act_min", "act_max")

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _text(self.name, "name"))
        for f in ("w_min", "w_max", "act_min", "act_max"):
            object.__setattr__(self, f, _f32(getattr(self, f), f))
        # A range, as CalibStats' min/max: a file cannot carry an inverted one.
        for lo, hi in (("w_min", "w_max"), ("act_min", "act_max")):
            if getattr(self, lo) > getattr(self, hi):
                raise InvalidConfigError(
                    f"{lo} ({getattr(self, lo):g}) must not exceed {hi} ({getattr(self, hi):g})"
                )

    def weight_scale(self) -> float:
        """``max(|w_min|, |w_max|) / 127`` in float32."""
        # Both are float32 values; the quotient rounded once more to float32 is
        # float32's own division (a double rounding of a quotient is harmless).
        m = max(abs(self.w_min), abs(self.w_max))
        return _native.round_f32(m / 127.0)

    def compression_ratio(self) -> float:
        """1.0: a calibration record holds no weights."""
        return 1.0

    def __repr__(self) -> str:
        return (
            f"LayerCalibration(name={short_repr(self.name)}, w=[{self.w_min:g}, {self.w_max:g}], "
            f"act=[{self.act_min:g}, {self.act_max:g}])"
        )


def _check_reach(codes: np.ndarray, scale: float, dtype: str) -> None:
    """InvalidConfigError when the largest code is beyond what any finite ``dtype``
    weight quantizes to with ``scale``. The kernel's code is ``round(fl32(w /
    scale))`` (half away from zero), which grows with ``|w|``, so the largest code
    any weight gets is the one of the dtype's largest value: a larger one is
    hand-made or corrupt, and such a layer would dequantize to inf."""
    if not codes.size:
        return
    top = max(-int(codes.min()), int(codes.max()))
    with np.errstate(over="ignore"):  # a tiny scale: every code is in reach
        quotient = float(SOURCE_MAX[dtype] / np.float32(scale))
    if math.isinf(quotient):
        return
    reach = math.floor(quotient + 0.5)
    if top > reach:
        raise InvalidConfigError(
            f"scale: {scale:g} with code {top} stands for weights beyond {dtype}'s largest "
            f"value {float(SOURCE_MAX[dtype]):g}, which gives code {reach} at this scale"
        )


@dataclass(frozen=True, eq=False, repr=False)
class QuantizedWeights(Quantized):
    """One layer's int8 weights (seed 004's ``QuantizedWeights``; codes held as int8).

    Attributes:
        name: the layer's name.
        weights_i8: ``int8[n]`` codes in row-major order (any int8 array of ``n``
            elements is accepted and held flat).
        shape: the weight's shape; ``n`` is its product.
        scale: the float32 scale (finite and > 0, as ``from_f32`` makes it).
        bias: ``float32[shape[0]]`` or ``None``.
        dtype: the dtype the weight had (``from_f32`` records it; ``ferroquant
            dequantize`` restores it). Not one of the seed's fields: not compared by
            ``==`` and not in the seed's JSON (a layer read from ``.json`` says float32).
    """

    name: str
    weights_i8: np.ndarray
    shape: Tuple[int, ...]
    scale: float
    bias: Optional[np.ndarray] = None
    dtype: str = field(default="float32", compare=False)

    scheme: ClassVar[str] = "ptq-int8"
    _arrays: ClassVar[Tuple[str, ...]] = ("weights_i8", "bias")
    _optional: ClassVar[Tuple[str, ...]] = ("bias",)
    _params: ClassVar[Tuple[str, ...]] = ("name", "shape", "scale", "dtype")

    def __post_init__(self) -> None:
        name = _text(self.name, "name")
        shape = shape_tuple(self.shape, dtype=self.dtype, at_least=4)  # float32 values
        w = self.weights_i8
        if not is_array_of(w, np.int8):
            raise TypeError(f"weights_i8 must be an int8 array, got {describe(w)}")
        n = math.prod(shape)
        if w.size != n:
            raise ShapeMismatchError(
                f"weights_i8: expected {n} values for shape {shape}, got shape {w.shape}"
            )
        scale = _f32(self.scale, "scale", positive=True)
        dtype = source_dtype(self.dtype)
        _check_reach(w, scale, dtype)
        bias = self.bias
        if bias is not None:
            if not is_array_of(bias, np.float32):
                raise TypeError(f"bias must be a float32 array or None, got {describe(bias)}")
            bias = _check_bias(bias, shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "weights_i8", held(w).reshape(-1))
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "bias", bias)

    @classmethod
    def from_f32(
        cls,
        name: str,
        w: Any,
        shape: Any = None,
        bias: Any = None,
        scale: Optional[float] = None,
    ) -> QuantizedWeights:
        """Quantize ``w`` (seed 004's ``from_f32``).

        Args:
            name: the layer's name.
            w: a floating array (float32/float64/float16/bfloat16, read as float32).
            shape: the weight's shape (default ``w.shape``); ``w`` must hold its
                element count, in row-major order.
            bias: a floating array of ``shape[0]`` values (stored as float32), or None.
            scale: the scale to use (finite and > 0), or None for ``max|w| / 127``;
                at least 1e-8 either way.

        Raises:
            TypeError: ``w`` or ``bias`` is not a floating array.
            InvalidConfigError: ``scale`` is not finite and positive.
            ShapeMismatchError: ``w`` does not hold ``shape``'s elements, or ``bias``
                does not hold ``shape[0]`` values.
            NonFiniteError: ``w`` (or ``bias``) holds NaN or an infinity.
        """
        name = _text(name, "name")
        arr = float_input(w, "w")
        dims = arr.shape if shape is None else shape_tuple(shape)
        float32_shape(dims, "w")
        if math.prod(dims) != arr.size:
            raise ShapeMismatchError(
                f"w: expected {math.prod(dims)} values for shape {dims}, got shape {arr.shape}"
            )
        s = None if scale is None else _f32(scale, "scale", positive=True)
        b = None
        if bias is not None:
            given = float_input(bias, "bias")
            try:
                b = _check_bias(to_float32(given), dims)
            except NonFiniteError as e:
                raise beyond_f32(e, given) from None
        try:
            codes, s_used = _native.ptq_quantize(arr, s)
        except NonFiniteError as e:
            raise beyond_f32(e, arr) from None
        return cls._trusted(
            name=name,
            weights_i8=readonly(codes),
            shape=dims,
            scale=float(s_used),
            bias=b,
            dtype=source_dtype(arr.dtype),
        )

    @property
    def label(self) -> str:
        """``ptq-int8``."""
        return "ptq-int8"

    @property
    def bits(self) -> int:
        """Bits per code: 8."""
        return 8

    def numel(self) -> int:
        """Number of weights."""
        return int(self.weights_i8.size)

    def values(self) -> np.ndarray:
        """The codes in ``shape`` (a read-only view)."""
        return self.weights_i8.reshape(self.shape)

    def dequantize(self) -> np.ndarray:
        """float32 ``code * scale`` in ``shape``."""
        n = self.numel()
        flat = _native.dequantize_groups(
            self.weights_i8, n, n, np.array([self.scale], np.float32), False
        )
        return flat.reshape(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held: the codes, the float32 scale (a field, not an array) and the bias."""
        return super().nbytes + 4

    def size_bytes(self) -> int:
        """Bytes of the codes (the seed's count: one a weight; the bias is not counted)."""
        return self.numel()

    def original_size_bytes(self) -> int:
        """Bytes of the float32 weights: 4 a weight."""
        return 4 * self.numel()

    def compression_ratio(self) -> float:
        """``original_size_bytes / size_bytes`` in float32 (NaN with no weights, as the seed)."""
        return _f32_ratio(self.original_size_bytes(), self.size_bytes())

    def _repr_fields(self) -> str:
        src = "" if self.dtype == "float32" else f", dtype={self.dtype}"
        name = short_repr(self.name)
        return f"name={name}, scale={self.scale:g}, bias={self.bias is not None}{src}"


class Calibrator:
    """Records each layer's weight range (seed 004's ``Calibrator``)."""

    def __init__(self) -> None:
        self._layers: List[LayerCalibration] = []

    def record_layer(self, name: str, w: Any) -> None:
        """Record layer ``name``: the exact min and max of ``w`` read as float32, in one
        pass with the non-finite check (activations: the seed's placeholders -1, 1).

        Raises:
            TypeError: ``w`` is not a floating array.
            EmptyInputError: ``w`` is empty (the seed would record +inf and -inf).
            NonFiniteError: ``w`` holds NaN or an infinity.
        """
        name = _text(name, "name")
        arr = float_input(w, "w")
        try:
            w_min, w_max = _native.ptq_range(arr)
        except NonFiniteError as e:
            raise beyond_f32(e, arr) from None
        self._layers.append(
            LayerCalibration._trusted(
                name=name, w_min=float(w_min), w_max=float(w_max), act_min=-1.0, act_max=1.0
            )
        )

    def finish(self) -> List[LayerCalibration]:
        """The recorded layers, in order."""
        return list(self._layers)

    def __repr__(self) -> str:
        return f"Calibrator({len(self._layers)} layers)"


def _is_json_path(path: Any) -> bool:
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    return p.lower().endswith(".json")


@dataclass(frozen=True, eq=False, repr=False)
class QuantizedModel(Quantized):
    """A model's int8 layers (seed 004's ``QuantizedModel``).

    Attributes:
        config_json: the model configuration, as JSON text.
        layers: tuple of :class:`QuantizedWeights` (a list is accepted).
        scheme: the scheme name (``"symmetric_per_tensor_int8"`` from
            :func:`quantize_model_weights`).
        total_quantized_bytes, total_fp32_bytes: the layers' byte totals.
    """

    config_json: str
    layers: Tuple[QuantizedWeights, ...]
    scheme: str  # type: ignore[misc]  # the seed's field; the file tag is _tag
    total_quantized_bytes: int
    total_fp32_bytes: int

    _tag: ClassVar[Optional[str]] = "ptq-model"
    _arrays: ClassVar[Tuple[str, ...]] = ()
    _roles: ClassVar[Tuple[str, ...]] = ("weights_i8", "biases")
    _params: ClassVar[Tuple[str, ...]] = (
        "config_json",
        "model_scheme",
        "total_quantized_bytes",
        "total_fp32_bytes",
        "layers",
    )

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, (tuple, list)):
            raise TypeError(
                f"layers must be a tuple of QuantizedWeights, got {type(layers).__name__}"
            )
        for i, layer in enumerate(layers):
            if not isinstance(layer, QuantizedWeights):
                raise TypeError(
                    f"layers[{i}] must be a QuantizedWeights, got {type(layer).__name__}"
                )
        object.__setattr__(self, "config_json", _text(self.config_json, "config_json"))
        object.__setattr__(self, "layers", tuple(layers))
        object.__setattr__(self, "scheme", _text(self.scheme, "scheme"))
        for f in ("total_quantized_bytes", "total_fp32_bytes"):
            object.__setattr__(self, f, _count(getattr(self, f), f))

    @property
    def label(self) -> str:
        """``ptq-int8``."""
        return "ptq-int8"

    @property
    def nbytes(self) -> int:
        """Bytes held by every layer's codes, scales and biases."""
        return sum(layer.nbytes for layer in self.layers)

    def compression_ratio(self) -> float:
        """``total_fp32_bytes / max(total_quantized_bytes, 1)`` in float32."""
        return _f32_ratio(self.total_fp32_bytes, max(self.total_quantized_bytes, 1))

    def __repr__(self) -> str:
        return (
            f"QuantizedModel({len(self.layers)} layers, scheme={self.scheme!r}, "
            f"ratio={self.compression_ratio():.2f}x)"
        )

    # -- the seed's JSON -------------------------------------------------------------

    def _json_args(self) -> Tuple[Any, ...]:
        layers = [(q.name, q.weights_i8, list(q.shape), q.scale, q.bias) for q in self.layers]
        return (
            self.config_json,
            layers,
            self.scheme,
            self.total_quantized_bytes,
            self.total_fp32_bytes,
        )

    def to_json(self) -> str:
        """The seed's ``serde_json::to_string_pretty`` text of this model."""
        data = _native.ptq_write_json(None, *self._json_args())
        assert data is not None  # no path: the bytes are returned
        return data.decode("utf-8")

    @classmethod
    def from_json(cls, data: Any) -> QuantizedModel:
        """Parse the seed's JSON (``str`` or ``bytes``).

        Raises:
            FormatError: malformed JSON; a missing, unknown or duplicate field (a
                layer's ``bias`` may be left out: serde reads a missing ``Option`` as
                ``null``, so this matches the seed); a value of the wrong type (a
                ``weights_i8`` value outside -128..127 included); counts that do not
                match ``shape``; non-finite floats.
        """
        if isinstance(data, str):
            try:
                data = data.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError("JSON text is not valid UTF-8") from None
        if isinstance(data, (bytearray, memoryview)):
            data = bytes(data)
        if not isinstance(data, bytes):
            raise TypeError(f"data must be str or bytes, got {type(data).__name__}")
        config_json, scheme, tq, tf, parts = _native.ptq_read_json(data)
        try:
            layers = tuple(
                QuantizedWeights(name, readonly(codes), tuple(shape), scale, _ro(bias))
                for name, codes, shape, scale, bias in parts
            )
            return cls(config_json, layers, scheme, tq, tf)
        except (ValueError, TypeError) as e:
            raise FormatError(f"inconsistent JSON model: {e}") from None

    def save(self, path: Any) -> None:
        """Write the model: a path ending in ``.json`` gets the seed's JSON bytes, any
        other path ferroquant's safetensors format (SPEC §6). The file is written
        beside ``path`` and renamed into place."""
        if _is_json_path(path):
            args = self._json_args()

            def write(tmp: str) -> None:
                _native.ptq_write_json(tmp, *args)

            _format.write_file(path, write)
        else:
            from .serialization import save

            save(path, {MODEL_ENTRY: self})

    @classmethod
    def load(cls, path: Any) -> QuantizedModel:
        """Read a model :meth:`save` wrote (or, for ``.json``, the Rust seed).

        Raises:
            FileNotFoundError / PermissionError / IsADirectoryError: as ``open`` would;
                ``OSError`` (EINVAL) for a path that is not a regular file (a pipe).
            FormatError: the file is malformed or holds something else.
        """
        if _is_json_path(path):
            from ._format import open_regular

            # A regular file only: a FIFO would wait for a writer, /dev/zero never end.
            with open_regular(os.fspath(path)) as f:
                data = f.read()
            try:
                return cls.from_json(data)
            except FormatError as e:
                raise FormatError(f"{os.fspath(path)!s}: {e}") from None
        from .serialization import load

        values = load(path)
        models = [v for v in values.values() if isinstance(v, cls)]
        if len(values) != 1 or len(models) != 1:
            raise FormatError(
                f"{os.fspath(path)!s}: expected one QuantizedModel, found {sorted(values)[:5]}"
            )
        return models[0]

    # -- ferroquant's own format -------------------------------------------------------

    def _record(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        codes = [q.weights_i8 for q in self.layers]
        biases = [q.bias for q in self.layers if q.bias is not None]
        arrays = {
            "weights_i8": np.concatenate(codes) if codes else np.empty(0, np.int8),
            "biases": np.concatenate(biases) if biases else np.empty(0, np.float32),
        }
        layers = [
            {
                "name": q.name,
                "shape": list(q.shape),
                "scale": q.scale,
                "bias": q.bias is not None,
                "dtype": q.dtype,
            }
            for q in self.layers
        ]
        params = {
            "config_json": self.config_json,
            "model_scheme": self.scheme,
            "total_quantized_bytes": self.total_quantized_bytes,
            "total_fp32_bytes": self.total_fp32_bytes,
            "layers": layers,
        }
        return arrays, params

    @classmethod
    def _from_record(
        cls, arrays: Mapping[str, np.ndarray], params: Mapping[str, Any]
    ) -> QuantizedModel:
        try:
            return cls._from_parts(arrays, params)
        except MemoryError:
            raise
        except Exception as e:  # untrusted input: whatever is refused is a FormatError
            raise _format.as_format_error("ptq-model", e) from None

    @classmethod
    def _from_parts(
        cls, arrays: Mapping[str, np.ndarray], params: Mapping[str, Any]
    ) -> QuantizedModel:
        codes, biases = arrays["weights_i8"], arrays["biases"]
        if not is_array_of(codes, np.int8) or codes.ndim != 1:
            raise ValueError(f"weights_i8 must be a 1-D int8 array, got {describe(codes)}")
        if not is_array_of(biases, np.float32) or biases.ndim != 1:
            raise ValueError(f"biases must be a 1-D float32 array, got {describe(biases)}")
        specs = params["layers"]
        if not isinstance(specs, list):
            raise ValueError(f"layers must be a list, got {type(specs).__name__}")
        layers = []
        at = bat = 0
        for i, spec in enumerate(specs):
            if not isinstance(spec, dict) or set(spec) != _LAYER_KEYS:
                raise ValueError(f"layers[{i}] must be an object with {sorted(_LAYER_KEYS)}")
            shape = shape_tuple(spec["shape"], f"layers[{i}].shape")
            n = math.prod(shape)
            has_bias = spec["bias"]
            if not isinstance(has_bias, bool):
                raise ValueError(f"layers[{i}].bias must be true or false")
            nb = (shape[0] if shape else 0) if has_bias else 0
            if at + n > codes.size or bat + nb > biases.size:
                raise ValueError(f"layers[{i}] runs past the stored arrays")
            bias = biases[bat : bat + nb] if has_bias else None
            codes_i = codes[at : at + n]
            layers.append(
                QuantizedWeights(spec["name"], codes_i, shape, spec["scale"], bias, spec["dtype"])
            )
            at, bat = at + n, bat + nb
        if at != codes.size or bat != biases.size:
            raise ValueError("the stored arrays hold more values than the layers describe")
        return cls(
            params["config_json"],
            tuple(layers),
            params["model_scheme"],
            params["total_quantized_bytes"],
            params["total_fp32_bytes"],
        )


#: The keys of a layer in a native QuantizedModel entry.
_LAYER_KEYS = frozenset({"name", "shape", "scale", "bias", "dtype"})


def _ro(arr: Optional[np.ndarray]) -> Optional[np.ndarray]:
    return None if arr is None else readonly(arr)


def quantize_model_weights(config_json: str, layers: Iterable[Any]) -> QuantizedModel:
    """Quantize ``(name, weights, shape, bias)`` layers into a model with the seed's
    scheme name and byte totals (seed 004's ``quantize_model_weights``). ``layers`` is
    consumed once, one layer at a time; ``shape`` may be None (``weights.shape``).

    Raises:
        TypeError: a layer is not a 4-tuple, or as :meth:`QuantizedWeights.from_f32`.
        the errors of :meth:`QuantizedWeights.from_f32` for the first bad layer.
    """
    config = _text(config_json, "config_json")
    try:
        layers = iter(layers)
    except TypeError:
        raise TypeError(
            f"layers must be an iterable of (name, weights, shape, bias) tuples, got "
            f"{type(layers).__name__}"
        ) from None
    out = []
    total_fp32 = total_q = 0
    for i, layer in enumerate(layers):
        if not isinstance(layer, (tuple, list)) or len(layer) != 4:
            raise TypeError(f"layers[{i}] must be a (name, weights, shape, bias) tuple")
        name, weights, shape, bias = layer
        qw = QuantizedWeights.from_f32(name, weights, shape, bias)
        total_fp32 += qw.original_size_bytes()
        total_q += qw.size_bytes()
        out.append(qw)
    return QuantizedModel._trusted(
        config_json=config,
        layers=tuple(out),
        scheme=SCHEME,
        total_quantized_bytes=total_q,
        total_fp32_bytes=total_fp32,
    )
