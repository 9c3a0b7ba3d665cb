"""Recycled output buffers (``fq.set_output_cache``): a buffer is reused only when
nothing references it, is overwritten whole, and never changes a live result."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
from helpers import run_python

import ferroquant as fq
from ferroquant import _ferroquant as native

N = 1 << 20  # 1 Mi elements: 1 MiB of int8 codes and 4 MiB of float32, both cached


def own_memory(a: np.ndarray) -> bool:
    """Whether ``a`` is (a reshape of) an array that NumPy allocated for it,
    rather than a view of one of the cache's byte buffers."""
    while a.base is not None:
        a = a.base
    return a.dtype != np.uint8


def poison(buf: np.ndarray) -> None:
    """Fill a cache buffer (read-only while handed out) with a recognisable pattern."""
    buf.setflags(write=True)
    buf[...] = 0x55
    buf.setflags(write=False)


def address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@pytest.fixture(autouse=True)
def empty_cache():
    old = fq.get_output_cache()
    fq.set_output_cache(0)  # let go of buffers earlier tests left
    fq.set_output_cache(256 << 20)
    yield
    fq.set_output_cache(old)


@pytest.fixture
def pair(rng):
    x1 = rng.standard_normal(N).astype(np.float32)
    x2 = (rng.standard_normal(N) * 5).astype(np.float32)
    return fq.quantize(x1), fq.quantize(x2)


def test_a_dropped_result_is_reused_and_overwritten_whole(pair):
    q1, q2 = pair
    expect = fq.dequantize(q2).copy()
    a = fq.dequantize(q1)
    a[...] = np.nan  # poison the buffer
    where = address(a)
    assert not own_memory(a)
    del a
    b = fq.dequantize(q2)
    assert address(b) == where  # the same memory, handed out again
    np.testing.assert_array_equal(b, expect)


def test_dropped_codes_are_reused_and_overwritten_whole(rng):
    x1, x2 = rng.standard_normal((2, N)).astype(np.float32)
    for config in (fq.QuantConfig.int8(), fq.QuantConfig.int8_per_channel().asymmetric()):
        shape = (1024, N // 1024)
        expect = fq.quantize(x2.reshape(shape), config).data.copy()
        q1 = fq.quantize(x1.reshape(shape), config)
        poison(q1.data.base)  # the buffer behind the read-only codes
        where = address(q1.data)
        del q1
        q2 = fq.quantize(x2.reshape(shape), config)
        assert address(q2.data) == where
        np.testing.assert_array_equal(q2.data, expect)
    y = rng.standard_normal(N).astype(np.float32)
    b1 = fq.quantize_blockwise(y)
    codes = b1.data.copy()
    poison(b1.data.base)
    del b1
    np.testing.assert_array_equal(fq.quantize_blockwise(y).data, codes)


def test_live_results_views_and_memoryviews_are_never_reused(pair):
    q1, q2 = pair
    e1, e2 = fq.dequantize(q1).copy(), fq.dequantize(q2).copy()
    a = fq.dequantize(q1)
    b = fq.dequantize(q2)
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, e1)
    view = a[::3]
    del a
    c = fq.dequantize(q2)
    assert not np.shares_memory(view, c)
    np.testing.assert_array_equal(view, e1[::3])
    m = memoryview(b)
    del b
    d = fq.dequantize(q1)
    np.testing.assert_array_equal(np.asarray(m), e2)
    np.testing.assert_array_equal(d, e1)


def test_codes_held_by_a_dataclass_are_never_reused(rng):
    xs = rng.standard_normal((4, N)).astype(np.float32)
    held = [fq.quantize(x) for x in xs]
    copies = [q.data.copy() for q in held]
    for x in xs[::-1]:
        fq.quantize(x)
    for q, c in zip(held, copies, strict=True):
        np.testing.assert_array_equal(q.data, c)
    addresses = {address(q.data) for q in held}
    assert len(addresses) == len(held)


def int4(n_bytes_out: int) -> fq.QuantizedTensor:
    """A tensor whose float32 dequantization is ``n_bytes_out`` bytes and whose
    packed codes (an eighth of that) are too small to be cached."""
    return fq.quantize(np.ones(n_bytes_out // 4, np.float32), fq.QuantConfig.int4())


def test_capacity_bounds_what_is_kept():
    q = int4(4 * N)
    assert native.output_cache_usage() == (0, 0, 0)
    fq.dequantize(q)
    assert native.output_cache_usage() == (1, 4 * N, 4 * N)
    fq.set_output_cache(3 * N)  # below the free 4 MiB buffer: let go of it
    assert native.output_cache_usage() == (0, 0, 0)
    y = fq.dequantize(q)
    assert native.output_cache_usage() == (0, 0, 0)  # too large to keep
    assert own_memory(y)
    fq.set_output_cache(0)
    assert fq.get_output_cache() == 0
    small = fq.dequantize(fq.quantize(np.ones(1000, np.float32)))
    assert own_memory(small)  # small outputs are never cached


def test_in_use_buffers_leave_the_cache_when_it_shrinks(pair):
    q1, q2 = pair
    e1 = fq.dequantize(q1).copy()
    a = fq.dequantize(q1)
    fq.set_output_cache(0)
    assert native.output_cache_usage() == (0, 0, 0)
    fq.set_output_cache(256 << 20)
    b = fq.dequantize(q2)
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, e1)


def test_a_miss_evicts_the_least_recently_used_free_buffers():
    fq.set_output_cache(10 * N)
    qs = {k: int4(k * N) for k in (2, 3, 4, 5)}
    for k in (2, 3, 4):  # three free buffers: 9 MiB of 10
        fq.dequantize(qs[k])
    assert native.output_cache_usage() == (3, 9 * N, 9 * N)
    fq.dequantize(qs[2])  # a hit: 2 MiB is now the most recently used
    assert native.output_cache_usage() == (3, 9 * N, 9 * N)
    kept = fq.dequantize(qs[5])  # needs 5: evicts 3 (oldest), then 4
    assert native.output_cache_usage() == (2, 7 * N, 2 * N)
    del kept
    assert native.output_cache_usage() == (2, 7 * N, 7 * N)


def test_output_cache_arguments_are_checked():
    with pytest.raises(TypeError, match="max_bytes"):
        fq.set_output_cache(1.5)
    with pytest.raises(TypeError, match="max_bytes"):
        fq.set_output_cache(True)
    with pytest.raises(fq.InvalidConfigError, match="max_bytes"):
        fq.set_output_cache(-1)
    with pytest.raises(fq.InvalidConfigError, match="max_bytes"):
        fq.set_output_cache(2**64)


def test_threads_never_share_a_live_buffer(rng):
    qs = [fq.quantize(rng.standard_normal(N).astype(np.float32) * (k + 1)) for k in range(4)]
    expect = [fq.dequantize(q).copy() for q in qs]
    failures = []

    def work(k: int) -> None:
        for _ in range(25):
            y = fq.dequantize(qs[k])
            if not np.array_equal(y, expect[k]):
                failures.append(k)
            y[...] = -1.0  # scribble: must never reach another thread's result

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_a_forked_child_keeps_the_parents_results():
    code = """
import os
import numpy as np
import ferroquant as fq
x = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)
q1, q2 = fq.quantize(x), fq.quantize(x * 3)
e1, e2 = fq.dequantize(q1).copy(), fq.dequantize(q2).copy()
a = fq.dequantize(q1)
fq.dequantize(q2)  # a free buffer of the same size, inherited by the child
pid = os.fork()
if pid == 0:
    ok = all(np.array_equal(fq.dequantize(q2), e2) for _ in range(3))
    ok = ok and np.array_equal(a, e1)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert np.array_equal(a, e1)
print("ok")
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_results_are_correct_with_the_cache_off(pair):
    q1, q2 = pair
    expect = fq.dequantize(q2).copy()
    fq.set_output_cache(0)
    a = fq.dequantize(q1)
    a[...] = np.nan
    del a
    gc.collect()
    np.testing.assert_array_equal(fq.dequantize(q2), expect)


def test_buffers_are_read_only_while_handed_out(rng):
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    q = fq.quantize(x)
    assert not q.data.flags.writeable and not q.data.base.flags.writeable
    with pytest.raises(ValueError):
        q.data.base[0] = 1
    y = fq.dequantize(q)
    assert y.flags.writeable and not y.base.flags.writeable
    y[0, 0] = 42.0  # the caller's result stays writable
    # A cache buffer may back a writable output too: rebuilding a value copies it.
    again = dataclasses.replace(q)
    assert again == q and not np.shares_memory(again.data, q.data)


def test_a_weakly_referenced_buffer_is_let_go_of_not_reused(pair):
    q1, q2 = pair
    e2 = fq.dequantize(q2).copy()
    a = fq.dequantize(q1)
    watched = weakref.ref(a.base)
    finalized = []
    weakref.finalize(a.base, finalized.append, True)
    del a
    b = fq.dequantize(q2)
    assert watched() is None and finalized == [True]
    np.testing.assert_array_equal(b, e2)


def test_a_slightly_larger_free_buffer_is_reused():
    big = int4(4 * N)
    a = fq.dequantize(big)
    where = address(a)
    del a
    smaller = fq.quantize(np.full(int(0.9 * N), 2.0, np.float32), fq.QuantConfig.int4())
    b = fq.dequantize(smaller)
    assert address(b) == where and b.shape == (int(0.9 * N),)
    np.testing.assert_array_equal(b, np.full(b.shape, 2.0, np.float32))
    del b
    much_smaller = fq.quantize(np.ones(int(0.7 * N), np.float32), fq.QuantConfig.int4())
    assert address(fq.dequantize(much_smaller)) != where


def test_a_larger_buffer_shows_nothing_of_its_last_result_past_the_view():
    # The rest of a reused larger buffer held a dropped result: reachable through
    # `.base`, it must not show that result's values (an adversarial review).
    a = fq.dequantize(fq.quantize(np.full(N, 42.0, np.float32), fq.QuantConfig.int4()))
    where = address(a)
    del a
    b = fq.dequantize(fq.quantize(np.ones(int(0.9 * N), np.float32), fq.QuantConfig.int4()))
    assert address(b) == where
    root = b
    while root.base is not None:
        root = root.base
    assert root.dtype == np.uint8
    start = address(b) - address(root)
    assert root.nbytes >= start + 4 * N
    # Nothing outside the view: not the dropped result's tail, not the slack.
    assert not root[:start].any() and not root[start + b.nbytes :].any()
    np.testing.assert_array_equal(b, np.ones(b.shape, np.float32))


def test_memory_error_releases_free_buffers_and_retries():
    code = """
import resource
import numpy as np
import ferroquant as fq
from ferroquant import _ferroquant as native
M = 1 << 20
for k in range(4):  # free buffers of 84-96 MiB, as many as fit in 256 MiB
    fq.dequantize(fq.quantize(np.ones((21 + k) * M // 4 * 4, np.float32), fq.QuantConfig.int4()))
assert native.output_cache_usage()[2] > 150 * M, native.output_cache_usage()
q = fq.quantize(np.ones(12 * M, np.float32), fq.QuantConfig.int4())
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + 40 * M, resource.RLIM_INFINITY))
y = fq.dequantize(q)  # 48 MiB: only fits once the free buffers are released
assert y.shape == (12 * M,) and float(y[0]) == 1.0
print("ok")
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_without_room_for_the_padding_an_output_is_allocated_at_its_size():
    # Outputs of 2 MiB or more ask for up to 4 MiB more, to start on a huge-page
    # boundary; a MemoryError for that alone must not fail the call.
    code = """
import resource
import numpy as np
import ferroquant as fq
M = 1 << 20
n = M // 2 + 1  # 2 MiB + 4 bytes of float32: 6 MiB asked for with the padding
q = fq.quantize(np.ones(n, np.float32), fq.QuantConfig.int4())
fq.dequantize(q)  # whatever a first call sets up
fq.set_output_cache(0)  # nothing cached to let go of: only the padding does not fit
fq.set_output_cache(256 * M)
vm = int(open("/proc/self/statm").read().split()[0]) * 4096
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * M + 256 * 1024, resource.RLIM_INFINITY))
y = fq.dequantize(q)
assert y.shape == (n,) and float(y[0]) == 1.0 and float(y[-1]) == 1.0
print("ok", y.__array_interface__["data"][0] % (2 * M) == 0)
"""
    r = run_python(code, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok False", (r.stdout, r.stderr)


def test_a_replaced_getrefcount_turns_the_cache_off():
    code = """
import sys
sys.getrefcount = lambda o: 1
import numpy as np
import ferroquant as fq
M = 1 << 20
q1, q2 = fq.quantize(np.ones(M, np.float32)), fq.quantize(np.full(M, 3, np.float32))
a, b = fq.dequantize(q1), fq.dequantize(q2)
assert not np.shares_memory(a, b) and a[0] == 1.0 and b[0] == 3.0
assert fq.get_output_cache() == 0
print("ok")
"""
    r = run_python(code, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.parametrize("n", [N // 2, N, 3 * N + 5])  # 2, 4 and 12 MiB of float32
def test_large_outputs_start_on_a_huge_page_boundary(n):
    # NumPy's allocation starts 16 bytes past a 4 KiB page, so only the 2 MiB blocks
    # wholly inside it get transparent huge pages; outputs of 2 MiB or more start on
    # a boundary, so all of theirs can (and a weight streams faster from them).
    x = np.linspace(-3, 3, n, dtype=np.float32)
    q = fq.quantize(x)
    y = fq.dequantize(q)
    assert address(y) % (2 << 20) == 0
    np.testing.assert_array_equal(y, fq.dequantize(q))
    assert native.output_cache_usage()[1] >= 4 * n  # counted at the view's size
    del y
    again = fq.dequantize(q)  # recycled: the same aligned start
    assert address(again) % (2 << 20) == 0
    small = fq.dequantize(fq.quantize(np.ones(N // 4, np.float32)))  # 1 MiB: as allocated
    assert small.nbytes == N and not own_memory(small)


def test_buffers_cover_whole_huge_pages_and_their_slack_stays_zero():
    # The slack around a view is the one part of a buffer no kernel overwrites: a
    # buffer someone made writable (to write there) is let go of, not reused.
    n = 5 * N // 4 + 3  # 5 MiB + 12 bytes of float32: three huge pages, the last partly
    x = np.ones(n, np.float32)
    a = fq.dequantize(fq.quantize(x))
    root = a.base
    start = address(a) - address(root)
    assert address(a) % (2 << 20) == 0
    assert root.nbytes >= start + 3 * (2 << 20)  # every page the view touches
    assert not root[:start].any() and not root[start + a.nbytes :].any()
    root.setflags(write=True)
    root[:start] = 0xAB
    root[start + a.nbytes :] = 0xAB
    del a, root
    b = fq.dequantize(fq.quantize(x * 2))  # the same size: that buffer, had it been kept
    broot = b.base
    bstart = address(b) - address(broot)
    assert not broot[:bstart].any() and not broot[bstart + b.nbytes :].any()
    np.testing.assert_array_equal(b, fq.dequantize(fq.quantize(x * 2)))


def test_a_resized_buffer_is_let_go_of():
    # An adversarial review: after `result.base.resize(...)` every later output of
    # that size raised RuntimeError ("recycled output buffer is too small").
    x = np.ones(N, np.float32)
    a = fq.dequantize(fq.quantize(x))
    root = a.base
    del a
    root.setflags(write=True)
    root.resize(100, refcheck=False)
    root.setflags(write=False)
    del root
    for _ in range(2):
        np.testing.assert_array_equal(fq.dequantize(fq.quantize(x)), x)
