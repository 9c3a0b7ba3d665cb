"""The wheel reproduces the Rust-written golden vectors bit for bit.

tests/golden/blockwise.safetensors is written by `cargo run --example
write_golden` and checked by tests/golden.rs on the Rust side.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers the bfloat16 dtype safetensors reads)
import numpy as np
import pytest
from safetensors import safe_open

import ferroquant as fq

GOLDEN = Path(__file__).parent / "golden" / "blockwise.safetensors"


def _cases():
    with safe_open(str(GOLDEN), framework="np") as f:
        for params in json.loads(f.metadata()["cases"]):
            case = params["case"]
            arrays = {k: f.get_tensor(f"{case}.{k}") for k in ("x", "codes", "scales", "deq")}
            yield pytest.param(params, arrays, id=f"{case}-{arrays['x'].dtype}")


def test_golden_file_has_every_input_dtype():
    dtypes = {str(arrays["x"].dtype) for _, arrays in (p.values for p in _cases())}
    assert dtypes == {"float32", "float16", "bfloat16", "float64"}


@pytest.mark.parametrize(("params", "arrays"), list(_cases()))
def test_wheel_matches_rust_bit_for_bit(params, arrays):
    x = arrays["x"].reshape(params["shape"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = fq.quantize_blockwise(x, params["block_size"], np.dtype(params["scale_dtype"]))
    lossy = [w for w in caught if issubclass(w.category, fq.PrecisionWarning)]
    assert len(lossy) == (1 if params["lossy_blocks"] else 0)
    assert q.data.tobytes() == arrays["codes"].tobytes()
    assert q.scales.dtype == arrays["scales"].dtype
    assert q.scales.tobytes() == arrays["scales"].tobytes()
    assert q.shape == tuple(params["shape"])
    deq = fq.dequantize_blockwise(q)
    assert deq.shape == tuple(params["shape"])
    assert deq.tobytes() == arrays["deq"].tobytes()


AFFINE = Path(__file__).parent / "golden" / "affine.safetensors"


def _affine_cases():
    with safe_open(str(AFFINE), framework="np") as f:
        for params in json.loads(f.metadata()["cases"]):
            case = params["case"]
            keys = ("x", "data", "scales", "zero_points", "deq")
            arrays = {k: f.get_tensor(f"{case}.{k}") for k in keys}
            cfg = f"int{params['bits']}-{params['mode'][:4]}-{params['granularity']}"
            yield pytest.param(params, arrays, id=f"{case}-{cfg}-{arrays['x'].dtype}")


def test_affine_golden_file_covers_every_config_and_dtype():
    cases = [p.values for p in _affine_cases()]
    configs = {(p["bits"], p["mode"], p["granularity"]) for p, _ in cases}
    assert len(configs) == 8
    assert {str(a["x"].dtype) for _, a in cases} == {"float32", "float16", "bfloat16", "float64"}


@pytest.mark.parametrize(("params", "arrays"), list(_affine_cases()))
def test_wheel_matches_rust_affine_bit_for_bit(params, arrays):
    x = arrays["x"].reshape(params["shape"])
    config = fq.QuantConfig(params["bits"], params["mode"], params["granularity"])
    q = fq.quantize(x, config)
    for field in ("data", "scales", "zero_points"):
        got = getattr(q, field)
        assert got.dtype == arrays[field].dtype and got.tobytes() == arrays[field].tobytes()
    deq = fq.dequantize(q)
    assert deq.dtype == x.dtype and deq.shape == tuple(params["shape"])
    assert deq.tobytes() == arrays["deq"].tobytes()


DYNAMIC = Path(__file__).parent / "golden" / "dynamic.safetensors"
_DYN_FUNCS = {
    "int8_per_tensor": fq.dynamic_quantize_int8,
    "int8_per_row": fq.dynamic_quantize_int8_per_row,
    "int4_per_tensor": fq.dynamic_quantize_int4,
}


def _dynamic_cases(path: Path = DYNAMIC):
    """The cases of a golden file whose metadata lists them (``kind`` per case)."""
    with safe_open(str(path), framework="np") as f:
        names = set(f.keys())
        for params in json.loads(f.metadata()["cases"]):
            case = params["case"]
            arrays = {
                k.split(".", 1)[1]: f.get_tensor(k) for k in names if k.startswith(case + ".")
            }
            yield pytest.param(params, arrays, id=f"{case}-{params['kind']}")


def test_dynamic_golden_file_covers_every_kind():
    cases = [p.values for p in _dynamic_cases()]
    kinds = {p["kind"] for p, _ in cases}
    assert kinds == {"dynamic", "bitnet", "smooth", "w8a8", "calib"}
    fmts = {p["format"] for p, _ in cases if p["kind"] == "dynamic"}
    assert fmts == set(_DYN_FUNCS)
    dtypes = {str(a["x"].dtype) for p, a in cases if p["kind"] == "dynamic"}
    assert dtypes == {"float32", "float16", "bfloat16", "float64"}


@pytest.mark.parametrize(("params", "arrays"), list(_dynamic_cases()))
def test_wheel_matches_rust_dynamic_bit_for_bit(params, arrays):
    def same(got, want):
        assert np.asarray(got).dtype == want.dtype
        assert np.asarray(got).tobytes() == want.tobytes()

    if params["kind"] == "calib":
        x = arrays["x"]
        cuts = np.cumsum(params["sizes"])[:-1]
        for batches in (np.split(x, cuts), iter(np.split(x, cuts))):  # known and unknown total
            s = fq.CalibStats.collect(batches)
            got = [s.min, s.max, s.mean, s.std_dev, s.p99, s.suggested_scale]
            same(np.array(got, np.float32), arrays["stats"])
        return
    if params["kind"] == "w8a8":
        w, s, x = arrays["weight"], arrays["scales"], arrays["x"]
        assert w.dtype == np.int8
        got = fq.w8a8_matvec(w, s, x) if params["tokens"] == 0 else fq.w8a8_matmul(w, s, x)
        same(got.reshape(-1), arrays["out"])
        return
    if params["kind"] == "smooth":
        cfg = fq.SmoothQuantConfig(params["alpha"], params["epsilon"])
        same(fq.compute_smooth_factors(arrays["a"], arrays["w"], cfg), arrays["factors"])
        return
    x = arrays["x"].reshape(params["shape"])
    if params["kind"] == "bitnet":
        q = fq.quantize_activations(x, fq.BitNetConfig(params["bits"], params["per_token"]))
        same(q.data, arrays["data"])
        same(q.scales, arrays["scales"])
        same(q.dequantize(), arrays["deq"])
        return
    mode = fq.MaxAbs() if params["p"] is None else fq.Percentile(params["p"])
    q = _DYN_FUNCS[params["format"]](x, mode)
    same(q.data, arrays["data"])
    same(q.scales, arrays["scales"])
    same(q.dequantize(), arrays["deq"])
    same(np.float32(fq.compute_scale(x, 127.0, mode)), arrays["scale127"])
    same(np.float32(fq.quantization_mae(x, q)), arrays["mae"])


PTQ = Path(__file__).parent / "golden" / "ptq.safetensors"


def _ptq_cases():
    return _dynamic_cases(PTQ)


def test_ptq_golden_file_covers_every_kind():
    cases = [p.values for p in _ptq_cases()]
    kinds = [p["kind"] for p, _ in cases]
    assert {k: kinds.count(k) for k in set(kinds)} == {
        "f16bits": 3,
        "weights": 8,
        "model": 1,
        "seed_model": 1,
    }
    dtypes = {str(a["w"].dtype) for p, a in cases if p["kind"] == "weights"}
    assert dtypes == {"float32", "float16", "bfloat16", "float64"}


@pytest.mark.parametrize(("params", "arrays"), list(_ptq_cases()))
def test_wheel_matches_rust_ptq_bit_for_bit(params, arrays):
    if params["kind"] == "weights":
        w = arrays["w"].reshape(params["shape"])
        qw = fq.QuantizedWeights.from_f32(
            params["case"], w, bias=arrays.get("bias"), scale=params["scale"]
        )
        assert qw.weights_i8.tobytes() == arrays["codes"].tobytes()
        assert np.float32(qw.scale).tobytes() == arrays["scale"].tobytes()
        if "deq" in arrays:
            assert qw.dequantize().dtype == np.float32
            assert qw.dequantize().tobytes() == arrays["deq"].tobytes()
        if "range" in arrays:
            c = fq.Calibrator()
            c.record_layer(params["case"], w)
            (lc,) = c.finish()
            assert np.array([lc.w_min, lc.w_max], np.float32).tobytes() == arrays["range"].tobytes()
        return
    if params["kind"] == "model":
        layers = [
            (
                f"layer.{k}",
                arrays[f"w{k}"].reshape(shape),
                shape,
                arrays[f"b{k}"] if has_bias else None,
            )
            for k, (shape, has_bias) in enumerate(
                zip(params["shapes"], params["biases"], strict=True)
            )
        ]
        model = fq.quantize_model_weights(params["config_json"], layers)
        assert model.to_json().encode() == arrays["json"].tobytes()
        assert fq.QuantizedModel.from_json(arrays["json"].tobytes()) == model
        return
    if params["kind"] == "seed_model":
        model = fq.QuantizedModel.from_json(arrays["json"].tobytes())
        assert model.layers[0].weights_i8.tolist() == [1, -2, 3]
        assert model.to_json().encode() == arrays["json"].tobytes()
        return
    assert arrays["x"].dtype == np.float32 and arrays["bits_in"].dtype == np.uint16
    bits = fq.fp32_to_fp16_bits(arrays["x"])
    assert bits.dtype == np.uint16 and bits.tobytes() == arrays["bits"].tobytes()
    values = fq.fp16_bits_to_fp32(arrays["bits_in"])
    assert values.dtype == np.float32 and values.tobytes() == arrays["values"].tobytes()
