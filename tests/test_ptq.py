"""SPEC §5: post-training int8 — LayerCalibration, QuantizedWeights, Calibrator,
quantize_model_weights, QuantizedModel and the seed's JSON."""

from __future__ import annotations

import copy
import json
import pickle
import threading

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ferroquant as fq
from ferroquant import _reference as ref
from ferroquant._format import ENTRY_PREFIX

F32 = np.float32

# The seed's sample model (its test_save_load_roundtrip), as serde_json's
# to_string_pretty prints it: two-space indent, ryu's float text, no newline.
SEED_JSON = """{
  "config_json": "{}",
  "layers": [
    {
      "name": "l1",
      "weights_i8": [
        1,
        -2,
        3
      ],
      "shape": [
        1,
        3
      ],
      "scale": 0.01,
      "bias": null
    }
  ],
  "scheme": "symmetric_per_tensor_int8",
  "total_quantized_bytes": 3,
  "total_fp32_bytes": 12
}"""


def seed_model() -> fq.QuantizedModel:
    layer = fq.QuantizedWeights("l1", np.array([1, -2, 3], np.int8), (1, 3), 0.01)
    return fq.QuantizedModel("{}", [layer], "symmetric_per_tensor_int8", 3, 12)


# -- the seed's own unit tests ---------------------------------------------------------


def test_seed_quantize_roundtrip():
    w = (np.arange(100, dtype=F32) * F32(0.01) - F32(0.5)).astype(F32)
    qw = fq.QuantizedWeights.from_f32("test", w, (10, 10))
    dq = qw.dequantize()
    assert dq.shape == (10, 10) and dq.dtype == np.float32
    assert np.abs(dq.reshape(-1) - w).max() <= qw.scale / 2 + 1e-6


def test_seed_compression_ratio():
    qw = fq.QuantizedWeights.from_f32("test", np.ones(1024, F32), (32, 32))
    assert qw.compression_ratio() == 4.0
    assert (qw.size_bytes(), qw.original_size_bytes()) == (1024, 4096)


def test_seed_save_load_roundtrip(tmp_path):
    path = tmp_path / "m.json"
    seed_model().save(path)
    loaded = fq.QuantizedModel.load(path)
    assert loaded.layers[0].name == "l1"
    assert loaded.layers[0].weights_i8.tolist() == [1, -2, 3]
    assert loaded == seed_model()


# -- the JSON format ---------------------------------------------------------------------


def test_json_is_the_seeds_bytes(tmp_path):
    assert seed_model().to_json() == SEED_JSON
    seed_model().save(tmp_path / "m.json")
    assert (tmp_path / "m.json").read_bytes() == SEED_JSON.encode()
    assert fq.QuantizedModel.from_json(SEED_JSON) == seed_model()


def test_json_floats_are_float32_shortest_text():
    # Python's repr of these float32 values is long (0.10000000149011612); ryu's is not.
    layer = fq.QuantizedWeights(
        "a", np.zeros(2, np.int8), (2, 1), 0.1, np.array([-0.0, 3.4028235e38], F32)
    )
    text = fq.QuantizedModel("{}", (layer,), "s", 2, 8).to_json()
    assert '"scale": 0.1,' in text
    assert "-0.0," in text and "3.4028235e38" in text
    assert json.loads(text)["layers"][0]["bias"] == [-0.0, 3.4028235e38]


def test_json_escapes_config_text_as_serde_does():
    config = 'name "é"\u2028\t\x01'
    text = fq.QuantizedModel(config, (), "s", 0, 0).to_json()
    # serde_json escapes quotes and control characters, writes the rest as UTF-8.
    assert '"config_json": "name \\"é\\"\u2028\\t\\u0001"' in text
    assert fq.QuantizedModel.from_json(text.encode()).config_json == config


def test_bias_and_layers_through_json(tmp_path, rng):
    layers = [
        ("enc.0", rng.standard_normal((6, 4)).astype(F32), None, rng.standard_normal(6)),
        ("enc.1", rng.standard_normal((3, 5)), (3, 5), None),
    ]
    m = fq.quantize_model_weights('{"d": 2}', layers)
    assert m.scheme == "symmetric_per_tensor_int8"
    assert (m.total_quantized_bytes, m.total_fp32_bytes) == (39, 156)
    assert m.layers[0].bias.dtype == np.float32
    np.testing.assert_array_equal(m.layers[0].bias, layers[0][3].astype(F32))
    m.save(tmp_path / "m.JSON")  # any case of the suffix
    assert json.loads((tmp_path / "m.JSON").read_text())["layers"][1]["bias"] is None
    assert fq.QuantizedModel.load(tmp_path / "m.JSON") == m


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["layers"][0].update(weights_i8=[1, 128, 3]), "i8"),
        (lambda d: d["layers"][0].update(weights_i8=[1, -129, 3]), "i8"),
        (lambda d: d["layers"][0].update(weights_i8=[1, 2.0, 3]), "i8"),
        (lambda d: d["layers"][0].update(shape=[2, 3]), "weights_i8"),
        (lambda d: d["layers"][0].update(shape=[2**62, 4]), "weights_i8"),
        (lambda d: d["layers"][0].update(shape=[-1, 3]), "usize"),
        (lambda d: d["layers"][0].update(bias=[0.5, 1.0]), "bias"),
        (lambda d: d["layers"][0].update(scale="0.1"), "f32"),
        (lambda d: d["layers"][0].update(scale=1e39), "scale"),
        (lambda d: d["layers"][0].update(extra=1), "extra"),
        (lambda d: d.update(total_fp32_bytes=-1), "usize"),
        (lambda d: d.update(layers={}), "sequence"),
        (lambda d: d.pop("scheme"), "scheme"),
    ],
)
def test_hostile_json_is_a_format_error(mutate, message):
    d = json.loads(SEED_JSON)
    mutate(d)
    with pytest.raises(fq.FormatError, match=message):
        fq.QuantizedModel.from_json(json.dumps(d))


def test_a_missing_bias_reads_as_none_as_serde_reads_it():
    d = json.loads(SEED_JSON)
    d["layers"][0].pop("bias")
    assert fq.QuantizedModel.from_json(json.dumps(d)) == seed_model()


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{",
        b"[]",
        b"null",
        SEED_JSON.encode() + b" x",
        b"\xef\xbb\xbf" + SEED_JSON.encode(),
        SEED_JSON.encode().replace(b'"l1"', b'"\xff"'),
        SEED_JSON.encode().replace(
            b'"config_json": "{}",', b'"config_json": "{}", "config_json": "{}",'
        ),
        b"[" * 100_000,
    ],
)
def test_malformed_json_is_a_format_error(data):
    with pytest.raises(fq.FormatError):
        fq.QuantizedModel.from_json(data)


def test_json_that_numpy_cannot_hold_is_a_format_error():
    d = json.loads(SEED_JSON)
    d["layers"][0].update(shape=[1] * 70 + [3])  # more dimensions than NumPy has
    with pytest.raises(fq.FormatError, match="dimensions"):
        fq.QuantizedModel.from_json(json.dumps(d))


def test_values_json_cannot_carry_are_refused_before_writing(tmp_path):
    good = fq.QuantizedWeights("a", np.zeros(2, np.int8), (2,), 1.0, np.ones(2, F32))
    with pytest.raises(fq.NonFiniteError):
        fq.QuantizedWeights("a", np.zeros(2, np.int8), (2,), 1.0, np.array([0, np.nan], F32))
    with pytest.raises(fq.InvalidConfigError, match="scale"):
        fq.QuantizedWeights("a", np.zeros(2, np.int8), (2,), float("inf"))
    with pytest.raises(fq.InvalidConfigError, match="UTF-8"):
        fq.QuantizedModel("\udc80", (good,), "s", 2, 8)
    assert not list(tmp_path.iterdir())


# -- from_f32 ----------------------------------------------------------------------------


@given(
    w=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=40),
        elements=st.floats(-1e6, 1e6, width=32),
    ),
    scale=st.one_of(st.none(), st.floats(2**-40, 2**20, width=32)),
)
def test_from_f32_matches_the_seed(w, scale):
    qw = fq.QuantizedWeights.from_f32("x", w, scale=scale)
    codes, s = ref.ptq_quantize(w, scale)
    assert qw.scale == float(s)
    np.testing.assert_array_equal(qw.weights_i8, codes)
    assert qw.shape == w.shape
    deq = qw.dequantize()
    assert deq.tobytes() == ref.ptq_dequantize(codes, s).reshape(w.shape).tobytes()


@pytest.mark.parametrize("dtype", [np.float16, np.float64, ml_dtypes.bfloat16])
def test_from_f32_reads_other_float_dtypes_as_float32(dtype, rng):
    w = (rng.standard_normal((33, 17)) * 3).astype(dtype)
    qw = fq.QuantizedWeights.from_f32("x", w)
    codes, s = ref.ptq_quantize(w.astype(F32))
    assert qw.scale == float(s)
    np.testing.assert_array_equal(qw.weights_i8, codes)


def test_ties_round_away_from_zero_by_division():
    w = np.array([0.5, -0.5, 1.5, -2.5, 126.5, 127.0, -200.0], F32)
    qw = fq.QuantizedWeights.from_f32("t", w, scale=1.0)
    assert qw.weights_i8.tolist() == [1, -1, 2, -3, 127, 127, -127]


def test_scale_floor_and_zero_weights():
    qw = fq.QuantizedWeights.from_f32("z", np.zeros((3, 3), F32))
    assert qw.scale == float(F32(1e-8)) and not qw.weights_i8.any()
    assert fq.QuantizedWeights.from_f32("z", np.ones(3, F32), scale=1e-20).scale == float(F32(1e-8))


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e39, 1e-50, 10**400])
def test_a_supplied_scale_must_be_finite_and_positive(bad):
    with pytest.raises(fq.InvalidConfigError, match="scale"):
        fq.QuantizedWeights.from_f32("x", np.ones(4, F32), scale=bad)


@pytest.mark.parametrize("bad", [0.0, -0.0, -1.0, 1e-46])
def test_a_held_scale_must_be_positive_in_files_too(tmp_path, bad):
    # from_f32 never makes a scale below 1e-8; one that is not > 0 in float32
    # (1e-46 rounds to 0) is refused by the constructor, so by every reader.
    with pytest.raises(fq.InvalidConfigError, match="scale must be > 0"):
        fq.QuantizedWeights("a", np.ones(4, np.int8), (2, 2), bad)
    m = fq.quantize_model_weights("{}", [("a", np.ones((2, 2), np.float32), None, None)])
    path = tmp_path / "m.json"
    m.save(path)
    doc = json.loads(path.read_text())
    doc["layers"][0]["scale"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(fq.FormatError, match=r"scale.* > 0"):
        fq.QuantizedModel.load(path)
    path = tmp_path / "m.safetensors"
    fq.save(path, {"w": fq.QuantizedWeights("a", np.ones(4, np.int8), (2, 2), 0.5)})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    entry = json.loads(meta["ferroquant:w"])
    entry["scale"] = bad
    meta["ferroquant:w"] = json.dumps(entry)
    path.write_bytes(safetensors.numpy.save(safetensors.numpy.load(raw), metadata=meta))
    with pytest.raises(fq.FormatError, match="scale must be > 0"):
        fq.load(path)


@pytest.mark.parametrize("bad", [True, "1", [1.0], None.__class__])
def test_a_scale_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="scale"):
        fq.QuantizedWeights.from_f32("x", np.ones(4, F32), scale=bad)


def test_non_finite_weights_name_the_first_index_even_with_a_scale():
    w = np.ones(1000, F32)
    w[[700, 900]] = [np.inf, np.nan]
    for scale in (None, 0.5):
        with pytest.raises(fq.NonFiniteError) as e:
            fq.QuantizedWeights.from_f32("x", w, scale=scale)
        assert e.value.index == 700
    with pytest.raises(fq.NonFiniteError):
        fq.QuantizedWeights.from_f32("x", np.array([1e39, 0.0]))  # inf in float32


def test_shape_and_bias_are_checked():
    w = np.ones((4, 3), F32)
    assert fq.QuantizedWeights.from_f32("x", w, shape=[3, 4]).shape == (3, 4)
    with pytest.raises(fq.ShapeMismatchError, match="w"):
        fq.QuantizedWeights.from_f32("x", w, shape=(5, 3))
    with pytest.raises(fq.ShapeMismatchError, match="bias"):
        fq.QuantizedWeights.from_f32("x", w, bias=np.ones(3, F32))
    with pytest.raises(fq.ShapeMismatchError, match="bias"):
        fq.QuantizedWeights.from_f32("x", np.float32(2.0), bias=np.ones(1, F32))
    with pytest.raises(fq.NonFiniteError, match="bias"):
        fq.QuantizedWeights.from_f32("x", w, bias=np.array([0, 1, np.nan, 2]))
    with pytest.raises(TypeError, match="bias"):
        fq.QuantizedWeights.from_f32("x", w, bias=np.ones(4, np.int32))
    with pytest.raises(TypeError, match="w"):
        fq.QuantizedWeights.from_f32("x", w.astype(np.int8))
    with pytest.raises(TypeError, match="name"):
        fq.QuantizedWeights.from_f32(3, w)


def test_inputs_are_never_changed_and_may_be_read_only(rng):
    w = rng.standard_normal((50, 20)).astype(F32)
    w.flags.writeable = False
    before = w.copy()
    strided = rng.standard_normal((40, 60)).astype(F32)[:, ::3]
    big_endian = w.astype(">f4")
    a = fq.QuantizedWeights.from_f32("x", w)
    assert np.array_equal(w, before)
    assert fq.QuantizedWeights.from_f32("x", big_endian) == a
    np.testing.assert_array_equal(
        fq.QuantizedWeights.from_f32("x", strided).weights_i8,
        ref.ptq_quantize(np.ascontiguousarray(strided))[0],
    )


def test_results_do_not_depend_on_the_thread_count(rng, restore_threads):
    w = (rng.standard_normal(700_001) * 5).astype(F32)
    w[123_457] = -31.0
    fq.set_num_threads(1)
    one = fq.QuantizedWeights.from_f32("x", w)
    calib_one = fq.Calibrator()
    calib_one.record_layer("x", w)
    fq.set_num_threads(2)
    two = fq.QuantizedWeights.from_f32("x", w)
    calib_two = fq.Calibrator()
    calib_two.record_layer("x", w)
    assert one == two and calib_one.finish() == calib_two.finish()
    np.testing.assert_array_equal(one.weights_i8, ref.ptq_quantize(w)[0])


def test_concurrent_calls_from_threads(rng):
    ws = [rng.standard_normal((300, 300)).astype(F32) for _ in range(4)]
    want = [fq.QuantizedWeights.from_f32("x", w) for w in ws]
    got = [None] * 4

    def run(i):
        for _ in range(5):
            got[i] = fq.QuantizedWeights.from_f32("x", ws[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


# -- Calibrator and LayerCalibration -------------------------------------------------------


def test_calibrator_records_exact_ranges(rng):
    c = fq.Calibrator()
    a = rng.standard_normal((64, 33)).astype(F32)
    b = rng.standard_normal(5).astype(np.float64)
    c.record_layer("a", a)
    c.record_layer("b", b)
    got = c.finish()
    assert [g.name for g in got] == ["a", "b"]
    lo, hi = ref.weight_range(a)
    assert (got[0].w_min, got[0].w_max) == (float(lo), float(hi))
    assert (got[1].w_min, got[1].w_max) == (float(F32(b.min())), float(F32(b.max())))
    assert (got[0].act_min, got[0].act_max) == (-1.0, 1.0)
    assert got[0].weight_scale() == float(F32(max(abs(lo), abs(hi))) / F32(127))


def test_ranges_keep_the_first_of_equal_zeros_as_the_seeds_folds_do():
    # f32::min / f32::max folds keep the first of 0.0 and -0.0; so do the kernels
    # and the reference (np.min / np.max may give the other).
    bits = lambda v: int(np.float32(v).view(np.uint32))  # noqa: E731
    for vals in ([0.0, -0.0], [-0.0, 0.0], [0.0, -0.0, 1.0], [-0.0, 0.0, -1.0]):
        x = np.array(vals, F32)
        first_zero = bits(x[0])
        c = fq.Calibrator()
        c.record_layer("a", x)
        got = c.finish()[0]
        lo, hi = ref.weight_range(x)
        assert (bits(got.w_min), bits(got.w_max)) == (bits(lo), bits(hi))
        s = fq.CalibStats.collect([x[:1], x[1:]])
        want = ref.calib_stats([x])
        assert (bits(s.min), bits(s.max)) == (bits(want[0]), bits(want[1]))
        zero = [v for v in (s.min, s.max) if v == 0]
        assert zero and all(bits(v) == first_zero for v in zero), vals


def test_calibrator_errors():
    c = fq.Calibrator()
    with pytest.raises(fq.EmptyInputError, match="w"):
        c.record_layer("e", np.zeros(0, F32))
    with pytest.raises(fq.NonFiniteError) as e:
        c.record_layer("n", np.array([0, 1, -np.inf], F32))
    assert e.value.index == 2
    with pytest.raises(TypeError):
        c.record_layer("i", np.ones(3, np.int64))
    assert c.finish() == []


def test_layer_calibration_values_are_float32():
    lc = fq.LayerCalibration("l", -0.1, 0.3, -1, 1)
    assert lc.w_min == float(F32(-0.1))
    assert lc.weight_scale() == float(F32(F32(0.3) / F32(127)))
    with pytest.raises(fq.InvalidConfigError, match="w_max"):
        fq.LayerCalibration("l", 0.0, float("nan"), -1.0, 1.0)
    assert "LayerCalibration(name='l'" in repr(lc)
    # Ranges are ranges: an inverted one is refused, and so is a file holding one.
    assert fq.LayerCalibration("l", 0.5, 0.5, 2.0, 2.0).weight_scale() > 0
    for bad in (("l", 0.3, -0.1, -1, 1), ("l", -0.1, 0.3, 1, -1)):
        with pytest.raises(fq.InvalidConfigError, match="must not exceed"):
            fq.LayerCalibration(*bad)
    raw = lc.to_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    entry = json.loads(meta["ferroquant:value"])
    entry["w_min"], entry["w_max"] = entry["w_max"], entry["w_min"]
    meta["ferroquant:value"] = json.dumps(entry)
    with pytest.raises(fq.FormatError, match="must not exceed"):
        fq.LayerCalibration.from_bytes(safetensors.numpy.save({}, metadata=meta))


# -- dataclasses, files, registry -------------------------------------------------------------


def test_weights_dataclass_surface(rng):
    w = rng.standard_normal((8, 5)).astype(F32)
    qw = fq.QuantizedWeights.from_f32("fc", w, bias=np.ones(8, F32))
    assert qw.nbytes == 40 + 4 + 32  # codes, the float32 scale, the bias
    assert qw.values().shape == (8, 5) and qw.numel() == 40
    assert "QuantizedWeights(shape=(8, 5)" in repr(qw) and "fc" in repr(qw)
    assert not qw.weights_i8.flags.writeable
    with pytest.raises(AttributeError):
        qw.scale = 2.0  # type: ignore[misc]
    assert qw != fq.QuantizedWeights.from_f32("fc", w)  # no bias
    assert pickle.loads(pickle.dumps(qw)) == qw and copy.deepcopy(qw) == qw
    assert np.isnan(fq.QuantizedWeights("e", np.zeros(0, np.int8), (0,), 1.0).compression_ratio())


@pytest.mark.parametrize(
    "value",
    [
        fq.QuantizedWeights("w", np.array([1, -2, 3, 4], np.int8), (2, 2), 0.5, np.ones(2, F32)),
        fq.QuantizedWeights("w", np.array([-128], np.int8), (), 0.5),
        fq.LayerCalibration("c", -2.0, 3.0, -1.0, 1.0),
        seed_model(),
        fq.QuantizedModel("{}", (), "s", 0, 0),
    ],
)
def test_every_ptq_value_round_trips_through_files_and_bytes(tmp_path, value):
    cls = type(value)
    assert cls.from_bytes(value.to_bytes()) == value
    fq.save(tmp_path / "v.safetensors", {"v": value, "plain": np.ones(2, F32)})
    got = fq.load(tmp_path / "v.safetensors")
    assert got["v"] == value and type(got["v"]) is cls
    if cls is fq.QuantizedModel:
        value.save(tmp_path / "m.fq")
        assert fq.QuantizedModel.load(tmp_path / "m.fq") == value


def test_a_model_with_biases_round_trips_natively(rng):
    layers = [
        (f"l{k}", rng.standard_normal((k + 1, 3)).astype(F32), None, rng.standard_normal(k + 1))
        for k in range(4)
    ]
    layers[2] = (layers[2][0], layers[2][1], None, None)
    m = fq.quantize_model_weights("{}", layers)
    assert fq.QuantizedModel.from_bytes(m.to_bytes()) == m
    assert m.nbytes == sum(q.nbytes for q in m.layers)


def _model_entry(value: fq.QuantizedModel):
    from safetensors.numpy import load as st_load

    from ferroquant import _format

    raw = value.to_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return st_load(raw), json.loads(header["__metadata__"][ENTRY_PREFIX + _format.SINGLE])


@pytest.mark.parametrize(
    "mutate",
    [
        lambda e: e["layers"][0].update(shape=[2, 3]),
        lambda e: e["layers"][0].update(shape=[-1, 3]),
        lambda e: e["layers"][0].update(bias=1),
        lambda e: e["layers"][0].update(scale="x"),
        lambda e: e["layers"][0].update(name=5),
        lambda e: e["layers"][0].pop("scale"),
        lambda e: e.update(layers=[]),
        lambda e: e.update(layers="abc"),
        lambda e: e.update(total_fp32_bytes=-3),
        lambda e: e.update(model_scheme=None),
    ],
)
def test_hostile_native_model_entries_are_format_errors(mutate):
    from ferroquant import _format

    arrays, entry = _model_entry(seed_model())
    mutate(entry)
    data = fq.save_bytes(
        {f"{_format.SINGLE}::{k}": v for k, v in arrays.items()},
        metadata=None,
    )
    # Re-attach the (mutated) entry by crafting the header anew.
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"] = {ENTRY_PREFIX + _format.SINGLE: json.dumps(entry)}
    text = json.dumps(header).encode()
    crafted = len(text).to_bytes(8, "little") + text + data[8 + n :]
    with pytest.raises(fq.FormatError):
        fq.QuantizedModel.from_bytes(crafted)


def test_ptq_int8_is_registered():
    assert "ptq-int8" in fq.list_quantizers()
    q = fq.get_quantizer("ptq-int8")
    x = np.linspace(-2, 2, 60, dtype=F32).reshape(6, 10)
    v = q.quantize(x)
    assert isinstance(v, fq.QuantizedWeights) and v.label == "ptq-int8"
    np.testing.assert_array_equal(q.dequantize(v), v.dequantize())
    assert fq.get_quantizer("ptq-int8", scale=0.5).quantize(x).scale == 0.5
    with pytest.raises(fq.InvalidConfigError):
        fq.get_quantizer("ptq-int8", scale=-1.0)
    with pytest.raises(TypeError):
        q.dequantize(fq.quantize_blockwise(x))


def test_scales_of_any_real_scalar_type():
    w = np.ones(4, F32)
    for s in (ml_dtypes.bfloat16(0.5), np.float16(0.5), np.int64(1), 0.5):
        assert fq.QuantizedWeights.from_f32("x", w, scale=s).scale == float(F32(s))
    with pytest.raises(TypeError):
        fq.QuantizedWeights.from_f32("x", w, scale=1j)


def test_the_source_dtype_is_recorded_but_not_part_of_the_value(tmp_path, rng):
    w = rng.standard_normal((4, 4)).astype(np.float16)
    q = fq.QuantizedWeights.from_f32("x", w)
    assert q.dtype == "float16" and "dtype=float16" in repr(q)
    assert fq.QuantizedWeights.from_bytes(q.to_bytes()).dtype == "float16"
    m = fq.quantize_model_weights("{}", [("x", w, None, None)])
    assert fq.QuantizedModel.from_bytes(m.to_bytes()).layers[0].dtype == "float16"
    m.save(tmp_path / "m.json")  # the seed's JSON has no dtype: read back as float32
    back = fq.QuantizedModel.load(tmp_path / "m.json")
    assert back == m and back.layers[0].dtype == "float32"
    with pytest.raises(fq.InvalidConfigError, match="dtype"):
        fq.QuantizedWeights("x", np.zeros(1, np.int8), (1,), 1.0, None, "int8")


def test_a_bad_json_file_is_named_in_the_error(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(fq.FormatError, match=r"bad\.json"):
        fq.QuantizedModel.load(path)


# -- regressions from the second adversarial review -------------------------------------------


def test_a_stream_whose_bound_is_the_dropped_value_is_exact_and_silent():
    import math
    import warnings

    batches = [np.arange(1, 3001, dtype=F32), np.zeros(105_600, F32)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no PrecisionWarning for an exact p99
        s = fq.CalibStats.collect(iter(batches))
    a = np.sort(np.abs(np.concatenate(batches)))
    assert s.p99 == float(a[math.ceil(0.99 * a.size) - 1])


def test_a_stream_that_let_its_early_outliers_go_is_still_exact():
    # Once an upper bound with a warning; the spill of every value now gives the
    # exact p99 (and total= keeps just what it needs).
    import math
    import warnings

    rng = np.random.default_rng(0)
    bs = [rng.standard_normal(10_000).astype(F32) * (100 if i < 2 else 1) for i in range(100)]
    a = np.sort(np.abs(np.concatenate(bs)))
    want = float(a[math.ceil(0.99 * a.size) - 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fq.CalibStats.collect(iter(bs)).p99 == want
        assert fq.CalibStats.collect(iter(bs), total=a.size).p99 == want
    assert fq.CalibStats.collect(bs).p99 == want


def test_an_accumulator_refuses_more_values_than_announced():
    from ferroquant import _ferroquant as native

    acc = native.CalibAccumulator(10)
    with pytest.raises(fq.InvalidConfigError, match="total"):
        acc.push(np.zeros(11, F32))


def test_quantization_stats_reports_overflow_and_reads_only_shapes():
    huge = np.zeros((2**59, 0), F32)
    with pytest.raises(fq.InvalidConfigError, match="overflow"):
        fq.quantization_stats({"a": huge, "b": huge}, fq.QuantConfig.int8_per_channel())
    wide = np.broadcast_to(F32(0), (2**20, 2**20))  # 4 TiB if it were copied
    s = fq.quantization_stats({"w": wide})
    assert s.num_quantized == 1 and s.fp32_bytes == 4 * 2**40
