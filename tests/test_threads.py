"""Threads: the pool, thread-count independence, GIL release, fork, environment."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import pytest
from helpers import run_python

import ferroquant as fq


def test_set_and_get_num_threads(restore_threads):
    fq.set_num_threads(1)
    assert fq.get_num_threads() == 1
    fq.set_num_threads(3)
    assert fq.get_num_threads() == 3
    with pytest.raises(fq.InvalidConfigError, match="n must be an integer >= 1"):
        fq.set_num_threads(0)
    with pytest.raises(TypeError):
        fq.set_num_threads(2.0)  # type: ignore[arg-type]
    assert fq.get_num_threads() == 3


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_results_do_not_depend_on_thread_count(restore_threads, rng, dtype):
    # Large enough that both kernels use the pool (dequantize from ~2 Mi elements).
    x = (rng.standard_normal(3_000_007) * 5).astype(dtype)
    results = []
    for n in (1, 2, 3):
        fq.set_num_threads(n)
        q = fq.quantize_blockwise(x, 48)
        results.append((q, fq.dequantize_blockwise(q).tobytes()))
    assert results[0] == results[1] == results[2]


def test_streamed_outputs_match_the_reference_and_the_pool(restore_threads, rng):
    """Outputs of 8 MiB or more take streaming stores on one thread (fenced once
    per call, not per row) and cached ones on the pool: both are bit-identical,
    and equal to the NumPy ports. Rows of 4100 values, so each row's codes start
    at a different offset in a cache line and every row has a masked head."""
    from ferroquant._reference import affine as ref_affine
    from ferroquant._reference import dynamic as ref_dynamic

    x = (rng.standard_normal((2049, 4100)) * 3).astype(np.float32)
    x[:, 7] *= 40  # outlier channels, as real activations have
    configs = [
        fq.QuantConfig.int8_per_channel(),
        fq.QuantConfig.int8_per_channel().asymmetric(),
        fq.QuantConfig.int8(),
        fq.QuantConfig.int4_per_channel().asymmetric(),
    ]
    runs = []
    for n in (1, 2):
        fq.set_num_threads(n)
        row = fq.dynamic_quantize_int8_per_row(x)
        dyn = fq.dynamic_quantize_int8(x)
        runs.append([row, dyn] + [fq.quantize(x, c) for c in configs])
    assert runs[0] == runs[1]
    row, dyn, pc, pca, pt, pc4 = runs[0]
    picks = [0, 1, 2, 1023, 2047, 2048]
    codes, scales = ref_dynamic.dynamic_quantize(x[picks], "int8_per_row")
    np.testing.assert_array_equal(row.values()[picks].ravel(), codes)
    np.testing.assert_array_equal(np.asarray(row.scales)[picks], scales)
    codes, scales = ref_dynamic.dynamic_quantize(x, "int8_per_tensor")
    np.testing.assert_array_equal(dyn.values().ravel(), codes)
    for q, mode in ((pc, "symmetric"), (pca, "asymmetric")):
        codes, scales, zps = ref_affine.quantize_affine(x[picks], 8, mode, "per_channel")
        np.testing.assert_array_equal(np.asarray(q.data).reshape(x.shape)[picks].ravel(), codes)
        np.testing.assert_array_equal(np.asarray(q.scales)[picks], scales)
        np.testing.assert_array_equal(np.asarray(q.zero_points)[picks], zps)
    codes, scales, zps = ref_affine.quantize_affine(x, 8, "symmetric", "per_tensor")
    np.testing.assert_array_equal(np.asarray(pt.data).ravel(), codes)
    packed, scales, zps = ref_affine.quantize_affine(x[picks], 4, "asymmetric", "per_channel")
    row_bytes = x.shape[1] // 2
    got = np.asarray(pc4.data).reshape(x.shape[0], row_bytes)[picks].ravel()
    np.testing.assert_array_equal(got, packed)
    np.testing.assert_array_equal(np.asarray(pc4.zero_points)[picks], zps)


def test_kernels_release_the_gil(restore_threads):
    """While one thread sits in a long kernel call, a pure-Python thread keeps running.

    The pure-Python thread timestamps its iterations. A kernel that held the GIL
    would leave none in the middle half of any call (the spinner can only run
    just before a call starts or after it ends); one that releases it leaves
    them there whenever the OS gives the spinner a core. Only the order of
    timestamps is used, never a duration: an earlier version compared the
    largest gap with a call's duration measured beforehand, and failed once on a
    machine whose load changed in between. Python's switch interval is made
    short so the spinner gets the GIL promptly.
    """
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        _check_gil_released()
    finally:
        sys.setswitchinterval(old_interval)


def _check_gil_released() -> None:
    fq.set_num_threads(1)
    x = np.random.default_rng(0).standard_normal(24_000_000).astype(np.float32)
    fq.quantize_blockwise(x)  # warm up: pool, page faults
    stop = threading.Event()
    stamps = []

    def spin():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    calls = []
    try:
        for _ in range(12):
            t0 = time.perf_counter()
            fq.quantize_blockwise(x)
            calls.append((t0, time.perf_counter()))
    finally:
        stop.set()
        spinner.join()
    at = np.array(stamps)
    inside = [
        int(np.count_nonzero((at > a + (b - a) / 4) & (at < b - (b - a) / 4))) for a, b in calls
    ]
    assert max(inside) > 0, (inside, len(stamps))


def test_thread_env_sets_the_pool_size():
    out = run_python(
        "import ferroquant as fq; print(fq.get_num_threads())",
        {"FERROQUANT_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"


def test_bad_thread_env_warns_and_falls_back():
    out = run_python(
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n import ferroquant\nexcept RuntimeWarning as w: print('warned', w)",
        {"FERROQUANT_NUM_THREADS": "lots"},
    )
    assert "warned" in out.stdout and "FERROQUANT_NUM_THREADS" in out.stdout


_AFFINITIES = """
    import json, os, time
    if os.environ.get("BIND") is None:
        os.environ.pop("FERROQUANT_BIND_THREADS", None)  # the default
    else:
        os.environ["FERROQUANT_BIND_THREADS"] = os.environ["BIND"]
    import numpy as np, ferroquant as fq
    cpus = sorted(os.sched_getaffinity(0))
    fq.set_num_threads(len(cpus) + int(os.environ["EXTRA"]))
    fq.dequantize_blockwise(fq.quantize_blockwise(np.ones(1 << 21, np.float32)))

    def workers():
        masks = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    name = f.read().strip()
                if name.startswith("ferroquant-"):
                    masks[int(name.split("-")[1])] = sorted(os.sched_getaffinity(int(tid)))
            except OSError:
                pass
        return [masks[i] for i in sorted(masks)]

    # A worker names itself, then binds itself, when it first runs, which may be
    # after the call returns: wait (up to 10 s) until every worker shows a single
    # CPU, or stop early once all are named if binding is not expected.
    expect_bound = os.environ.get("BIND") != "0" and int(os.environ["EXTRA"]) == 0
    want = len(cpus) + int(os.environ["EXTRA"])
    want = want if want >= 2 else 0
    for _ in range(1000):
        masks = workers()
        if len(masks) == want and (not expect_bound or want < 2 or all(len(m) == 1 for m in masks)):
            break
        time.sleep(0.01)
    print(json.dumps([cpus, masks, sorted(os.sched_getaffinity(0))]))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux binding only")
@pytest.mark.parametrize("bind, extra", [(None, 0), ("1", 0), ("0", 0), (None, 1)])
def test_workers_are_bound_to_cpus_when_the_pool_covers_them(bind, extra):
    # One worker per allowed CPU: worker i runs on CPU i only. Binding off, or a
    # pool of another size: every worker keeps the whole mask. The caller's mask
    # is never changed.
    env = {"EXTRA": str(extra)}
    if bind is not None:
        env["BIND"] = bind
    r = run_python(_AFFINITIES, env_extra=env)
    assert r.returncode == 0, r.stderr
    cpus, masks, caller = json.loads(r.stdout)
    assert caller == cpus
    threads = len(cpus) + extra
    assert len(masks) == (threads if threads >= 2 else 0)  # one thread: no pool
    if bind != "0" and extra == 0 and len(cpus) >= 2:
        assert masks == [[c] for c in cpus]
    else:
        assert all(m == cpus for m in masks)


@pytest.mark.parametrize(
    "name, value",
    [
        ("FERROQUANT_BIND_THREADS", "yes"),
        ("FERROQUANT_BIND_THREADS", "\udcff"),  # the byte 0xff: not UTF-8
        ("FERROQUANT_BIND_THREADS", "x" * 100_000),
        ("FERROQUANT_NUM_THREADS", "\udcff"),
        ("FERROQUANT_SIMD", "\udcff"),
        ("FERROQUANT_SIMD", "x" * 100_000),
    ],
)
def test_bad_env_values_warn_once_in_one_short_line(name, value):
    out = run_python(
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        " warnings.simplefilter('always')\n"
        " import ferroquant\n"
        "print(len(w)); print(w[0].category.__name__); print(w[0].message)",
        {name: value},
    )
    assert out.returncode == 0, out.stderr
    count, category, message = out.stdout.strip().split("\n")
    assert (count, category) == ("1", "RuntimeWarning")
    assert name in message and "ignored" in message and len(message) < 200, message


def test_forked_child_gets_its_own_pool():
    code = """
        import os, sys
        import numpy as np, ferroquant as fq
        fq.set_num_threads(2)
        x = np.random.default_rng(1).standard_normal(2_000_000).astype(np.float32)
        want = fq.quantize_blockwise(x)          # the parent's pool now exists
        pid = os.fork()
        if pid == 0:
            ok = fq.quantize_blockwise(x) == want and fq.get_num_threads() == 2
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        print("parent", fq.quantize_blockwise(x) == want)
    """
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "0", "parent", "True"]


@pytest.mark.parametrize("threads", [1, 2])
def test_daemon_threads_inside_kernels_at_exit_do_not_abort_the_process(threads):
    """Before Python 3.14 a thread that re-takes the GIL while the interpreter
    finalizes is ended by a forced unwind, which through a kernel's frames
    aborted the process ("FATAL: exception not rethrown", status 134). Such
    threads now park instead, and the program's own exit status stands. An
    atexit handler of the main thread (registered before the import, so it
    runs after ours) still gets its kernel's result."""
    code = f"""
        import atexit, sys, threading
        import numpy as np

        def last_words():
            print("atexit", fq.quantize_blockwise(np.ones(100, np.float32)).data[0])

        atexit.register(last_words)
        import ferroquant as fq
        fq.set_num_threads({threads})
        x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
        bad = x.copy()
        bad[7] = np.nan

        def spin(i):
            while True:
                if i == 0:
                    try:
                        fq.quantize_blockwise(bad)   # its error is built by Python code
                    except fq.NonFiniteError:
                        pass
                else:
                    fq.dequantize_blockwise(fq.quantize_blockwise(x))

        for i in range(4):
            threading.Thread(target=spin, args=(i,), daemon=True).start()
        print("exiting", flush=True)
        sys.exit(3)
    """
    for _ in range(4):
        out = run_python(code, timeout=60)
        assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
        assert out.stdout.split() == ["exiting", "atexit", "127"], out.stdout
        assert "FATAL" not in out.stderr, out.stderr


def test_racing_first_calls_build_one_pool():
    """Threads whose first large call races the others used to build a whole pool
    each (all but one thrown away): 32 callers at 64 threads peaked at up to 762
    OS threads. One builds now; the others run that call on their own thread."""
    code = """
        import os, threading, time
        import numpy as np, ferroquant as fq
        x = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float32)
        want = fq.quantize_blockwise(x)
        fq.set_num_threads(64)
        go = threading.Barrier(33)
        peak, done, same = [0], threading.Event(), []
        def call():
            go.wait()
            same.append(fq.quantize_blockwise(x) == want)
        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], len(os.listdir("/proc/self/task")))
                time.sleep(0.0002)
        w = threading.Thread(target=watch)
        w.start()
        ts = [threading.Thread(target=call) for _ in range(32)]
        for t in ts:
            t.start()
        go.wait()
        for t in ts:
            t.join()
        done.set()
        w.join()
        print(peak[0], all(same) and len(same) == 32)
    """
    for _ in range(3):
        out = run_python(code, timeout=120)
        assert out.returncode == 0, out.stderr
        peak, ok = out.stdout.split()
        assert ok == "True"
        # 32 callers, the watcher, main and one pool of 64 (and a little slack).
        assert int(peak) <= 32 + 2 + 64 + 4, peak


def test_multiprocessing_fork_pool_works():
    code = """
        import multiprocessing as mp
        import numpy as np, ferroquant as fq

        def work(seed):
            x = np.random.default_rng(seed).standard_normal(300_000).astype(np.float32)
            return fq.quantize_blockwise(x).data.sum(dtype=np.int64)

        if __name__ == "__main__":
            fq.set_num_threads(2)
            work(0)
            with mp.get_context("fork").Pool(2) as p:
                got = p.map(work, range(4))
            print(got == [work(s) for s in range(4)])
    """
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_scalar_path_matches_the_detected_isa(tmp_path, rng):
    """FERROQUANT_SIMD=scalar forces the portable kernels; results are identical."""
    x = (rng.standard_normal(200_003) * 3).astype(np.float32)
    x[::7] = np.round(x[::7]) + 0.5  # rounding ties
    np.save(tmp_path / "x.npy", x)
    code = f"""
        import numpy as np, ferroquant as fq
        x = np.load({str(tmp_path / "x.npy")!r})
        q = fq.quantize_blockwise(x, 33)
        np.savez({str(tmp_path / "out.npz")!r}, d=q.data, s=q.scales, y=fq.dequantize_blockwise(q))
        print(fq.simd_isa())
    """
    out = run_python(code, {"FERROQUANT_SIMD": "scalar"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"
    got = np.load(tmp_path / "out.npz")
    q = fq.quantize_blockwise(x, 33)
    assert got["d"].tobytes() == q.data.tobytes()
    assert got["s"].tobytes() == q.scales.tobytes()
    assert got["y"].tobytes() == fq.dequantize_blockwise(q).tobytes()


def test_only_ferroquants_own_pool_ever_runs_threads():
    # Small calls stay on the calling thread and start no thread at all (rayon's
    # global pool included); a large call starts exactly the configured pool.
    r = run_python(
        """
        import os, numpy as np, ferroquant as fq
        threads = lambda: len(os.listdir("/proc/self/task"))
        small = np.linspace(-1, 1, 1000, dtype=np.float32).reshape(10, 100)
        for c in [fq.QuantConfig(b, m, g) for b in (8, 4) for m in ("symmetric", "asymmetric")
                  for g in ("per_tensor", "per_channel")]:
            fq.dequantize(fq.quantize(small, c))
        fq.dequantize_blockwise(fq.quantize_blockwise(small))
        print(threads())
        big = np.ones((2048, 2048), np.float32)
        fq.dequantize(fq.quantize(big, fq.QuantConfig.int4_per_channel()))
        fq.dequantize(fq.quantize(big.reshape(-1)))
        fq.dequantize_blockwise(fq.quantize_blockwise(big))
        print(threads())
        """,
        env_extra={
            "FERROQUANT_NUM_THREADS": "2",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        },
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "3"], r.stdout


def test_a_value_made_nan_during_calib_collect_is_reported_as_non_finite():
    # Another thread flips one value to NaN and back while collect reads the
    # batch (a data race on the caller's array): each call either sees a
    # finite batch or raises NonFiniteError naming that value. collect reads a
    # chunk more than once; a NaN arriving after the first read once reached
    # the sums and surfaced as "InvalidConfigError: mean must be finite", and
    # one gone again by the rescan was reported at the next chunk's start.
    x = np.ones(1 << 20, np.float32)
    stop = threading.Event()

    def toggle() -> None:
        while not stop.is_set():
            x[123457] = np.nan
            x[123457] = 1.0

    t = threading.Thread(target=toggle)
    t.start()
    outcomes = set()
    try:
        for _ in range(200):
            try:
                s = fq.CalibStats.collect([x])
                assert (s.min, s.max, s.mean, s.p99) == (1.0, 1.0, 1.0, 1.0)
                outcomes.add("ok")
            except fq.NonFiniteError as e:
                # The index of the value that was NaN, not a guess past it.
                assert e.index == 123457
                outcomes.add("non-finite")
    finally:
        stop.set()
        t.join()
    assert outcomes <= {"ok", "non-finite"}
