"""pytest-benchmark suite: ferroquant next to the NumPy-faithful reference.

    python -m pytest benches --benchmark-only            # measure
    python -m pytest benches --benchmark-disable -q      # smoke (CI): each body once

For the interleaved, floor-relative comparison with peers use compare.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases.blockwise import numpy_dequantize, numpy_quantize

import ferroquant as fq

N = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def x() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(N) * 3).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_ferroquant(benchmark, x, threads):
    fq.set_num_threads(threads)
    q = benchmark(fq.quantize_blockwise, x, 64)
    assert q.data.size == N


def test_quantize_numpy_faithful(benchmark, x):
    codes, scales = benchmark(numpy_quantize, x)
    q = fq.quantize_blockwise(x, 64)
    assert np.array_equal(codes, q.data) and np.array_equal(scales, q.scales)


def test_dequantize_ferroquant(benchmark, x):
    q = fq.quantize_blockwise(x, 64)
    y = benchmark(fq.dequantize_blockwise, q)
    assert y.shape == x.shape


def test_dequantize_numpy_faithful(benchmark, x):
    q = fq.quantize_blockwise(x, 64)
    y = benchmark(numpy_dequantize, q.data, q.scales)
    assert y.tobytes() == fq.dequantize_blockwise(q).tobytes()
