"""Memory: no hidden copy of the input, no growth over many calls.

NumPy reports its allocations to tracemalloc, and ferroquant allocates its
outputs through NumPy, so tracemalloc's peak is the extra memory a call needs.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

import ferroquant as fq


def peak_bytes(fn):
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, result


def test_quantize_peak_is_close_to_the_output_size():
    x = np.random.default_rng(0).standard_normal(16 * 1024 * 1024).astype(np.float32)
    peak, q = peak_bytes(lambda: fq.quantize_blockwise(x))
    assert q.nbytes == x.size + 2 * (x.size // 64)
    assert peak <= 1.15 * q.nbytes, (peak, q.nbytes)


def test_dequantize_peak_is_close_to_the_output_size():
    q = fq.quantize_blockwise(np.ones(8 * 1024 * 1024, np.float32))
    peak, y = peak_bytes(lambda: fq.dequantize_blockwise(q))
    assert peak <= 1.15 * y.nbytes, (peak, y.nbytes)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_no_growth_over_ten_thousand_calls():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    bad = x.copy()
    bad[100] = np.nan
    for _ in range(200):  # warm up allocator pools
        fq.dequantize_blockwise(fq.quantize_blockwise(x))
    gc.collect()
    before = rss_bytes()
    for i in range(10_000):
        fq.dequantize_blockwise(fq.quantize_blockwise(x))
        if i % 10 == 0:
            try:
                fq.quantize_blockwise(bad)
            except fq.NonFiniteError:
                pass
    gc.collect()
    grown = rss_bytes() - before
    # 10,000 leaked outputs would be >= 10,000 * 4 KiB = 40 MiB.
    assert grown < 4 * 1024 * 1024, grown
