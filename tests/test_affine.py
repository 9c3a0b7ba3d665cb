"""SPEC §2 (affine int8 / int4, seed 001): bit-exact against the NumPy port of
the seed, and the family's own semantics: configs, packing, empty inputs,
QuantizedTensor, QuantizedLinear, named parameters and stats."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ferroquant as fq
from ferroquant import _reference as ref

CONFIGS = [
    fq.QuantConfig(bits, mode, gran)
    for bits in (8, 4)
    for mode in ("symmetric", "asymmetric")
    for gran in ("per_tensor", "per_channel")
]
CONFIG_IDS = [c.name for c in CONFIGS]


def assert_matches_reference(x: np.ndarray, config: fq.QuantConfig) -> fq.QuantizedTensor:
    q = fq.quantize(x, config)
    data, scales, zps = ref.quantize_affine(x, config.bits, config.mode, config.granularity)
    assert q.data.dtype == data.dtype and q.data.tobytes() == data.tobytes()
    assert q.scales.tobytes() == scales.tobytes()
    assert q.zero_points.tobytes() == zps.tobytes()
    y = q.dequantize()
    want = ref.dequantize_affine(
        data, scales, zps, np.shape(x), config.bits, config.granularity, q.dtype
    )
    assert y.dtype == want.dtype == x.dtype and y.shape == np.shape(x)
    assert y.tobytes() == want.tobytes()
    assert np.array_equal(q.values(), ref.unpack_int4(data, x.size) if config.bits == 4 else data)
    return q


shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=24)
config_st = st.sampled_from(CONFIGS)


@given(
    hnp.arrays(
        np.float32, shapes, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
    ),
    config_st,
)
def test_f32_matches_the_seed_over_the_full_range(x, config):
    assert_matches_reference(x, config)


@given(
    hnp.arrays(
        np.float64,
        shapes,
        elements=st.floats(-1e300, 1e300, allow_nan=False, allow_subnormal=True),
    ),
    config_st,
)
def test_f64_matches_the_seed(x, config):
    assert_matches_reference(x, config)


@given(
    hnp.arrays(
        np.float16, shapes, elements=st.floats(width=16, allow_nan=False, allow_infinity=False)
    ),
    config_st,
)
def test_f16_matches_the_seed_and_dequantizes_to_f16(x, config):
    assert_matches_reference(x, config)


@given(st.integers(0, 2**32 - 1), st.integers(1, 300), config_st)
def test_tie_heavy_inputs_match_the_seed(seed, n, config):
    rng = np.random.default_rng(seed)
    qmax = 127 if config.bits == 8 else 7
    # Values on a half-integer grid of the scale: v * inv + zp lands on .5 ties.
    x = (rng.integers(-2 * qmax, 2 * qmax + 1, n) / 2).astype(np.float64)
    x[0] = qmax
    assert_matches_reference(x, config)
    assert_matches_reference(x.astype(np.float32).reshape(1, -1), config)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_bfloat16_input_matches_the_seed_on_its_values(config, rng):
    x = (rng.standard_normal((33, 17)) * 5).astype(ml_dtypes.bfloat16)
    assert_matches_reference(x, config)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize(
    "values",
    [
        [1e308, -1e308, 0.0],  # the range overflows f64: the seed's scale is inf
        [1e-29, -5e-30],  # scale below 1e-30: inv = 0, every code 0
        [5e-324, -5e-324, 0.0],  # subnormals
        [3.0, 3.0, 3.0],  # a zero range
        [-0.0, 0.0],
        [1e300, 1e300 + 1e284],  # a zero point far out of range
    ],
)
def test_adversarial_values_match_the_seed(config, values):
    with np.errstate(all="ignore"):
        assert_matches_reference(np.array(values, np.float64), config)


def test_seed_example_and_ties_round_away_from_zero():
    x = np.array([[1.0, -0.5, 0.25], [-1.0, 0.0, 0.75]], np.float32)
    q = fq.quantize(x)
    assert q.scales.tolist() == [1 / 127] and q.zero_points.tolist() == [0.0]
    assert q.data.tolist() == [127, -64, 32, -127, 0, 95]
    assert np.abs(q.dequantize() - x).max() < 0.02
    t = fq.quantize(np.array([127, 0.5, -0.5, 1.5, -2.5], np.float32))
    assert t.data.tolist() == [127, 1, -1, 2, -3]


def test_int4_packing_is_the_onnx_order():
    x = np.array([-7, 1, 2, -3, 7], np.float32)
    q = fq.quantize(x, fq.QuantConfig.int4())
    assert q.scales.tolist() == [1.0]
    assert q.data.dtype == np.uint8 and q.data.tolist() == [0x19, 0xD2, 0x07]
    assert q.values().tolist() == [-7, 1, 2, -3, 7]
    assert q.size_bytes() == 3 and q.numel() == 5
    assert q.compression_ratio() == 20 / 3


def test_empty_inputs_follow_the_spec():
    q = fq.quantize(np.zeros(0, np.float32))
    assert q.scales.tolist() == [1.0] and q.zero_points.tolist() == [0.0] and q.data.size == 0
    q = fq.quantize(np.zeros((0, 4), np.float32), fq.QuantConfig.int8_per_channel())
    assert q.scales.shape == (0,)
    q = fq.quantize(np.zeros((3, 0), np.float32), fq.QuantConfig.int4_per_channel().asymmetric())
    assert q.scales.tolist() == [1.0] * 3 and q.zero_points.tolist() == [0.0] * 3
    assert q.dequantize().shape == (3, 0)
    q = fq.quantize(np.array(2.5, np.float32), fq.QuantConfig.int8_per_channel())
    assert q.scales.tolist() == [2.5 / 127] and q.data.tolist() == [127]


def test_config_constructors_and_table():
    assert fq.QuantConfig() == fq.QuantConfig.int8() == fq.QuantConfig(8, "symmetric", "per_tensor")
    c = fq.QuantConfig.int4_per_channel()
    a = c.asymmetric()
    assert a is not c and c.mode == "symmetric" and a.mode == "asymmetric"
    table = {cfg.name: (cfg.qmin, cfg.qmax) for cfg in CONFIGS}
    assert table["int8"] == (-127, 127) and table["int8-asym"] == (-128, 127)
    assert table["int4-per-channel"] == (-7, 7) and table["int4-per-channel-asym"] == (-8, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.bits = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs",
    [{"bits": 16}, {"bits": True}, {"bits": 8.0}, {"mode": "sym"}, {"granularity": "per_row"}],
)
def test_bad_configs_raise_invalid_config(kwargs):
    with pytest.raises(fq.InvalidConfigError):
        fq.QuantConfig(**kwargs)


def test_quantize_wants_a_config():
    with pytest.raises(TypeError, match="config"):
        fq.quantize(np.ones(3, np.float32), "int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="QuantizedTensor"):
        fq.dequantize(np.ones(3))  # type: ignore[arg-type]


def test_quantized_tensor_accounting_and_repr(rng):
    x = rng.standard_normal((10, 7)).astype(np.float32)
    q = fq.quantize(x, fq.QuantConfig.int4_per_channel())
    assert q.numel() == 70 and q.size_bytes() == 35 and q.compression_ratio() == 8.0
    # The seed's f64 `fp32_bytes / size_bytes` of an empty tensor is 0 / 0.
    for config in (fq.QuantConfig.int8(), fq.QuantConfig.int4_per_channel()):
        empty = fq.quantize(np.zeros((0, 3), np.float32), config)
        assert empty.size_bytes() == 0 and np.isnan(empty.compression_ratio())
        # The repr says so instead of printing the NaN.
        assert repr(empty).endswith(", ratio=n/a)"), repr(empty)
        layer = fq.QuantizedLinear.from_linear(np.zeros((0, 3), np.float32), None, config)
        assert repr(layer).endswith(", bias=False, ratio=n/a)"), repr(layer)
    assert q.nbytes == 35 + 8 * 10 + 8 * 10
    assert repr(q) == (
        "QuantizedTensor(shape=(10, 7), scheme='int4-per-channel', dtype=float32, ratio=8.00x)"
    )


def _valid():
    return fq.quantize(np.arange(5, dtype=np.float32), fq.QuantConfig.int4().asymmetric())


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"data": np.zeros(3, np.int8)}, TypeError, "uint8"),
        ({"data": np.zeros(2, np.uint8)}, fq.ShapeMismatchError, "data"),
        ({"scales": np.ones(2)}, fq.ShapeMismatchError, "scales"),
        ({"scales": np.ones(1, np.float32)}, TypeError, "float64"),
        ({"scales": np.array([np.nan])}, fq.InvalidConfigError, "scales"),
        ({"scales": np.array([0.0])}, fq.InvalidConfigError, "scales"),
        ({"zero_points": np.array([0.5])}, fq.InvalidConfigError, "zero_points"),
        ({"zero_points": np.array([np.inf])}, fq.InvalidConfigError, "zero_points"),
        ({"data": np.array([0, 0, 0x10], np.uint8)}, fq.InvalidConfigError, "nibble"),
        ({"shape": (2, 2.5)}, TypeError, "shape"),
        ({"dtype": "int8"}, fq.InvalidConfigError, "dtype"),
        ({"config": "int4"}, TypeError, "config"),
    ],
)
def test_constructor_validates(change, exc, match):
    q = _valid()
    fields = {f.name: getattr(q, f.name) for f in dataclasses.fields(q)}
    fields.update(change)
    with pytest.raises(exc, match=match):
        fq.QuantizedTensor(**fields)


def test_constructor_checks_code_ranges():
    sym = fq.quantize(np.arange(4, dtype=np.float32), fq.QuantConfig.int4())
    fields = {f.name: getattr(sym, f.name) for f in dataclasses.fields(sym)}
    fields["data"] = np.array([0x08, 0x00], np.uint8)  # -8 is outside -7..7
    with pytest.raises(fq.InvalidConfigError, match=r"-7\.\.7"):
        fq.QuantizedTensor(**fields)
    fields = {f.name: getattr(sym, f.name) for f in dataclasses.fields(sym)}
    fields["zero_points"] = np.array([1.0])
    with pytest.raises(fq.InvalidConfigError, match="symmetric"):
        fq.QuantizedTensor(**fields)
    i8 = fq.quantize(np.arange(4, dtype=np.float32))
    fields = {f.name: getattr(i8, f.name) for f in dataclasses.fields(i8)}
    fields["data"] = np.array([-128, 0, 0, 0], np.int8)
    with pytest.raises(fq.InvalidConfigError, match=r"-127\.\.127"):
        fq.QuantizedTensor(**fields)


def test_quantized_linear_forward_matches_numpy(rng):
    w = rng.standard_normal((24, 40)).astype(np.float32)
    b = rng.standard_normal(24).astype(np.float32)
    x = rng.standard_normal((3, 5, 40)).astype(np.float32)
    for config in CONFIGS:
        layer = fq.QuantizedLinear.from_linear(w, b, config)
        assert (layer.in_features, layer.out_features) == (40, 24)
        assert layer.weight_quantized == fq.quantize(w, config)
        deq = fq.dequantize(layer.weight_quantized).astype(np.float32)
        want = x @ deq.T + b
        got = layer.forward(x)
        assert got.dtype == np.float32 and got.shape == (3, 5, 24)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert layer.memory_savings_bytes() == 4 * 960 - layer.weight_quantized.size_bytes()
    plain = fq.QuantizedLinear(fq.quantize(w))
    assert plain.bias is None
    np.testing.assert_allclose(plain(x[0]), x[0] @ fq.dequantize(fq.quantize(w)).T, rtol=1e-5)


def test_quantized_linear_shape_errors(rng):
    w = rng.standard_normal((4, 6)).astype(np.float32)
    with pytest.raises(fq.ShapeMismatchError, match="weight"):
        fq.QuantizedLinear.from_linear(w[0])
    with pytest.raises(fq.ShapeMismatchError, match="bias"):
        fq.QuantizedLinear.from_linear(w, np.zeros(5, np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="weight_q"):
        fq.QuantizedLinear(fq.quantize(np.zeros((2, 3, 4), np.float32)))
    layer = fq.QuantizedLinear.from_linear(w)
    for bad in (np.zeros((2, 5), np.float32), np.zeros(7, np.float32), np.float32(1.0)):
        with pytest.raises(fq.ShapeMismatchError, match="x"):
            layer.forward(bad)


def test_named_parameters_and_stats_follow_the_seed():
    params = {
        "embed.weight": np.ones((10, 4), np.float32),
        "layer.bias": np.ones(4, np.float32),
        "layer.weight": np.ones((4, 4), np.float32),
        "scalar": np.float32(2.0),
    }
    out = fq.quantize_named_parameters(params, fq.QuantConfig.int4())
    assert list(out) == ["embed.weight", "layer.weight"]
    assert out["layer.weight"] == fq.quantize(params["layer.weight"], fq.QuantConfig.int4())
    s = fq.quantization_stats(params, fq.QuantConfig.int8_per_channel())
    assert (s.num_quantized, s.num_fp32) == (2, 2)
    assert s.fp32_bytes == 4 * (40 + 4 + 16 + 1)
    assert s.quantized_bytes == (40 + 16 * 10) + (16 + 16 * 4) + 16 + 4
    assert s.compression_ratio == s.fp32_bytes / s.quantized_bytes
    s4 = fq.quantization_stats({"w": np.ones((3, 3))}, fq.QuantConfig.int4())
    assert s4.quantized_bytes == 5 + 16
    assert fq.quantization_stats({}).compression_ratio == 1.0


def test_registry_names_build_the_right_configs():
    for config in CONFIGS:
        q = fq.get_quantizer(config.name)
        assert q.name == config.name and q.kind == "weight"
        x = np.linspace(-3, 5, 40, dtype=np.float32).reshape(4, 10)
        assert q.quantize(x) == fq.quantize(x, config)
        np.testing.assert_array_equal(
            q.dequantize(q.quantize(x)), fq.quantize(x, config).dequantize()
        )
        assert q.fits((4, 10), np.dtype(np.float32)) is None
        assert q.fits((4, 10), np.dtype(np.int32)) is not None


def test_hostile_affine_entries_are_format_errors():
    import json

    good = fq.quantize(np.arange(5, dtype=np.float32), fq.QuantConfig.int4_per_channel())
    blob = fq.save_bytes({"w": good})
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    body = blob[8 + n :]

    def with_entry(patch):
        h = json.loads(json.dumps(header))
        e = json.loads(h["__metadata__"]["ferroquant:w"])
        e.update(patch)
        h["__metadata__"]["ferroquant:w"] = json.dumps(e)
        text = json.dumps(h).encode()
        return len(text).to_bytes(8, "little") + text + body

    assert fq.load_bytes(with_entry({}))["w"] == good
    for patch in (
        {"config": {"bits": 8, "mode": "symmetric", "granularity": "per_channel"}},
        {"config": {"bits": 4, "mode": "symmetric"}},
        {"config": {"bits": 3, "mode": "symmetric", "granularity": "per_channel"}},
        {"config": "int4"},
        {"shape": [6]},
        {"shape": [1, 5]},
        {"dtype": "int4"},
    ):
        with pytest.raises(fq.FormatError):
            fq.load_bytes(with_entry(patch))
