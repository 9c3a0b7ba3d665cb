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
