"""Regression tests for the defects an adversarial review found (issue 5).

Each test names the item it covers. Anything that could hang or kill the
interpreter runs in a subprocess with a time limit, so a regression fails
instead of stalling the suite. Item 6 (a caller's FTZ/DAZ flags) is covered in
the Rust tests, where the flags can be set, and at the Python boundary below.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import json
import math
import os
import re
import stat
import struct
import subprocess
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
from helpers import cli, craft, run_python, string_array

import ferroquant as fq
from ferroquant import _format

# --- 1. an output that cannot be allocated is MemoryError, not PanicException --------


def test_unallocatable_output_raises_memory_error():
    r = run_python(
        """
        import resource, numpy as np, ferroquant as fq
        n = 2**30
        data = np.zeros(n, np.int8)
        q = fq.BlockwiseQuantized(data, np.ones(1, np.float16), (n,), n)
        x = np.zeros(2**26, np.float32)
        def vm():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        limit = vm() + 48 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        for call in (q.dequantize, lambda: fq.quantize_blockwise(x)):
            try:
                call()
            except MemoryError:
                print("MemoryError")
        """,
        env_extra={"RUST_BACKTRACE": "1", "FERROQUANT_NUM_THREADS": "1"},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["MemoryError", "MemoryError"], r.stdout + r.stderr
    assert "PanicException" not in r.stderr


# --- 2. thread counts are bounded; the environment is read once, and checked --------


@pytest.mark.parametrize("n", [1025, 100_000, 2**63 - 1, 2**64 - 1, 2**70])
def test_absurd_thread_counts_are_refused(n, restore_threads):
    before = fq.get_num_threads()
    with pytest.raises(fq.InvalidConfigError, match="n"):
        fq.set_num_threads(n)
    assert fq.get_num_threads() == before


def test_the_largest_thread_count_is_accepted_and_reported(restore_threads):
    fq.set_num_threads(fq._runtime.MAX_THREADS)
    assert fq.get_num_threads() == 1024


def test_env_thread_count_is_read_once_at_import():
    r = run_python(
        """
        import os, ferroquant as fq
        os.environ["FERROQUANT_NUM_THREADS"] = "1"
        print(fq.get_num_threads())
        """,
        env_extra={"FERROQUANT_NUM_THREADS": "3"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "3"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("FERROQUANT_NUM_THREADS", "two"),
        ("FERROQUANT_NUM_THREADS", "0"),
        ("FERROQUANT_NUM_THREADS", "100000"),
        ("FERROQUANT_SIMD", "avx9000"),
        ("FERROQUANT_SIMD", "AVX2"),
    ],
)
def test_bad_environment_values_warn(var, value):
    r = run_python(
        "import ferroquant as fq; print(fq.get_num_threads(), fq.simd_isa())",
        env_extra={var: value},
    )
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and var in r.stderr and "ignored" in r.stderr
    threads, isa = r.stdout.split()
    assert int(threads) >= 1 and isa in fq.supported_isas()


def test_good_environment_values_do_not_warn():
    r = run_python(
        "import ferroquant as fq; print(fq.get_num_threads(), fq.simd_isa())",
        env_extra={"FERROQUANT_NUM_THREADS": " 2 ", "FERROQUANT_SIMD": "scalar"},
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.split() == ["2", "scalar"]


# --- 3. a child forked while the pool is being built does not hang -------------------


#: A forked child's wait status, or exit 1 after killing it if it hangs 60 s.
WAIT_CHILD = """
import os, sys, time

def wait_child(pid, what):
    deadline = time.time() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.time() > deadline:
            os.kill(pid, 9)
            print("child hung", what)
            sys.exit(1)
        time.sleep(0.01)
"""

FORK_DURING_FIRST_CALLS = (
    WAIT_CHILD
    + """
import os, sys, threading, time
import numpy as np, ferroquant as fq
x = np.ones(1 << 22, np.float32)
for delay in DELAYS:
    fq.set_num_threads(256)  # drops the pool: the next large call builds one
    # The first calls of a fresh process also fill every lazy cache: a fork
    # while another thread is inside one of those must not hang the child.
    t = threading.Thread(target=fq.quantize_blockwise, args=(x,))
    t.start()
    time.sleep(delay)
    pid = os.fork()
    if pid == 0:
        n = fq.get_num_threads()
        q = fq.quantize_blockwise(x)
        a = fq.quantize(x[:999])
        os._exit(0 if n == 256 and int(q.data[0]) == 127 and int(a.data[0]) == 127 else 3)
    status = wait_child(pid, delay)
    t.join()
    assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""
)


@pytest.mark.parametrize("attempt", range(6))
def test_fork_while_the_pool_is_being_built(attempt):
    delays = [0.0] if attempt < 4 else [0.0, 0.001, 0.005, 0.02]
    r = run_python(FORK_DURING_FIRST_CALLS.replace("DELAYS", repr(delays)), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


# --- 4, 5, 11. the command line -------------------------------------------------------


@pytest.fixture
def model(tmp_path, rng):
    path = tmp_path / "model.safetensors"
    stn.save_file(
        {
            "w16": rng.standard_normal((64, 32)).astype(np.float16),
            "wbf": rng.standard_normal((16, 16)).astype(ml_dtypes.bfloat16),
            "w32": rng.standard_normal((8, 8)).astype(np.float32),
            "empty": np.zeros((0, 8), np.float32),
            "bias": np.ones(8, np.float32),
        },
        str(path),
    )
    return path


def test_dequantize_refuses_to_overwrite_its_input(tmp_path, model):
    q = tmp_path / "q.safetensors"
    assert cli("quantize", str(model), "-o", str(q), "--no-progress").returncode == 0
    before = q.read_bytes()
    link = tmp_path / "link.safetensors"
    os.link(q, link)
    for out in (q, link):
        r = cli("dequantize", str(q), "-o", str(out))
        assert r.returncode == 1
        assert r.stderr.strip().splitlines() == [
            "ferroquant: error: the output file must differ from the input file"
        ]
    assert q.read_bytes() == before


@pytest.mark.parametrize("command", ["quantize", "dequantize"])
def test_unwritable_outputs_give_one_line(tmp_path, model, command):
    src = model
    if command == "dequantize":
        src = tmp_path / "q.safetensors"
        assert cli("quantize", str(model), "-o", str(src), "--no-progress").returncode == 0
    for out, words in [
        (tmp_path, "Is a directory"),
        (tmp_path / "nodir" / "sub" / "o.safetensors", "No such file or directory"),
    ]:
        r = cli(command, str(src), "-o", str(out))
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, r.stderr
        assert words in lines[0] and str(out) in lines[0] and "tmp" not in lines[0][-12:]


def test_an_empty_float_tensor_does_not_break_the_summary(tmp_path, model):
    r = cli("quantize", str(model), "-o", str(tmp_path / "q.safetensors"), "--no-progress")
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("empty"))
    # Copied: a tensor of no elements has nothing to compress.
    assert "0x8" in row and "copied" in row and "0 B" in row


def test_source_dtype_survives_the_cli_round_trip(tmp_path, model):
    q, back = tmp_path / "q.safetensors", tmp_path / "back.safetensors"
    assert cli("quantize", str(model), "-o", str(q), "--no-progress").returncode == 0
    loaded = fq.load(q)
    assert loaded["w16"].dtype == "float16" and loaded["wbf"].dtype == "bfloat16"
    assert loaded["w32"].dtype == "float32"
    entry = json.loads(stn.safe_open(str(q), "np").metadata()["ferroquant:w16"])
    assert entry["dtype"] == "float16"
    assert cli("dequantize", str(q), "-o", str(back)).returncode == 0
    restored = fq.load(back)
    assert restored["w16"].dtype == np.float16 and restored["w16"].shape == (64, 32)
    assert restored["wbf"].dtype == ml_dtypes.bfloat16
    assert restored["w32"].dtype == np.float32
    want = loaded["w16"].dequantize().astype(np.float16)
    assert np.array_equal(restored["w16"], want)
    # inspect reports ratios against the bytes the source really had
    out = cli("inspect", str(q)).stdout
    row16 = next(line for line in out.splitlines() if line.startswith("w16"))
    src_ratio = 64 * 32 * 2 / loaded["w16"].nbytes
    assert f"{src_ratio:.2f}x" in row16 and "float16" in row16
    assert abs(src_ratio - 1.94) < 0.01


def test_save_errors_are_os_errors_naming_the_users_path(tmp_path):
    q = fq.quantize_blockwise(np.ones(8, np.float32))
    target = tmp_path / "nodir" / "sub" / "x.safetensors"
    with pytest.raises(FileNotFoundError) as e:
        fq.save(target, {"q": q})
    assert e.value.filename == str(target)
    with pytest.raises(IsADirectoryError) as e2:
        fq.save(tmp_path, {"q": q})
    assert e2.value.filename == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["nodir"] if (tmp_path / "nodir").exists() else True
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


# --- 7. unaligned input is copied once, not refused -----------------------------------


def unaligned(values: np.ndarray) -> np.ndarray:
    buf = bytearray(values.nbytes + 1)
    arr = np.frombuffer(buf, values.dtype, count=values.size, offset=1)
    arr[...] = values.reshape(-1)
    assert not arr.flags.aligned or values.itemsize == 1
    return arr.reshape(values.shape)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_unaligned_input_works(dtype, rng):
    x = rng.standard_normal(1000).astype(dtype)
    u = unaligned(x)
    assert fq.quantize_blockwise(u, 32) == fq.quantize_blockwise(x, 32)
    b = bytearray(4001)
    assert fq.quantize_blockwise(np.frombuffer(b, np.float32, offset=1)).shape == (1000,)
    assert fq.quantize_blockwise(np.frombuffer(b, np.uint8)[1:].view(np.float32)).shape == (1000,)


def test_unaligned_memmap_and_unaligned_held_arrays(tmp_path, rng):
    x = rng.standard_normal(999).astype(np.float32)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\0\0" + x.tobytes())
    m = np.memmap(path, np.float32, "r", offset=2, shape=(999,))
    want = fq.quantize_blockwise(x, 16)
    assert fq.quantize_blockwise(m, 16) == want
    q = fq.BlockwiseQuantized(unaligned(want.data), unaligned(want.scales), (999,), 16)
    assert np.array_equal(q.dequantize(), want.dequantize())


def test_empty_arrays_at_odd_addresses_act_as_empty_arrays():
    """NumPy calls an empty array aligned whatever its address; the bindings lend a
    fresh empty array of the same shape in its place (a Rust slice must be aligned
    even when empty), so every result is the one for an ordinary empty array."""
    buf = bytearray(64)

    def odd(dtype, shape):
        a = np.ndarray(shape=shape, dtype=dtype, buffer=buf, offset=1)
        assert a.flags.aligned and a.ctypes.data % np.dtype(dtype).alignment
        return a

    for dtype in (np.float32, np.float64):
        for shape in [(0,), (3, 0), (0, 5)]:
            want, got = np.zeros(shape, dtype), odd(dtype, shape)
            assert fq.quantize(got) == fq.quantize(want)
            assert fq.quantize(got, fq.QuantConfig.int4_per_channel()) == fq.quantize(
                want, fq.QuantConfig.int4_per_channel()
            )
            assert fq.quantize_blockwise(got) == fq.quantize_blockwise(want)
            assert fq.dynamic_quantize_int8(got) == fq.dynamic_quantize_int8(want)
    layer = fq.QuantizedLinear.from_linear(np.ones((3, 0), np.float32), np.arange(3.0))
    for shape in [(0,), (2, 0), (4, 2, 0)]:
        got = layer.forward(odd(np.float32, shape))
        assert got.tobytes() == layer.forward(np.zeros(shape, np.float32)).tobytes()
        assert got.shape == (*shape[:-1], 3)
    a = odd(np.float32, (0, 4))
    fq.smooth_activations(a, np.ones(4, np.float32))  # nothing to change, no error
    with pytest.raises(fq.ShapeMismatchError):
        fq.smooth_activations(a, np.ones(3, np.float32))
    q = fq.quantize(np.zeros(0, np.float32))
    assert q.numel() == 0 and q.values().shape == (0,)


# --- 9. loading: every holdable dtype, identically through both paths -----------------


@pytest.mark.parametrize(
    "shape", [[0, 2**63], [2**63, 0], [0] * 65, [1] * 65], ids=["huge0", "huge1", "65d", "65d1"]
)
def test_unrepresentable_shapes_are_format_errors_in_both_paths(tmp_path, shape):
    n = 4 if all(d == 1 for d in shape) else 0
    blob = craft({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, n]}}, bytes(n))
    with pytest.raises(fq.FormatError):
        fq.load_bytes(blob)
    path = tmp_path / "s.safetensors"
    path.write_bytes(blob)
    with pytest.raises(fq.FormatError):
        fq.load(path)


@pytest.mark.parametrize(
    "dtype",
    [
        np.complex64,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fnuz,
        ml_dtypes.float8_e5m2fnuz,
        ml_dtypes.bfloat16,
        np.bool_,
        np.uint64,
    ],
)
def test_every_holdable_dtype_loads_through_both_paths(tmp_path, dtype, rng):
    x = rng.standard_normal((3, 5)).astype(dtype)
    path = tmp_path / "d.safetensors"
    fq.save(path, {"x": x, "odd": np.ones(3, np.int8)})
    for got in (fq.load(path)["x"], fq.load_bytes(path.read_bytes())["x"]):
        assert got.dtype == np.dtype(dtype) and got.shape == (3, 5)
        assert got.tobytes() == x.tobytes()
        assert not got.flags.writeable


def test_sub_byte_dtypes_are_refused_clearly():
    blob = craft({"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, bytes(2))
    with pytest.raises(fq.FormatError, match="F4"):
        fq.load_bytes(blob)


# --- 10. the constructor refuses what it should ---------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"shape": (2.7, 5.9)}, TypeError, "shape"),
        ({"shape": "25"}, TypeError, "shape"),
        ({"shape": 25}, TypeError, "shape"),
        ({"shape": (True, 10)}, TypeError, "bool"),
        ({"scales": np.array([np.nan], np.float16)}, fq.InvalidConfigError, "scales"),
        ({"scales": np.array([-1.0], np.float32)}, fq.InvalidConfigError, "scales"),
        ({"data": np.full(10, -128, np.int8)}, fq.InvalidConfigError, "-128"),
        ({"dtype": "int8"}, fq.InvalidConfigError, "dtype"),
        ({"dtype": None}, fq.InvalidConfigError, "dtype"),
    ],
)
def test_constructor_validates(kwargs, exc, match):
    args = {
        "data": np.zeros(10, np.int8),
        "scales": np.ones(1, np.float16),
        "shape": (2, 5),
        "block_size": 64,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fq.BlockwiseQuantized(**args)


def test_strided_data_just_works_and_held_arrays_are_read_only(rng):
    x = rng.standard_normal(100).astype(np.float32)
    want = fq.quantize_blockwise(x, 10)
    big = np.zeros(200, np.int8)
    big[::2] = want.data
    q = fq.BlockwiseQuantized(big[::2], want.scales.copy(), (100,), 10)
    assert np.array_equal(q.dequantize(), want.dequantize())
    assert not q.data.flags.writeable and not q.scales.flags.writeable
    assert big.flags.writeable  # the caller's array keeps its flags
    mine = want.data.copy()
    q2 = fq.BlockwiseQuantized(mine, want.scales.copy(), (100,), 10)
    assert mine.flags.writeable and not q2.data.flags.writeable
    assert q2 == want


# --- 12. a huge header of empty tensors: one parse, bounded memory --------------------


def test_many_empty_tensors_load_in_bounded_memory():
    import tracemalloc

    n = 100_000
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    blob = craft(header)
    tracemalloc.start()
    out = fq.load_bytes(blob)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(out) == n
    # The arrays themselves cost ~200 B each; parsing twice and copying every
    # tensor, as before, cost ~40x the header. One parse stays well below.
    assert peak < 12 * len(blob), (peak, len(blob))


# --- 13. files get the permissions any tool gives them -------------------------------


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_new_files_respect_the_umask(tmp_path, mask):
    r = run_python(
        f"""
        import os, stat, numpy as np, ferroquant as fq
        from ferroquant.serialization import StreamingWriter
        os.umask({mask})
        fq.save({str(tmp_path / "a.safetensors")!r}, {{"x": np.ones(2, np.float32)}})
        with StreamingWriter({str(tmp_path / "b.safetensors")!r}) as w:
            w.add("x", np.ones(2, np.float32))
        for n in "ab":
            print(oct(stat.S_IMODE(os.stat({str(tmp_path)!r} + f"/{{n}}.safetensors").st_mode)))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [oct(0o666 & ~mask)] * 2


def test_replaced_files_keep_their_mode(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    fq.save(path, {"x": np.ones(2, np.float32)})
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert fq.load(path)["x"].tolist() == [1.0, 1.0]


def test_an_output_without_write_permission_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "ro.safetensors"
    path.write_bytes(b"keep me")
    real_access = os.access
    monkeypatch.setattr(
        _format.os,
        "access",
        lambda p, mode: False if os.fspath(p) == str(path) else real_access(p, mode),
    )
    with pytest.raises(PermissionError) as e:
        fq.save(path, {"x": np.ones(2, np.float32)})
    assert e.value.filename == str(path)
    assert path.read_bytes() == b"keep me"


# --- 14. warnings point at the caller, and the CLI prints them on one line -------------


def test_precision_warning_through_the_registry_names_the_callers_line():
    quantizer = fq.get_quantizer("blockwise8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantizer.quantize(np.full(64, 1e-4, np.float32))
    assert len(caught) == 1 and caught[0].category is fq.PrecisionWarning
    assert caught[0].filename == __file__


def test_cli_prints_a_warning_as_one_line(tmp_path):
    src = tmp_path / "tiny.safetensors"
    stn.save_file({"w": np.full((4, 64), 1e-4, np.float32)}, str(src))
    r = cli("quantize", str(src), "-o", str(tmp_path / "q.safetensors"), "--no-progress")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ferroquant: warning: w: 4 of 4 blocks")


# --- 15. the documented error bound holds ----------------------------------------------


def test_documented_error_bound_with_float16_scales(rng):
    # README: with float16 scales, |x - dequant| <= (0.5 + 127 * 2**-11) * f32 scale
    # per block (0.562 steps) while the scale is a normal float16.
    x = (rng.standard_normal(1 << 16) * rng.uniform(0.01, 100, 1 << 16)).astype(np.float32)
    q = fq.quantize_blockwise(x, 64)
    err = np.abs(q.dequantize() - x).reshape(-1, 64)
    step = np.abs(x).reshape(-1, 64).max(axis=1) / np.float32(127)
    ratio = (err.max(axis=1) / step).max()
    assert ratio <= 0.5 + 127 * 2**-11
    assert ratio > 0.5  # the float16 rounding of the scale really adds to half a step
    q32 = fq.quantize_blockwise(x, 64, np.float32)
    err32 = np.abs(q32.dequantize() - x).reshape(-1, 64).max(axis=1)
    assert (err32 <= step * np.float32(0.5) * (1 + 2**-20)).all()


# --- found by the second adversarial review -------------------------------------------


def test_special_files_are_never_replaced(tmp_path, model):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file") as e:
        fq.save(fifo, {"a": np.ones(2, np.float32)})
    assert e.value.filename == str(fifo)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    r = cli("quantize", str(model), "-o", str(fifo), "--no-progress")
    assert r.returncode == 1 and "not a regular file" in r.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_restoring_a_narrow_dtype_never_overflows_to_inf(tmp_path):
    src, q, back = (tmp_path / n for n in ("h.safetensors", "q.safetensors", "d.safetensors"))
    stn.save_file({"h": np.array([[65504, -65504, 1000]], np.float16)}, str(src))
    assert cli("quantize", str(src), "-o", str(q), "--no-progress").returncode == 0
    r = cli("dequantize", str(q), "-o", str(back))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    h = fq.load(back)["h"]
    assert np.isfinite(h).all() and h[0, 0] == 65504 and h[0, 1] == -65504


def test_reserved_and_colliding_names(tmp_path):
    with pytest.raises(ValueError, match="__metadata__"):
        fq.save_bytes({"__metadata__": np.ones(2, np.float32)})
    src, q = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    stn.save_file({"w": np.ones((4, 4), np.float32), "w::data": np.ones(3, np.int8)}, str(src))
    r = cli("quantize", str(src), "-o", str(q), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "w: copied, not quantized" in r.stderr
    out = fq.load(q)
    assert isinstance(out["w"], np.ndarray) and out["w::data"].tolist() == [1, 1, 1]


def test_held_arrays_cannot_change_behind_the_value():
    import copy
    import pickle

    c = np.zeros(4, np.int8)
    s = np.ones(1, np.float16)
    q = fq.BlockwiseQuantized(c, s, (4,), 4)
    c[0] = -128
    s[0] = np.nan
    assert q.data.tolist() == [0, 0, 0, 0] and q.scales.tolist() == [1.0]
    assert fq.BlockwiseQuantized.from_bytes(q.to_bytes()) == q
    for clone in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert clone == q and not clone.data.flags.writeable and not clone.scales.flags.writeable
    # A read-only view of writable memory is copied too.
    base = np.zeros(4, np.int8)
    view = base.view()
    view.flags.writeable = False
    q2 = fq.BlockwiseQuantized(view, np.ones(1, np.float32), (4,), 4)
    base[1] = 5
    assert q2.data[1] == 0


@pytest.mark.parametrize("bad", ["f4,(", "(f4,(2,))", "nonsense"])
def test_malformed_scale_dtypes_are_invalid_config(bad, tmp_path, model):
    with pytest.raises(fq.InvalidConfigError, match="scale_dtype"):
        fq.quantize_blockwise(np.ones(4, np.float32), 2, bad)
    out = str(tmp_path / "x.safetensors")
    r = cli("quantize", str(model), "-o", out, "-p", f"scale_dtype={bad}")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("shape", [[0, 2**62], [0, 2**63 - 1], [2**40, 2**40, 0]])
def test_shapes_numpy_cannot_allocate_are_refused(shape, tmp_path):
    blob = craft({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(fq.FormatError):
        fq.load_bytes(blob)
    (tmp_path / "a.safetensors").write_bytes(blob)
    with pytest.raises(fq.FormatError):
        fq.load(tmp_path / "a.safetensors")
    with pytest.raises(fq.ShapeMismatchError, match="shape"):
        fq.BlockwiseQuantized(np.zeros(0, np.int8), np.zeros(0, np.float16), tuple(shape), 64)


def test_dequantize_keeps_user_metadata(tmp_path):
    src, q, back = (tmp_path / n for n in ("m.safetensors", "q.safetensors", "d.safetensors"))
    stn.save_file(
        {"w": np.ones((4, 4), np.float32)}, str(src), metadata={"ferroquant_note": "keep me"}
    )
    assert cli("quantize", str(src), "-o", str(q), "--no-progress").returncode == 0
    assert cli("dequantize", str(q), "-o", str(back)).returncode == 0
    meta = stn.safe_open(str(back), "np").metadata()
    assert meta == {"ferroquant_note": "keep me"}


def test_cli_errors_name_the_tensor(tmp_path):
    src = tmp_path / "nan.safetensors"
    w = np.ones((3, 4), np.float32)
    w[1, 2] = np.nan
    stn.save_file({"layer3.w": w}, str(src))
    r = cli("quantize", str(src), "-o", str(tmp_path / "q.safetensors"), "--scheme", "int8")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "ferroquant: error: tensor 'layer3.w': x holds a non-finite value (NaN or ±inf) at "
        "flat index 6"
    ]


def test_odd_names_are_escaped_when_printed(tmp_path):
    src = tmp_path / "n.safetensors"
    stn.save_file({"evil\x1b[31m\nname": np.ones((2, 2), np.float32)}, str(src))
    r = cli("inspect", str(src))
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\\x1b" in r.stdout


def test_subclasses_save_and_small_validation_gaps():
    class Mine(fq.BlockwiseQuantized):
        pass

    q = fq.quantize_blockwise(np.ones(4, np.float32))
    m = Mine(q.data, q.scales, q.shape, q.block_size)
    assert fq.load_bytes(fq.save_bytes({"m": m}))["m"] == q
    with pytest.raises(fq.InvalidConfigError, match="scales"):
        fq.BlockwiseQuantized(q.data, np.array([-0.0], np.float16), (4,), 64)
    assert fq.BlockwiseQuantized(q.data, q.scales, (4,), 64, dtype=np.float16).dtype == "float16"
    with pytest.raises(fq.InvalidConfigError, match="dtype"):  # strings: the four names only
        fq.BlockwiseQuantized(q.data, q.scales, (4,), 64, dtype="e")
    for bad in ({4}, {4: 1}, np.array(4)):
        with pytest.raises(TypeError, match="shape"):
            fq.BlockwiseQuantized(q.data, q.scales, bad, 64)  # type: ignore[arg-type]


# --- found by the adversarial review of the affine family -------------------------------


def test_a_callers_rounding_mode_changes_nothing():
    r = run_python(
        """
        import ctypes, numpy as np, ferroquant as fq
        libm = ctypes.CDLL("libm.so.6")
        x = np.random.default_rng(0).standard_normal((64, 33)) * 7
        inputs = [x, x.astype(np.float32)]  # made before the rounding mode changes
        configs = [fq.QuantConfig(b, m, g) for b in (8, 4) for m in ("symmetric", "asymmetric")
                   for g in ("per_tensor", "per_channel")]
        def run():
            out = []
            for c in configs:
                for arr in inputs:
                    q = fq.quantize(arr, c)
                    out.append(q.to_bytes() + q.dequantize().tobytes())
            return out
        want = run()
        for mode in (0x400, 0x800, 0xC00):  # down, up, toward zero
            assert libm.fesetround(mode) == 0
            got = run()
            libm.fesetround(0)
            assert got == want, hex(mode)
        print("ok")
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.parametrize("mode", [0x400, 0x800, 0xC00], ids=["down", "up", "toward-zero"])
def test_values_made_at_the_largest_scale_load_under_any_rounding_mode(mode):
    # The kernels round scales to nearest whatever the caller's mode; the checks of
    # a value's largest scale (the source's largest value / the divisor) must too,
    # or ferroquant's own output fails to load (first checked here under `mode`).
    r = run_python(
        f"""
        import ctypes, ml_dtypes, numpy as np, ferroquant as fq
        libm = ctypes.CDLL("libm.so.6")
        blobs = []
        for dt in (np.float32, np.float16, ml_dtypes.bfloat16):
            x = np.array([[float(ml_dtypes.finfo(dt).max), 1.0]] * 2, dt)
            scale_dtypes = (np.float16, np.float32) if dt is np.float16 else (np.float32,)
            values = [fq.quantize_blockwise(x, 2, s) for s in scale_dtypes]
            values += [fq.dynamic_quantize_int8(x), fq.dynamic_quantize_int8_per_row(x),
                       fq.dynamic_quantize_int4(x)]
            values += [fq.quantize_activations(x, fq.BitNetConfig(b)) for b in (2, 5, 8)]
            blobs += [(type(q), q.to_bytes(), q) for q in values]
        assert libm.fesetround({mode}) == 0
        try:
            loaded = [(cls.from_bytes(b), q) for cls, b, q in blobs]
        finally:
            libm.fesetround(0)
        assert all(a == b for a, b in loaded)
        print(len(loaded))
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == "22"


@pytest.mark.parametrize(
    "dtype",
    [{"names": ["a"], "formats": ["f4"], "itemsize": 10**30}, "f4," * 1000, ">f4", "e", "half"],
    ids=["struct", "long", "big-endian", "char", "alias"],
)
def test_entry_dtypes_are_the_four_names_exactly(dtype):
    b = fq.quantize(np.ones((2, 3), np.float32)).to_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    entry = json.loads(header["__metadata__"]["ferroquant:value"])
    entry["dtype"] = dtype
    header["__metadata__"]["ferroquant:value"] = json.dumps(entry)
    with pytest.raises(fq.FormatError, match="dtype") as e:
        fq.load_bytes(craft(header, b[8 + n :]))
    assert len(str(e.value)) < 300
    with pytest.raises(fq.InvalidConfigError):
        fq.QuantizedTensor(np.zeros(1, np.int8), np.ones(1), np.zeros(1), (1,), dtype)


def test_quantized_linear_refuses_non_finite_values():
    w = np.ones((5, 7), np.float32)
    with pytest.raises(fq.NonFiniteError, match="bias") as e:
        fq.QuantizedLinear.from_linear(w, np.full(5, np.nan, np.float32))
    with pytest.raises(fq.NonFiniteError, match="bias"):
        fq.QuantizedLinear.from_linear(w, np.full(5, 1e300))  # inf in float32
    bad = w.copy()
    bad[1, 3] = np.inf
    with pytest.raises(fq.NonFiniteError, match=r"^weight") as e:
        fq.QuantizedLinear.from_linear(bad)
    assert e.value.index == 10
    layer = fq.QuantizedLinear.from_linear(w)
    x = np.ones((3, 7), np.float32)
    x[2, 4] = np.nan
    with pytest.raises(fq.NonFiniteError, match=r"^x") as e:
        layer.forward(x)
    assert e.value.index == 18
    with pytest.raises(fq.NonFiniteError):
        layer.forward(np.full((1, 7), 1e300))


def test_parameter_helpers_check_and_name_their_entries():
    bad = np.ones((2, 2), np.float32)
    bad[0, 1] = np.nan
    with pytest.raises(fq.NonFiniteError, match=r"dec\.w") as e:
        fq.quantize_named_parameters({"enc.w": np.ones((2, 2), np.float32), "dec.w": bad})
    assert e.value.index == 1
    for value in (None, "hello", np.ones((2, 2), bool), [[1, 2], [3, 4]]):
        with pytest.raises(TypeError, match="params"):
            fq.quantization_stats({"a": value})
    with pytest.raises(TypeError, match="config"):
        fq.quantize_named_parameters({"a": np.ones(3)}, None)  # type: ignore[arg-type]
    c = fq.QuantConfig(8, np.str_("asymmetric"))
    assert type(c.mode) is str and "np.str_" not in repr(c)


def test_thread_counts_too_large_say_so(restore_threads):
    for n in (1025, 2**64):
        with pytest.raises(fq.InvalidConfigError, match="at most"):
            fq.set_num_threads(n)


# --- found by the third adversarial review ---------------------------------------------


def test_collisions_are_found_at_any_depth(tmp_path):
    src, q = tmp_path / "m.safetensors", tmp_path / "q.safetensors"
    tensors = {f"layer{i}.w": np.ones((2, 2), np.float32) for i in range(3000)}
    tensors["a"] = np.ones((2, 2), np.float32)
    tensors["a::b::c"] = np.ones(3, np.float32)
    tensors["a::b"] = np.ones((2, 2), np.float32)
    stn.save_file(tensors, str(src))
    r = cli("quantize", str(src), "-o", str(q), "--no-progress")
    assert r.returncode == 0, r.stderr
    prefix = "ferroquant: warning: "
    warned = {
        line[len(prefix) :].split(": copied")[0]
        for line in r.stderr.splitlines()
        if "copied" in line
    }
    assert warned == {"a", "a::b"}
    out = fq.load(q)
    assert isinstance(out["a"], np.ndarray) and isinstance(out["layer7.w"], fq.BlockwiseQuantized)


def test_a_file_truncated_while_read_is_a_format_error_not_sigbus(tmp_path):
    path = tmp_path / "big.safetensors"
    stn.save_file({f"t{i}": np.ones(4096, np.float32) for i in range(8)}, str(path))
    r = run_python(
        f"""
        import os, ferroquant as fq
        from ferroquant.serialization import TensorReader
        r = TensorReader({str(path)!r})
        os.truncate({str(path)!r}, 4096)
        try:
            r.get(r.names[-1])
        except fq.FormatError as e:
            print("FormatError", "changed while it was read" in str(e))
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["FormatError", "True"]


@pytest.mark.parametrize("scheme", ["int8-asym", "int4-per-channel-asym", "blockwise8"])
def test_cli_round_trip_of_extreme_half_values_stays_finite(tmp_path, scheme):
    src, q, back = (tmp_path / n for n in ("h.safetensors", "q.safetensors", "d.safetensors"))
    w = np.array([[-65504, 65504], [1, 2]], np.float16)
    b = (w.astype(np.float32) * np.float32(5e33)).astype(ml_dtypes.bfloat16)
    stn.save_file({"w": w, "b": b}, str(src))
    extra = ["-p", "scale_dtype=float32"] if scheme == "blockwise8" else []
    r = cli("quantize", str(src), "-o", str(q), "--scheme", scheme, *extra)
    assert r.returncode == 0, r.stderr
    r = cli("dequantize", str(q), "-o", str(back))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = fq.load(back)
    assert np.isfinite(out["w"].astype(np.float32)).all()
    assert np.isfinite(out["b"].astype(np.float32)).all()
    assert out["w"].dtype == np.float16 and out["b"].dtype == ml_dtypes.bfloat16


def test_float64_blockwise_restores_without_warnings(tmp_path):
    src, q, back = (tmp_path / n for n in ("f.safetensors", "q.safetensors", "d.safetensors"))
    stn.save_file({"w": np.random.default_rng(0).random((4, 4))}, str(src))
    assert cli("quantize", str(src), "-o", str(q)).returncode == 0
    r = cli("dequantize", str(q), "-o", str(back), env_extra={"PYTHONWARNINGS": "error"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert fq.load(back)["w"].dtype == np.float64


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_terminating_signals_leave_no_temporary_files(tmp_path, signame):
    import signal
    import time

    signum = getattr(signal, signame)

    src = tmp_path / "m.safetensors"
    rng = np.random.default_rng(0)
    stn.save_file(
        {f"w{i}": rng.standard_normal((512, 512), np.float32) for i in range(40)}, str(src)
    )
    out = tmp_path / "out" / "q.safetensors"
    out.parent.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferroquant", "quantize", str(src), "-o", str(out), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # not a timing assertion: the signal may land in any phase
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    # -signum: the signal landed while Python was still importing, before the
    # handler was installed and before any file was opened (nothing to clean up).
    assert proc.returncode in (0, 128 + signum, -signum), err
    if proc.returncode == 128 + signum:
        # Stopped after the output was in place (printing the summary), it says so.
        written = f" ({out} written)" if out.exists() else ""
        assert err.strip().splitlines()[-1] == f"ferroquant: terminated ({signame}){written}"
    leftovers = [p.name for p in out.parent.iterdir() if p.name != "q.safetensors"]
    assert leftovers == []


def test_names_that_are_not_utf8(tmp_path):
    src = tmp_path / "m.safetensors"
    stn.save_file({"w": np.ones((2, 2), np.float32)}, str(src))
    odd = os.fsencode(str(tmp_path)) + b"/in\xff.safetensors"
    os.link(src, odd)
    r = subprocess.run(
        [sys.executable, "-m", "ferroquant", "quantize", odd, "-o", str(tmp_path / "q.st")],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert fq.load(tmp_path / "q.st")["w"].shape == (2, 2)
    with pytest.raises(ValueError, match="tensor name"):
        fq.save_bytes({"\udcff": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="metadata"):
        fq.save_bytes({"a": np.ones(2, np.float32)}, metadata={"k": "\udcff"})


def test_small_api_and_cli_edges(tmp_path, model):
    q = fq.quantize_blockwise(np.ones(4, np.float32))
    assert (q == np.ones(4)) is False and (np.ones(4) == q) is False
    from ferroquant import registry

    fq.register_quantizer("named-test", lambda name="x": fq.Blockwise8(), replace=True)
    try:
        assert fq.get_quantizer("named-test", name="y").name == "blockwise8"
    finally:  # later tests compare the registry with a fresh process's
        del registry._REGISTRY["named-test"]
    r = cli(
        "quantize", str(model), "-o", str(tmp_path / "o.st"), "--scheme", "int8", "-p", "bits=4"
    )
    assert r.returncode == 1 and "does not take bits (it takes no parameters)" in r.stderr
    r = cli("quantize", str(model), "-o", str(tmp_path / "o.st"), "-p", "block_size=64.0")
    assert r.returncode == 1 and "invalid parameter" in r.stderr and "block_size" in r.stderr
    blob = fq.save_bytes({"weights": q})
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + n])
    e = json.loads(header["__metadata__"]["ferroquant:weights"])
    e["block_size"] = 2.5
    header["__metadata__"]["ferroquant:weights"] = json.dumps(e)
    with pytest.raises(fq.FormatError, match="entry 'weights'"):
        fq.load_bytes(craft(header, blob[8 + n :]))
    r = subprocess.run(
        f"{sys.executable} -m ferroquant inspect {model} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0 and "Broken pipe" not in r.stderr, r.stderr
    r = subprocess.run(
        f"{sys.executable} -m ferroquant inspect <(cat {model})",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 1 and "not a regular file" in r.stderr
    r = run_python(
        "import ferroquant", env_extra={"FERROQUANT_SIMD": "", "FERROQUANT_NUM_THREADS": " "}
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr


_FPENV_PROBE = """
import ctypes, json, struct, warnings
import ml_dtypes
import numpy as np
import ferroquant as fq
from ferroquant._checks import round_f32

x = np.array([1e-37, -2e-38, 3e-39], np.float32)  # one subnormal, scales subnormal
# 2.5 * 2**-149 and a little more: float() gives a float32 midpoint, the value rounds
# up to 3 * 2**-149 (exactly 2.5 * 2**-149 where long double is float64).
sub = np.longdouble(2.5 * 2.0**-149) + np.ldexp(np.longdouble(1), -209)
# Narrow scalars, made before the flags are set (NumPy would flush them on creation):
# float() widens them in hardware, which reads a subnormal as 0 under DAZ.
tiny32, tiny16, tiny_bf16 = np.float32(1e-40), np.float16(6e-8), ml_dtypes.bfloat16(2.0**-130)
# A float64 affine scale and zero point below float64's normal range.
sub64, codes = np.array([1e-310]), np.array([1, -3], np.int8)


def affine_checks():
    q = fq.QuantizedTensor(codes, sub64, np.zeros(1), (2,), "float64", fq.QuantConfig())
    back = fq.load_bytes(fq.save_bytes({"q": q}))["q"]
    try:
        asym = fq.QuantConfig.int8().asymmetric()
        fq.QuantizedTensor(codes, np.ones(1), sub64, (2,), "float64", asym)
        zp = "accepted"
    except fq.InvalidConfigError as e:
        zp = str(e)
    return [back.scales.view(np.uint64).tolist(), zp]


def dyn_checks():
    # x's scale is subnormal, its codes nonzero: under DAZ the scale compares equal
    # to 0, and the zero-scale check must not read it so.
    q = fq.dynamic_quantize_int8(x)
    back = fq.DynQuantTensor.from_bytes(q.to_bytes())
    return [q.scales.view(np.uint32).tolist(), q.data.tolist(), back.data.tolist()]


def results():
    stats = fq.CalibStats.collect([x])
    cal = fq.Calibrator()
    cal.record_layer("l", x.reshape(1, 3))
    layer = cal.finish()[0]
    qw = fq.QuantizedWeights.from_f32("w", x, (1, 3))
    smooth = fq.SmoothQuantConfig(0.5, 1e-40)  # a subnormal epsilon
    tiny64 = np.array([1e-40, 0.5])  # float64, subnormal in float32
    lin = fq.QuantizedLinear.from_linear(np.array([[1.0, 0.5], [0.25, -1.0]]), tiny64)
    qb = fq.QuantizedWeights.from_f32("b", x[:2], (2, 1), bias=tiny64)
    return [
        # float32 arrays as bit patterns: tolist() under the flags would itself flush.
        lin.bias.view(np.uint32).tolist(),
        lin.forward(tiny64.reshape(1, 2)).view(np.uint32).tolist(),
        # A float64 x subnormal in float32: converted in the default environment.
        lin.forward(np.array([[1e-40, 0.0]])).view(np.uint32).tolist(),
        qb.bias.view(np.uint32).tolist(),
        fq.compute_scale(x, 127.0),
        fq.compute_scale(x, 127.0, fq.Percentile(0.5)),
        fq.compute_scale(x, 1e-40),  # a subnormal clip
        fq.compute_scale(x, sub),  # a subnormal clip rounded once from a long double
        fq.SmoothQuantConfig(0.5, sub).epsilon,
        fq.compute_scale(x, tiny32),
        fq.SmoothQuantConfig(0.5, tiny32).epsilon,
        [round_f32(v) for v in (tiny16, tiny_bf16)],
        fq.Percentile(tiny32).p,
        fq.CalibStats(min=-tiny32, max=tiny32, mean=0.0, std_dev=tiny32, p99=tiny32,
                      suggested_scale=round_f32(round_f32(tiny32) / 127.0)).max,
        fq.quantization_mae(x, fq.dynamic_quantize_int8(x)),
        [stats.min, stats.max, stats.mean, stats.p99, stats.suggested_scale],
        [layer.w_min, layer.w_max, layer.weight_scale()],
        qw.scale,
        fq.compute_smooth_factors(x.reshape(1, 3), x.reshape(1, 3), smooth)
        .view(np.uint32)
        .tolist(),
        affine_checks(),
        dyn_checks(),
    ]


plain = results()
libc = ctypes.CDLL(None)
env = ctypes.create_string_buffer(32)  # glibc's x86-64 fenv_t: MXCSR at byte 28
assert libc.fegetenv(env) == 0
flagged = bytearray(env.raw)
struct.pack_into("<I", flagged, 28, struct.unpack_from("<I", env.raw, 28)[0] | 0x8040)
assert libc.fesetenv(ctypes.create_string_buffer(bytes(flagged), 32)) == 0
try:
    live = float(np.float32(1e-39) * np.float32(1.0)) == 0.0  # the flags are in force
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast_math = results()
finally:
    libc.fesetenv(env)
print(json.dumps({"live": live, "plain": repr(plain), "fast_math": repr(fast_math)}))
"""


@pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64",
    reason="sets MXCSR through glibc's x86-64 fenv_t",
)
def test_item6_python_floats_in_and_out_ignore_flush_to_zero():
    """A caller under FTZ/DAZ (a -ffast-math library loaded) gets the same Python
    floats: results are widened, and scalar parameters rounded, in the default
    environment (NumPy's float32() and PyO3's f32 conversions are not)."""
    r = run_python(_FPENV_PROBE)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["live"], "FTZ/DAZ were not set: the probe proves nothing"
    assert out["fast_math"] == out["plain"]
    assert "0.0," not in out["plain"].split("]")[0]  # the subnormal results are there
    assert "zero_points must be finite integers" in out["plain"]


def test_zero_extremes_keep_the_first_zeros_sign():
    """A second review: AVX2's lane merge reported -0.0 for min and max of
    [0.0]*4 + [-0.0]*4, where the scalar reference keeps the first zero."""
    for x in (np.array([0.0] * 4 + [-0.0] * 4, np.float32), np.array([-0.0] * 9 + [0.0] * 9)):
        first = np.signbit(x[0])
        s = fq.CalibStats.collect([x])
        cal = fq.Calibrator()
        cal.record_layer("l", x.reshape(-1, 1))
        layer = cal.finish()[0]
        for v in (s.min, s.max, layer.w_min, layer.w_max):
            assert v == 0.0 and np.signbit(v) == first


def test_scalars_are_rounded_to_float32_once():
    """A third review: ``float(value)`` first (a long double, a large int) can land
    exactly halfway between two float32 values, and a second rounding then picks the
    wrong one. The scalar parameters are rounded once, whatever the value's type."""
    from fractions import Fraction

    from ferroquant._checks import round_f32

    def exact(value) -> float:  # the float32 nearest to the exact value, ties to even
        q = Fraction(*value.as_integer_ratio())
        r = np.float32(float(q))
        with np.errstate(over="ignore"):  # float32's largest steps up to inf
            steps = [np.nextafter(r, np.float32(s)) for s in (np.inf, -np.inf)]
        cands = [c for c in [r, *steps] if np.isfinite(c)]
        best = min(abs(Fraction(float(c)) - q) for c in cands)
        near = [c for c in cands if abs(Fraction(float(c)) - q) == best]
        return float(min(near, key=lambda c: int(c.view(np.uint32)) & 1))

    big = 2**60 + 2**36 + 1  # float() gives 2**60 + 2**36: a float32 midpoint
    values = [big, -big, 2**60 + 2**36, 0.1, Fraction(1, 3), 1e-45, 3.4028235e38]
    if np.finfo(np.longdouble).nmant > 52:  # x87 extended: more bits than float64
        ld = np.longdouble(1) + np.longdouble(2.0**-24) + np.longdouble(2.0**-60)
        values += [ld, -ld]
    for v in values:
        assert round_f32(v) == exact(v), v
    assert round_f32(big) == 2.0**60 + 2.0**37
    # Through the public API: a ptq scale and compute_scale's clip.
    w = np.array([1.0, -2.0], np.float32)
    assert fq.QuantizedWeights.from_f32("w", w, (2, 1), scale=big).scale == 2.0**60 + 2.0**37
    x = np.array([3.0], np.float32)
    clip = round_f32(big)
    assert fq.compute_scale(x, big) == float(np.float32(3.0) / np.float32(clip))
    # SmoothQuant's epsilon is the floor of every factor: rounded twice it would be
    # 2**60 (ties to even from float(big)), once it is 2**60 + 2**37.
    a = np.ones((2, 3), np.float32)
    s = fq.compute_smooth_factors(a, a, fq.SmoothQuantConfig(epsilon=big))
    assert s.tolist() == [2.0**60 + 2.0**37] * 3
    assert fq.SmoothQuantConfig(epsilon=big) != fq.SmoothQuantConfig(epsilon=2**60 + 2**36)
    # A fourth review: NumPy integers compare with floats in float64 (so the midpoint
    # went unnoticed), and the boundary where float32 overflows is a midpoint too.
    for t in (int, np.int64, np.uint64):
        assert round_f32(t(big)) == 2.0**60 + 2.0**37, t
    edge = 2**128 - 2**103  # halfway from float32's largest to 2**128: ties overflow
    f32max = float(np.finfo(np.float32).max)
    assert round_f32(edge - 1) == f32max and round_f32(-(edge - 1)) == -f32max
    assert round_f32(edge) == math.inf and round_f32(Fraction(edge) - Fraction(1, 3)) == f32max
    assert (
        fq.compute_smooth_factors(a, a, fq.SmoothQuantConfig(0.5, edge - 1)).tolist()
        == [f32max] * 3
    )
    with pytest.raises(fq.InvalidConfigError, match="epsilon"):
        fq.SmoothQuantConfig(epsilon=edge)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning from a neighbour search
        assert round_f32(int(f32max) + 2**80 + 1) == f32max
    if np.finfo(np.longdouble).nmant > 52:
        half = ld / 2  # 0.5 + 2**-25 + 2**-61: float() gives the midpoint 0.5 + 2**-25
        cfg = fq.SmoothQuantConfig(alpha=half, epsilon=0.0)
        want = fq.compute_smooth_factors(a, a * 4, fq.SmoothQuantConfig(0.5 + 2.0**-24, 0.0))
        assert np.array_equal(fq.compute_smooth_factors(a, a * 4, cfg), want)
        assert not np.array_equal(
            want, fq.compute_smooth_factors(a, a * 4, fq.SmoothQuantConfig(0.5, 0.0))
        )
        below = np.longdouble(2.0**128 - 2.0**103) - np.longdouble(2.0**70)
        assert round_f32(below) == f32max
        with pytest.raises(fq.InvalidConfigError, match="alpha"):
            fq.SmoothQuantConfig(alpha=np.longdouble(1) + np.longdouble(2.0**-60))


def test_smooth_config_round_trips_keep_the_float32_values():
    """A fourth review: a config rebuilt from its fields (``replace``, ``repr``,
    ``asdict``, pickle) must make the kernel see the same float32 values, and odd
    numbers are refused with the parameter named."""
    import dataclasses
    import pickle

    a = np.ones((2, 3), np.float32)
    big = 2**60 + 2**36 + 1
    for cfg in (fq.SmoothQuantConfig(epsilon=big), fq.SmoothQuantConfig(0.25, 1e-3)):
        for again in (
            dataclasses.replace(cfg),
            eval(repr(cfg), {"SmoothQuantConfig": fq.SmoothQuantConfig}),
            fq.SmoothQuantConfig(**dataclasses.asdict(cfg)),
            pickle.loads(pickle.dumps(cfg)),
        ):
            assert again == cfg
            assert np.array_equal(
                fq.compute_smooth_factors(a, a * 3, again), fq.compute_smooth_factors(a, a * 3, cfg)
            )
    assert (
        fq.compute_smooth_factors(
            a, a, dataclasses.replace(fq.SmoothQuantConfig(epsilon=big), alpha=0.3)
        ).tolist()
        == [2.0**60 + 2.0**37] * 3
    )

    class Bad(float):
        def __float__(self) -> float:
            raise ValueError("no")

    class Broken(float):
        def __float__(self) -> float:
            raise RuntimeError("no")

    for name, value in (
        ("alpha", np.timedelta64(1)),
        ("alpha", Bad(0.5)),
        ("alpha", Broken(0.5)),
        ("epsilon", 10**400),
        ("epsilon", 10**4400),  # past Python's int-to-str limit: no repr in the message
    ):
        with pytest.raises(fq.InvalidConfigError, match=name) as err:
            fq.SmoothQuantConfig(**{name: value})
        assert len(str(err.value)) < 120
    # The same values as compute_scale's clip and a ptq scale: typed errors, short.
    x = np.ones(4, np.float32)
    for value in (2**1024, 10**4400, Broken(2.0)):
        with pytest.raises(fq.InvalidConfigError, match="clip_val") as err:
            fq.compute_scale(x, value)
        assert len(str(err.value)) < 120
    with pytest.raises(fq.InvalidConfigError, match="scale") as err:
        fq.QuantizedWeights.from_f32("w", x, (4,), scale=10**4400)
    assert len(str(err.value)) < 120
    with pytest.raises(TypeError, match="scale"):
        fq.QuantizedWeights.from_f32("w", x, (4,), scale=Broken(2.0))


def test_fork_while_a_thread_holds_the_pool_lock_does_not_hang_the_child():
    # A fork() landing while another thread holds the pool's (brief) lock
    # copies it locked into the child, where nobody releases it: the child
    # must run its kernels on its own thread instead of waiting forever.
    r = run_python(
        WAIT_CHILD
        + textwrap.dedent(
            """
        import os, threading, time
        import numpy as np, ferroquant as fq
        from ferroquant import _ferroquant as native
        fq.set_num_threads(2)
        x = np.ones(1 << 22, np.float32)
        want = fq.quantize_blockwise(x)
        t = threading.Thread(target=native._hold_pool_lock, args=(2.0,))
        t.start()
        time.sleep(0.3)
        pid = os.fork()
        if pid == 0:
            fq.set_num_threads(2)  # the stuck lock: no pool to drop, no hang
            ok = fq.quantize_blockwise(x) == want and fq.get_num_threads() == 2
            os._exit(0 if ok else 3)
        status = wait_child(pid, "with the pool's lock held")
        t.join()
        assert os.waitstatus_to_exitcode(status) == 0, status
        assert fq.quantize_blockwise(x) == want  # the parent's lock came back
        print("ok")
        """
        ),
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# -- the tenth session's reviews ---------------------------------------------------


def test_read_only_memory_the_caller_owns_is_copied_not_held():
    class Lying(np.ndarray):  # claims immutable memory as its base
        @property
        def base(self):
            return b"immutable"

    src = np.zeros(8, np.int8)
    liar = src.view(Lying)
    liar.flags.writeable = False
    q0 = fq.BlockwiseQuantized(liar, np.ones(2, np.float32), (8,), 4)
    src[:] = 100
    assert q0.data.tolist() == [0] * 8

    # The owner of a read-only array may set it writable again: a frozen value
    # must not change when it does.
    bias = np.array([1, 2, 3], np.float32)
    bias.flags.writeable = False
    q = fq.QuantizedWeights.from_f32("l", np.ones((3, 2), np.float32), bias=bias)
    codes, scales = np.zeros(8, np.int8), np.ones(2, np.float32)
    codes.flags.writeable = scales.flags.writeable = False
    b = fq.BlockwiseQuantized(codes, scales, (8,), 4)
    view = codes.view()  # a read-only view of that memory: the same
    b2 = fq.BlockwiseQuantized(view, scales, (8,), 4)
    for arr in (bias, codes, scales):
        arr.flags.writeable = True
    bias[0], codes[0], scales[1] = np.nan, -128, -np.inf
    assert q.bias.tolist() == [1, 2, 3]
    assert b.data[0] == 0 and b.scales[1] == 1 and b2.data[0] == 0
    assert np.isfinite(fq.dequantize_blockwise(b)).all()


def test_memory_only_ferroquant_can_write_is_held_without_a_copy(tmp_path):
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    q = fq.quantize(x)  # codes in a buffer of the output cache
    # A read-only view of a cache buffer is copied: the same buffer may back a
    # writable output (a dequantized array) the caller holds.
    out = fq.dequantize_blockwise(fq.quantize_blockwise(np.ones(1 << 19, np.float32)))
    ro = out.view()
    ro.flags.writeable = False
    b = fq.BlockwiseQuantized(np.ones(1 << 19, np.int8), ro, (1 << 19,), 1)
    before = out[0]
    out[0] = 123.0
    assert b.scales[0] == before
    path = tmp_path / "q.safetensors"
    fq.save(path, {"q": q})
    loaded = fq.load(path)["q"]  # views of the reader's own arrays, read once
    assert loaded == q and not loaded.data.flags.writeable
    with pytest.raises(ValueError, match="WRITEABLE"):
        loaded.data.flags.writeable = True  # a view of a read-only owner
    assert np.shares_memory(dataclasses.replace(loaded).data, loaded.data)
    blob = fq.load_bytes(fq.save_bytes({"q": q}))["q"]  # views of immutable bytes
    assert isinstance(blob.data.base, (bytes, np.ndarray))
    again = fq.QuantizedTensor(**vars(blob))
    assert np.shares_memory(again.data, blob.data)
    # A plain tensor read from a file is the caller's now: a value built on it copies.
    fq.save(path, {"codes": q.data})
    codes = fq.load(path)["codes"]
    rebuilt = fq.QuantizedTensor(codes, q.scales, q.zero_points, q.shape, q.dtype, q.config)
    assert not np.shares_memory(rebuilt.data, codes)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_array_subclasses_are_held_as_plain_arrays():
    w, bias = np.ones((3, 2), np.float32), np.array([1, 2, 3], np.float32)
    qm = fq.QuantizedWeights.from_f32("l", w, bias=np.asmatrix(bias))
    assert type(qm.bias) is np.ndarray and qm.bias.shape == (3,)
    assert qm == fq.QuantizedWeights.from_f32("l", w, bias=bias)
    assert fq.QuantizedWeights.from_bytes(qm.to_bytes()) == qm
    codes = np.arange(6, dtype=np.int8)
    qw = fq.QuantizedWeights("a", np.asmatrix(codes.reshape(2, 3)), (1, 2, 3), 0.5)
    assert qw.weights_i8.shape == (6,) and qw.values().shape == (1, 2, 3)
    assert qw == fq.QuantizedWeights("a", codes, (1, 2, 3), 0.5)


def test_new_style_dtypes_and_ragged_lists_get_errors_naming_the_argument():
    strings = string_array(["1", "2"])
    with pytest.raises(TypeError, match="bits must be a uint16"):
        fq.fp16_bits_to_fp32(strings)
    with pytest.raises(TypeError, match="scales must be a float16 or float32"):
        fq.BlockwiseQuantized(np.zeros(2, np.int8), strings[:1], (2,), 4)
    with pytest.raises(TypeError, match=r"tensors\['s'\]"):
        fq.save_bytes({"s": strings})
    with pytest.raises(TypeError, match=r"params\['p'\] must be a floating array"):
        fq.quantization_stats({"p": [[1.0], [2.0, 3.0]]})
    for bad in (None, 2.5, 7):
        with pytest.raises(TypeError, match="batches must be an iterable"):
            fq.CalibStats.collect(bad)


def test_calib_stats_hold_float32_values_consistent_with_each_other():
    s = fq.CalibStats.collect([np.array([-1.0, 0.25, 3.0], np.float32)])
    fields = {k: getattr(s, k) for k in ("min", "max", "mean", "std_dev", "p99")}
    assert fq.CalibStats(**fields, suggested_scale=s.suggested_scale) == s
    # Numbers are held as float32 values, as collect() gives them.
    assert fq.CalibStats(**{**fields, "mean": 0.1}, suggested_scale=s.suggested_scale).mean == (
        float(np.float32(0.1))
    )
    for bad in (
        {"mean": 5.0},  # outside [min, max]
        {"p99": 3.5},  # larger than every |x|
        {"std_dev": 4.5},  # more than max - min
        {"suggested_scale": 1.0},  # not p99 / 127
        {"max": 1e39},  # not finite in float32
    ):
        with pytest.raises(fq.InvalidConfigError):
            fq.CalibStats(**{**fields, "suggested_scale": s.suggested_scale, **bad})
    assert fq.CalibStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0) == fq.CalibStats.collect([])
    zeros = fq.CalibStats.collect([np.zeros(4, np.float32)])
    assert zeros.suggested_scale == float(np.float32(1) / np.float32(127))


def test_an_infinite_affine_scale_is_refused_for_narrow_sources_and_not_restored():
    q = fq.quantize(np.array([[1.0, -2.0], [0.5, 0.0]], np.float32))
    with pytest.raises(fq.InvalidConfigError, match="finite for a float32 source"):
        fq.QuantizedTensor(q.data, np.array([np.inf]), q.zero_points, q.shape, "float32", q.config)
    # float64 values whose range overflows the f64 scale give the seed's inf scale:
    # it round-trips, and the command line refuses to write its NaN restore.
    wide = fq.quantize(np.array([[-1e308, 1e308]]), fq.QuantConfig.int8().asymmetric())
    assert np.isinf(wide.scales).all() and fq.QuantizedTensor.from_bytes(wide.to_bytes()) == wide


def test_dequantize_refuses_a_tensor_that_restores_nan(tmp_path):
    wide = fq.quantize(np.array([[-1e308, 1e308]]), fq.QuantConfig.int8().asymmetric())
    src, out = tmp_path / "q.safetensors", tmp_path / "d.safetensors"
    fq.save(src, {"w": wide})
    r = cli("dequantize", str(src), "-o", str(out))
    assert r.returncode == 1 and "infinite scale" in r.stderr and not out.exists()
    assert len(r.stderr.strip().splitlines()) == 1
    # Codes away from the zero point restore as ±inf (no NaN): refused all the same.
    q = fq.quantize(np.array([[1.0, -2.0, 5.0, 7.0]]), fq.QuantConfig.int8())
    fq.save(
        src,
        {
            "w": fq.QuantizedTensor(
                q.data, np.array([np.inf]), q.zero_points, q.shape, "float64", q.config
            )
        },
    )
    r = cli("dequantize", str(src), "-o", str(out))
    assert r.returncode == 1 and "infinite scale" in r.stderr and not out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_json_models_and_configs_are_not_read_from_endless_or_waiting_sources(tmp_path, model):
    pipe = tmp_path / "m.json"
    os.mkfifo(pipe)
    with pytest.raises(OSError, match="not a regular file"):
        fq.QuantizedModel.load(pipe)
    r = cli("inspect", str(pipe))
    assert r.returncode == 1 and "not a regular file" in r.stderr
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    with pytest.raises(OSError, match="not a regular file"):
        fq.QuantizedModel.load(zero)
    out = tmp_path / "o.json"
    r = cli("quantize", str(model), "-o", str(out), "--scheme", "ptq-int8", "--config", str(zero))
    assert r.returncode == 1 and "larger than" in r.stderr and not out.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_without_waiting_for_a_writer(tmp_path):
    pipe = tmp_path / "p.safetensors"
    os.mkfifo(pipe)
    with pytest.raises(OSError, match="not a regular file"):
        fq.load(pipe)
    for args in (("inspect", str(pipe)), ("dequantize", str(pipe), "-o", str(tmp_path / "o"))):
        r = cli(*args)  # a hang would end in the helper's timeout, failing the test
        assert r.returncode == 1 and "not a regular file" in r.stderr
    with pytest.raises(IsADirectoryError):
        fq.load(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_named_pipe_is_refused_without_being_opened(tmp_path):
    # Opening a FIFO, even to refuse it, released a writer blocked opening it: its
    # data then went into a pipe nobody read.
    import threading

    pipe = tmp_path / "p.json"
    os.mkfifo(pipe)
    writer = threading.Thread(target=lambda: pipe.write_bytes(b"{}"), daemon=True)
    writer.start()
    for load in (fq.load, fq.QuantizedModel.load):
        with pytest.raises(OSError, match=r"not a regular file \(a FIFO cannot be read\)"):
            load(pipe)
    writer.join(timeout=0.3)
    assert writer.is_alive(), "the FIFO was opened"
    assert pipe.read_bytes() == b"{}"  # a reader lets the writer go
    writer.join(timeout=30)
    with pytest.raises(OSError, match=r"\(a device cannot be read\)"):
        fq.load("/dev/null")


def test_percentile_survives_an_input_changed_by_another_thread():
    # Garbage in, garbage out is allowed when the input changes mid-call; a panic
    # (which `except Exception` misses) is not.
    import threading
    import time

    x = np.ones(1 << 21, np.float32)
    stop = threading.Event()

    def scribble():
        while not stop.is_set():
            x.fill(1000.0)
            x.fill(1.0)

    t = threading.Thread(target=scribble)
    t.start()
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for p in (0.5, 0.999):
                fq.compute_scale(x, 127.0, fq.Percentile(p))
            fq.dynamic_quantize_int8_per_row(x.reshape(16, -1), fq.Percentile(0.5))
    finally:
        stop.set()
        t.join()


def test_an_array_in_use_by_another_thread_is_named_in_the_error():
    import threading

    a = np.ones((4096, 1024), np.float32)
    s = np.ones(1024, np.float32)
    started, errors = threading.Event(), []

    def smooth_forever():
        started.set()
        for _ in range(200):
            try:
                fq.smooth_activations(a, s)
            except ValueError as e:  # the other way round: a is being read
                errors.append(str(e).replace("a is in use", "x is in use", 1))

    t = threading.Thread(target=smooth_forever)
    t.start()
    started.wait()
    for _ in range(200):
        try:
            fq.quantize_blockwise(a)
        except ValueError as e:
            errors.append(str(e))
    t.join()
    # Whether the calls overlapped depends on timing; when they did, the message says why.
    for text in errors:
        assert text.startswith("x is in use by another ferroquant call"), text


def test_calib_stats_stream_crowded_values_without_copying_them():
    # A constant batch used to keep every value as a p99 candidate (1.5x its own
    # size at the peak); values equal to the threshold are now counted instead.
    r = run_python(
        textwrap.dedent(
            """
            import resource, numpy as np, ferroquant as fq
            x = np.full(1 << 24, -2.5, np.float32)  # 64 MiB
            y = np.float32(1.0) + np.arange(1 << 24, dtype=np.float32) % 1000 * 2e-6
            z = np.full(1 << 24, 7.0, np.float32)  # above every threshold so far
            fq.CalibStats.collect([x[:4096]])  # the pool and the module, warm
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            a = fq.CalibStats.collect([x])
            b = fq.CalibStats.collect(iter([x[: 1 << 23], x[1 << 23 :]]))
            c = fq.CalibStats.collect([y])
            d = fq.CalibStats.collect([x, y, z])
            e = fq.CalibStats.collect(iter([x, y, z]))
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024
            print(peak, a.p99, b.p99, c.p99 == np.sort(y)[int(np.ceil(0.99 * y.size)) - 1],
                  d.p99, e.p99)
            """
        )
    )
    assert r.returncode == 0, r.stderr
    peak, a, b, exact, d, e = r.stdout.split()
    assert (a, b, exact, d, e) == ("2.5", "2.5", "True", "7.0", "7.0")
    assert int(peak) < 32, f"{peak} MiB over 64 MiB batches"


def test_results_cannot_be_made_writable_and_unpickling_copies_caller_buffers():
    import copy
    import pickle

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    values = [
        fq.quantize(x),
        fq.quantize_blockwise(x),
        fq.dynamic_quantize_int8(x),
        fq.quantize_activations(x),
        fq.QuantizedWeights.from_f32("w", x),
        fq.BlockwiseQuantized(np.zeros(8, np.int8), np.ones(2, np.float32), (8,), 4),
    ]
    for q in values:
        for name in q._arrays:
            arr = getattr(q, name)
            if arr is not None:
                with pytest.raises(ValueError, match="WRITEABLE"):
                    arr.flags.writeable = True
        # Protocol 5 with buffers passed out of band: those are the caller's memory.
        buffers = []
        blob = pickle.dumps(q, protocol=5, buffer_callback=buffers.append)
        mutable = [bytearray(b.raw()) for b in buffers]
        clone = pickle.loads(blob, buffers=mutable)
        for m in mutable:
            m[:] = b"\x80" * len(m)
        assert clone == q, type(q).__name__
        assert pickle.loads(pickle.dumps(q)) == q
        # An array reachable elsewhere in what was loaded: the caller may own it,
        # and the loaded value must not be holding the same memory.
        name = q._arrays[0]
        loads = [copy.deepcopy((getattr(q, name), q))]
        loads += [pickle.loads(pickle.dumps((getattr(q, name), q), protocol=p)) for p in range(5)]
        for alias, loaded in loads:
            assert not np.shares_memory(alias, getattr(loaded, name)), type(q).__name__
            assert loaded == q


def test_unpickling_checks_the_fields_as_the_constructor_does():
    # A pickle is bytes from elsewhere: a corrupt one must not build a value that
    # dequantizes to garbage, or that saves a file `load` refuses.
    import pickle

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    nan = np.array([np.nan], np.float32)
    cases = [
        (fq.quantize_activations(x), {"scales": np.ones(1, np.float32)}, fq.ShapeMismatchError),
        (fq.quantize(x), {"scales": nan.astype(np.float64)}, fq.InvalidConfigError),
        (fq.quantize_blockwise(x), {"block_size": -1}, fq.InvalidConfigError),
        (fq.dynamic_quantize_int8(x), {"data": np.zeros(3, np.int8)}, fq.ShapeMismatchError),
        (fq.dynamic_quantize_int8(x), {"scales": [1.0]}, TypeError),
        (fq.QuantizedWeights.from_f32("w", x), {"weights_i8": np.ones(64, np.int16)}, TypeError),
        (fq.QuantizedWeights.from_f32("w", x), {"data": np.ones(64, np.int8)}, TypeError),
    ]
    for q, corrupt, error in cases:
        func, (cls, fields) = q.__reduce__()

        class Corrupt:
            def __reduce__(self, func=func, cls=cls, fields=fields, corrupt=corrupt):
                return (func, (cls, dict(fields, **corrupt)))

        blob = pickle.dumps(Corrupt())
        with pytest.raises(error):
            pickle.loads(blob)
        assert pickle.loads(pickle.dumps(q)) == q  # an intact pickle still loads


def test_unpickling_a_subclass_runs_none_of_its_own_construction_again():
    # The checks are ferroquant's class's: a subclass's __init__ (its own signature),
    # its init=False fields and its __post_init__ are not run on a restored value.
    import copy
    import pickle

    q = fq.dynamic_quantize_int8(np.ones((4, 6), np.float32))

    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class NoInit(fq.DynQuantTensor):
        n: int = dataclasses.field(default=5, init=False)

    class OwnInit(fq.DynQuantTensor):
        def __init__(self, x: np.ndarray) -> None:
            r = fq.dynamic_quantize_int8(x)
            super().__init__(r.data, r.scales, r.shape, r.format)

    @dataclasses.dataclass(frozen=True, eq=False, repr=False)
    class Counted(fq.DynQuantTensor):
        n: int = 0

        def __post_init__(self) -> None:
            super().__post_init__()
            object.__setattr__(self, "n", self.n + 1)

    values = [
        NoInit(q.data, q.scales, q.shape, q.format),
        OwnInit(np.ones(4, np.float32)),
        Counted(q.data, q.scales, q.shape, q.format),
    ]
    globals().update(NoInit=NoInit, OwnInit=OwnInit, Counted=Counted)  # picklable by name
    NoInit.__qualname__, OwnInit.__qualname__, Counted.__qualname__ = "NoInit", "OwnInit", "Counted"
    try:
        for v in values:
            for c in (copy.deepcopy(v), pickle.loads(pickle.dumps(v))):
                assert type(c) is type(v) and c == v
                assert getattr(c, "n", None) == getattr(v, "n", None)
        # And a corrupt field of ferroquant's is still refused in a subclass.
        func, (cls, fields) = values[2].__reduce__()
        with pytest.raises(fq.ShapeMismatchError):
            func(cls, dict(fields, data=np.zeros(3, np.int8)))
    finally:
        for name in ("NoInit", "OwnInit", "Counted"):
            globals().pop(name, None)


def test_an_interrupted_write_leaves_no_file_and_no_descriptor(tmp_path):
    def interrupted(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(KeyboardInterrupt):
            _format.write_file(tmp_path / "out.safetensors", interrupted)
    assert os.listdir(tmp_path) == []
    assert len(os.listdir("/proc/self/fd")) == fds


def test_a_signal_at_any_point_of_a_write_leaves_no_file_and_no_descriptor(tmp_path, monkeypatch):
    # An exception raised by a signal handler can come right after any call; the
    # temporary file's name is known before it exists, and no descriptor is held.
    import ferroquant.cli as cli_module

    fds = len(os.listdir("/proc/self/fd"))
    real_create = _format._create

    def create_then_interrupt(name):
        real_create(name)
        raise KeyboardInterrupt

    monkeypatch.setattr(_format, "_create", create_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fq.save(tmp_path / "a.safetensors", {"w": np.ones(4, np.float32)})
    monkeypatch.undo()
    real_chmod = os.chmod

    def chmod_then_interrupt(*a, **k):
        real_chmod(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(_format.os, "chmod", chmod_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fq.save(tmp_path / "b.safetensors", {"w": np.ones(4, np.float32)})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [] and len(os.listdir("/proc/self/fd")) == fds
    # Ctrl-C while the CLI installs its handlers: they are put back all the same.
    import signal

    real_signal = signal.signal
    calls = []

    def signal_then_interrupt(signum, handler):
        real_signal(signum, handler)
        calls.append(signum)
        if len(calls) == 2:
            raise KeyboardInterrupt

    # As they were: SIG_DFL, or ignored where the caller ignores them (a background
    # job's SIGQUIT, a nohup's SIGHUP), which main() leaves alone.
    before = {s: signal.getsignal(s) for s in cli_module._TERMINATING}
    monkeypatch.setattr(cli_module.signal, "signal", signal_then_interrupt)
    status = cli_module.main(["inspect", str(tmp_path / "missing.safetensors")])
    monkeypatch.undo()
    assert status == 130 and len(calls) >= 2  # two installed, then put back
    assert {s: signal.getsignal(s) for s in cli_module._TERMINATING} == before


def test_reprs_stay_short_whatever_the_name():
    name = "n" * 100_000
    for value in (
        fq.QuantizedWeights.from_f32(name, np.ones(2, np.float32)),
        fq.LayerCalibration(name, 0.0, 1.0, -1.0, 1.0),
        fq.quantize_model_weights("{}", [(name, np.ones(2, np.float32), None, None)]),
    ):
        assert len(repr(value)) < 200, type(value).__name__


def test_collect_takes_a_memoryview_as_one_array():
    x = np.arange(24, dtype=np.float32).reshape(4, 6) - 7
    assert fq.CalibStats.collect(memoryview(x)) == fq.CalibStats.collect(x)


def test_a_layers_argument_that_is_not_iterable_is_named():
    with pytest.raises(TypeError, match="layers must be an iterable"):
        fq.quantize_model_weights("{}", 5)


def test_real_numbers_of_every_kind_are_taken_alike():
    from decimal import Decimal
    from fractions import Fraction

    x = np.linspace(-3, 5, 101, dtype=np.float32)
    for half in (Fraction(1, 2), Decimal("0.5"), ml_dtypes.bfloat16(0.5), np.float16(0.5)):
        assert fq.Percentile(half) == fq.Percentile(0.5)
        assert fq.SmoothQuantConfig(half) == fq.SmoothQuantConfig(0.5)
        assert fq.compute_scale(x, half) == fq.compute_scale(x, 0.5)

    class SubFraction(Fraction):
        pass

    class SubDecimal(Decimal):
        pass

    # Just past 1 as given, though 1.0 as a float: out of range (subclasses too).
    f_above, d_above = Fraction(10**20 + 1, 10**20), Decimal("1.00000000000000000001")
    for above in (f_above, d_above, SubFraction(f_above), SubDecimal(d_above)):
        with pytest.raises(fq.InvalidConfigError, match="p must be in"):
            fq.Percentile(above)
        with pytest.raises(fq.InvalidConfigError, match="alpha must be in"):
            fq.SmoothQuantConfig(above)
    for nan in (Decimal("NaN"), Decimal("sNaN")):
        with pytest.raises(fq.InvalidConfigError):
            fq.SmoothQuantConfig(nan)
        with pytest.raises(fq.InvalidConfigError):
            fq.Percentile(nan)
    for odd in (True, np.timedelta64(1), "0.5", None):
        with pytest.raises(fq.InvalidConfigError, match="p must be a real number"):
            fq.Percentile(odd)
        with pytest.raises(TypeError, match="clip_val must be a real number"):
            fq.compute_scale(x, odd)


# --- found by the fourth adversarial review (the forward and W8A8 kernels) ---------------


def test_working_memory_that_cannot_be_had_is_memory_error():
    # Each call's output fits under the limit; the scratch memory the kernel then
    # needs (as large as the input or the output) does not. That aborted the
    # process ("memory allocation of N bytes failed"); an int4 activation whose
    # planes copy failed once took another path, with other bits.
    r = run_python(
        """
        import resource, numpy as np, ferroquant as fq
        def vm():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        AS, INF = resource.RLIMIT_AS, resource.RLIM_INFINITY
        def limited(name, call, headroom_mib):
            resource.setrlimit(AS, (vm() + headroom_mib * 2**20, INF))
            try:
                call()
                print(name, "ran")
            except MemoryError as e:
                # Ours, not NumPy's for the output: the scratch was what failed.
                print(name, "MemoryError", str(e).startswith("out of memory"))
            finally:
                resource.setrlimit(AS, (INF, INF))
        fq.set_output_cache(0)
        # Many tokens: the panel path's outputs (4 bytes a token) after the output.
        layer = fq.QuantizedLinear.from_linear(np.ones((1, 1), np.float32))
        x = np.ones((20_000_000, 1), np.float32)
        limited("panels", lambda: layer.forward(x), 100)
        # A float64 weight past float32's range: every output summed in f64.
        layer = fq.QuantizedLinear.from_linear(np.full((1, 2), 1e40))
        x = np.ones((10_000_000, 2), np.float32)
        limited("exact", lambda: layer.forward(x), 120)
        # Float32 sums that overflow where the exact ones do not: redone in f64.
        layer = fq.QuantizedLinear.from_linear(np.ones((1, 4), np.float32))
        x = np.tile(np.array([3e38, 3e38, -3e38, -3e38], np.float32), (10_000_000, 1))
        limited("redo", lambda: layer.forward(x), 120)
        # W8A8 with many tokens: the per-token scales after the codes and the output.
        w = np.ones((1, 2), np.int8)
        s = np.ones(1, np.float32)
        x = np.ones((10_000_000, 2), np.float32)
        limited("w8a8", lambda: fq.w8a8_matmul(w, s, x), 60)
        # An int4 weight at batch 7: the activation's planes copy (56 MB).
        layer = fq.QuantizedLinear.from_linear(
            np.ones((29, 2_000_000), np.float32), None, fq.QuantConfig.int4_per_channel()
        )
        x = np.ones((7, 2_000_000), np.float32)
        want = layer.forward(x)
        limited("planes", lambda: layer.forward(x), 30)
        assert np.array_equal(layer.forward(x), want)
        print("done")
        """,
        env_extra={"FERROQUANT_NUM_THREADS": "1"},
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split("\n")
    for name in ("panels", "exact", "redo", "w8a8", "planes"):
        assert f"{name} MemoryError True" in lines, r.stdout + r.stderr[-2000:]
    assert "done" in lines
    assert "memory allocation" not in r.stderr


def test_calling_a_layer_runs_its_own_classes_forward():
    class ReLULinear(fq.QuantizedLinear):
        def forward(self, x):
            return np.maximum(super().forward(x), 0)

    layer = ReLULinear.from_linear(np.array([[-1.0, 0.0]], np.float32))
    x = np.array([1.0, 0.0], np.float32)
    assert layer.forward(x).tolist() == [0.0]
    assert layer(x).tolist() == [0.0]
    # The base class still calls straight through.
    base = fq.QuantizedLinear.from_linear(np.array([[-1.0, 0.0]], np.float32))
    assert base(x).tolist() == base.forward(x).tolist() == [-1.0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_an_empty_input_with_a_huge_dimension_round_trips(dtype):
    # NumPy allows (0, 2**60) for elements of 4 bytes or fewer: what quantize made
    # of such an input loads back, and a float64 one (past NumPy's limit) is refused.
    x = np.empty((0, 2**60), dtype)
    values = [
        fq.dynamic_quantize_int8(x),
        fq.quantize_activations(x, fq.BitNetConfig()),
        fq.quantize(x, fq.QuantConfig.int8()),
        fq.quantize_blockwise(x),
    ]
    for q in values:
        assert fq.load_bytes(fq.save_bytes({"q": q}))["q"] == q
        assert dataclasses.replace(q) == q  # rebuilt through the checks
    with pytest.raises(fq.ShapeMismatchError, match="larger than NumPy can represent"):
        dataclasses.replace(values[0], dtype="float64")


def test_quantized_activations_name_their_own_fields():
    q = fq.quantize_activations(np.ones((2, 4), np.float32), fq.BitNetConfig())
    with pytest.raises(fq.InvalidConfigError, match=r"^bits must be in 2\.\.8, got 9"):
        dataclasses.replace(q, bits=9)
    with pytest.raises(TypeError, match=r"^per_token must be a bool, got int"):
        dataclasses.replace(q, per_token=1)
    with pytest.raises(fq.InvalidConfigError, match=r"^activation_bits must be in 2\.\.8"):
        fq.BitNetConfig(9)


def test_a_read_only_file_system_is_named_as_open_would(tmp_path, monkeypatch):
    import errno

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly())
    with pytest.raises(OSError) as e:
        fq.save(tmp_path / "x.safetensors", {"x": np.ones(2, np.float32)})
    assert e.value.errno == errno.EROFS and "x.safetensors" in str(e.value)
    monkeypatch.setattr(os, "statvfs", lambda path: type("RW", (), {"f_flag": 0})())
    with pytest.raises(PermissionError):
        fq.save(tmp_path / "x.safetensors", {"x": np.ones(2, np.float32)})


def test_a_header_past_the_safetensors_limit_names_the_output(tmp_path):
    from ferroquant.serialization import StreamingWriter

    out = tmp_path / "big.safetensors"
    with pytest.raises(fq.FormatError, match=r"cannot write .*big\.safetensors.*header"):
        with StreamingWriter(out, {"note": "x" * 100_000_000}) as w:
            w.add("x", np.ones(2, np.float32))
    assert not out.exists()
    with pytest.raises(fq.FormatError, match=r"cannot write .*big\.safetensors.*header too large"):
        fq.save(out, {"x": np.ones(2, np.float32)}, {"note": "x" * 100_000_000})
    assert not out.exists()


def test_masked_values_are_refused_not_read():
    x = np.ma.masked_array(np.array([[1.0, 2.0], [3.0, 1e6]], np.float32), mask=[[0, 0], [0, 1]])
    calls = [
        ("x", lambda v: fq.dynamic_quantize_int8(v)),
        ("x", lambda v: fq.compute_scale(v, 127.0)),
        ("x", lambda v: fq.quantize(v)),
        ("x", lambda v: fq.quantize_activations(v, fq.BitNetConfig())),
        ("batches[0]", lambda v: fq.CalibStats.collect([v])),
    ]
    for arg, f in calls:
        with pytest.raises(TypeError, match=rf"^{re.escape(arg)} is a masked array"):
            f(x)
    # The same rows in a list (np.asarray would drop their masks), or deeper,
    # or in another sequence NumPy converts row by row.
    rows = (
        [x[0], x[1]],
        (x[0], x[1]),
        [[x[0]], [x[1]]],
        [x],
        collections.deque([x[0], x[1]]),
        collections.UserList([x[0], x[1]]),
        [collections.deque([x[0]]), (x[1],)],
    )
    for v in rows:
        for arg, f in calls:
            with pytest.raises(TypeError, match=rf"^{re.escape(arg)} holds a masked array"):
                f(v)
    # Nothing masked: the values are the array's own.
    clear = np.ma.masked_array(x.data, mask=False)
    assert fq.dynamic_quantize_int8(clear) == fq.dynamic_quantize_int8(x.data)
    rows = [clear[0], clear[1]]
    assert fq.dynamic_quantize_int8(rows) == fq.dynamic_quantize_int8(x.data)
    # Saved: safetensors has no masks, so masked values are refused, not stored.
    with pytest.raises(TypeError, match=r"^tensors\['m'\] is a masked array with masked"):
        fq.save_bytes({"m": x})
    assert fq.load_bytes(fq.save_bytes({"m": clear}))["m"].tolist() == x.data.tolist()
    # A structured masked array (one mask a field) is refused by its dtype, named.
    pairs = np.ma.masked_array(np.zeros(2, [("a", "f4"), ("b", "f4")]), mask=[(1, 0), (0, 0)])
    for v in (pairs, [pairs, pairs]):
        with pytest.raises(TypeError, match=r"^x must be a floating array"):
            fq.dynamic_quantize_int8(v)
    assert fq.dynamic_quantize_int8(np.ma.masked_array(x.data)) == fq.dynamic_quantize_int8(x.data)


def test_no_replace_holds_against_a_file_that_appears_while_writing(tmp_path):
    # -n is checked before a run, but a file can appear while the output is
    # written: it must not be replaced then either (a review: it was, by rename).
    out = tmp_path / "out.safetensors"

    def write(tmp):
        out.write_bytes(b"appeared meanwhile")
        with open(tmp, "wb") as f:
            f.write(b"ours")

    with pytest.raises(FileExistsError):
        _format.write_file(out, write, replace=False)
    assert out.read_bytes() == b"appeared meanwhile"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors"]
    fresh = tmp_path / "fresh.bin"
    _format.write_file(fresh, lambda tmp: open(tmp, "wb").write(b"new"), replace=False)
    assert fresh.read_bytes() == b"new"
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~_format._umask()
    # A dangling symbolic link (made after -n's first check, say) is not followed.
    link, target = tmp_path / "link.safetensors", tmp_path / "elsewhere"
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        _format.write_file(link, lambda tmp: open(tmp, "wb").write(b"ours"), replace=False)
    assert link.is_symlink() and not target.exists()
    # Without hard links (some file systems): an exclusive create claims the name.
    real_link = os.link

    def no_links(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    os.link = no_links
    try:
        with pytest.raises(FileExistsError):
            _format.write_file(out, write, replace=False)
        nl = tmp_path / "no-links.bin"
        _format.write_file(nl, lambda tmp: open(tmp, "wb").write(b"new"), replace=False)
        assert nl.read_bytes() == b"new"
    finally:
        os.link = real_link
    assert out.read_bytes() == b"appeared meanwhile"
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["fresh.bin", "link.safetensors", "no-links.bin", "out.safetensors"]
    # The default replaces, as before.
    _format.write_file(out, lambda tmp: open(tmp, "wb").write(b"ours"))
    assert out.read_bytes() == b"ours"


def test_an_empty_input_whose_float32_values_numpy_cannot_hold_is_refused():
    x = np.empty((0, 2**61), np.float16)  # an array; its float32 values would not be
    for f in (
        fq.quantize_blockwise,
        fq.dynamic_quantize_int8,
        lambda v: fq.quantize_activations(v, fq.BitNetConfig()),
        fq.quantize_ste,
    ):
        with pytest.raises(fq.ShapeMismatchError, match=r"^x \(0, 2305843009213693952\)"):
            f(x)
    with pytest.raises(fq.ShapeMismatchError, match=r"^w \(0, 2305843009213693952\)"):
        fq.QuantizedWeights.from_f32("w", x)


def test_smoothing_refuses_a_masked_array_with_masked_values():
    a = np.ma.masked_array(np.array([[1.0, np.nan]], np.float32), mask=[[0, 1]])
    with pytest.raises(TypeError, match=r"^a is a masked array"):
        fq.smooth_activations(a, np.ones(2, np.float32))
    assert np.isnan(a.data[0, 1]) and a.data[0, 0] == 1.0
    w = np.ma.masked_array(np.ones((1, 2), np.float32), mask=False)
    assert fq.smooth_weights(w, np.full(2, 2.0, np.float32)).data.tolist() == [[2.0, 2.0]]


_X64 = np.array([1.0, 1e39, 2.0])  # finite in float64, +inf in float32
_W8 = np.ones((2, 3), np.int8)


@pytest.mark.parametrize(
    "arg, call",
    [
        ("x", lambda: fq.dynamic_quantize_int8(_X64)),
        ("x", lambda: fq.compute_scale(_X64, 127.0)),
        ("x2d", lambda: fq.dynamic_quantize_int8_per_row(_X64.reshape(1, 3))),
        ("x", lambda: fq.quantize_activations(_X64.reshape(1, 3), fq.BitNetConfig())),
        ("x", lambda: fq.quantize_ste(_X64.reshape(1, 3))),
        ("x", lambda: fq.quantize_blockwise(_X64)),
        ("activations", lambda: fq.compute_smooth_factors(_X64.reshape(1, 3), np.ones((2, 3)))),
        ("w", lambda: fq.QuantizedWeights.from_f32("w", _X64)),
        ("bias", lambda: fq.QuantizedWeights.from_f32("w", np.ones((3, 1)), bias=_X64)),
        ("activation", lambda: fq.w8a8_matvec(_W8, np.ones(2, np.float32), _X64)),
        ("activations", lambda: fq.w8a8_matmul(_W8, np.ones(2, np.float32), _X64.reshape(1, 3))),
        ("x", lambda: fq.QuantizedLinear.from_linear(np.ones((2, 3), np.float32)).forward(_X64)),
        ("bias", lambda: fq.QuantizedLinear.from_linear(np.ones((3, 2)), _X64)),
        ("batches[1]", lambda: fq.CalibStats.collect([np.ones(2), _X64])),
        ("w", lambda: fq.Calibrator().record_layer("l", _X64)),
        ("original", lambda: fq.quantization_mae(_X64, fq.dynamic_quantize_int8(np.ones(3)))),
    ],
)
def test_a_float64_past_float32_is_named_as_such_not_as_nan_or_inf(arg, call):
    # SPEC: a value that becomes ±inf in float32 is non-finite input. The error said
    # the array held NaN or ±inf, which a float64 1e39 is not (two reviews).
    with pytest.raises(fq.NonFiniteError) as e:
        call()
    assert str(e.value).startswith(f"{arg} holds 1e+39"), str(e.value)
    assert "beyond float32's range" in str(e.value)
    assert e.value.index == (3 if arg == "batches[1]" else 1)
    # A true NaN keeps its words.
    with pytest.raises(fq.NonFiniteError, match=r"^x holds a non-finite value \(NaN or ±inf\)"):
        fq.dynamic_quantize_int8(np.array([1.0, np.nan]))


# --- found by the adversarial review of the twenty-sixth session -----------------------


def test_outputs_past_the_address_space_are_memory_errors_and_shapes_come_first():
    # Empty inputs whose dims NumPy cannot multiply out into an output: NumPy's own
    # "array is too big" ValueError named nothing of ours.
    with pytest.raises(MemoryError, match="more than memory can address"):
        fq.quantize(np.empty((2**60, 0), np.float32), fq.QuantConfig.int8_per_channel())
    with pytest.raises(MemoryError, match="more than memory can address"):
        fq.compute_smooth_factors(np.empty((0, 2**61), np.float16), np.empty((0, 2**61), "e"))
    w = np.ones((2, 3), np.float32)
    with pytest.raises(fq.ShapeMismatchError, match=r"^s: expected shape \(3,\)"):
        fq.smooth_weights(w, np.empty((0, 2**61), np.float16))  # checked before converting
    assert (w == 1).all()
    lin = fq.QuantizedLinear.from_linear(np.ones((16, 3), np.float32))
    with pytest.raises(fq.ShapeMismatchError, match=r"^x: the result's shape"):
        lin.forward(np.empty((2**59, 0, 3), np.float32))
    assert lin.forward(np.empty((5, 0, 3), np.float32)).shape == (5, 0, 16)


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # np.matrix
def test_a_subclass_is_read_as_the_array_its_memory_holds():
    class Liar(np.ndarray):
        shape = property(lambda self: (4, 4))  # type: ignore[assignment]

    x = np.arange(12, dtype=np.float32).view(Liar)
    q = fq.quantize_blockwise(x)
    assert q.shape == (12,) and q == fq.quantize_blockwise(np.arange(12, dtype=np.float32))
    np.testing.assert_array_equal(q.dequantize().shape, (12,))
    with pytest.raises(fq.InvalidConfigError, match="got 1-D shape"):
        fq.quantize_activations(x)
    m = np.matrix(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert fq.quantize_blockwise(m).dequantize().shape == (2, 3)
    assert type(fq.dynamic_quantize_int8_per_row(m).dequantize()) is np.ndarray
