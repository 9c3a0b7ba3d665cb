"""SPEC §5's float16 bits: every binary16 pattern to float32 and float32 of every class
to binary16 bit for bit against a bit-level reference (IEEE round to nearest even, the
``half`` crate's NaNs), shapes, layouts, typed errors, threads."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import ferroquant as fq
from ferroquant import _reference as ref


def test_every_half_pattern_converts_exactly():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = fq.fp16_bits_to_fp32(bits)
    assert got.dtype == np.float32
    assert got.view(np.uint32).tobytes() == ref.fp16_bits_to_fp32(bits).view(np.uint32).tobytes()
    # Every non-NaN half is a float32 NumPy agrees on, and comes back unchanged.
    finite = ~np.isnan(got)
    assert np.array_equal(got[finite], bits[finite].view(np.float16).astype(np.float32))
    back = fq.fp32_to_fp16_bits(got)
    assert np.array_equal(back[finite], bits[finite])
    # A NaN comes back quiet (bit 9 set) with its payload's top bits.
    assert np.all(back[~finite] & 0x7E00 == 0x7E00)


def _patterns(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    kind = np.arange(n) % 6
    u = np.where(kind == 0, (u & 0xFFFFE000) | 0x1000, u)  # midpoints between halves
    u = np.where(kind == 1, (u & 0x807FFFFF) | ((100 + u % 60) << 23).astype(np.uint32), u)
    u = np.where(kind == 2, u | 0x7F800000, u)  # inf and NaN payloads
    u = np.where(kind == 3, u & 0x80000000, u)  # signed zeros
    return u.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 70_001])
def test_float32_of_every_class_rounds_to_nearest_even(n):
    x = _patterns(n, n)
    got = fq.fp32_to_fp16_bits(x)
    assert got.dtype == np.uint16 and got.shape == x.shape
    assert got.tobytes() == ref.fp32_to_fp16_bits(x).tobytes()


def test_edges_of_the_half_range():
    x = np.array(
        [65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 1.0 + 2.0**-11],
        np.float32,
    )
    got = fq.fp32_to_fp16_bits(x)
    want = [0x7BFF, 0x7BFF, 0x7C00, 0x0001, 0x0000, 0x0001, 0x3C00]
    assert got.tolist() == want


def test_shapes_layouts_and_byte_orders():
    x = _patterns(24, 5).reshape(2, 3, 4)
    want = fq.fp32_to_fp16_bits(x)
    assert want.shape == (2, 3, 4)
    assert fq.fp32_to_fp16_bits(np.asfortranarray(x)).tobytes() == want.tobytes()
    assert fq.fp32_to_fp16_bits(x.astype(">f4")).tobytes() == want.tobytes()
    assert fq.fp32_to_fp16_bits(x[:, ::-1]).tobytes() == want[:, ::-1].copy().tobytes()
    assert fq.fp32_to_fp16_bits(np.float32(1.0).reshape(())).shape == ()
    b = want.astype(">u2")
    assert fq.fp16_bits_to_fp32(b).view(np.uint32).tobytes() == (
        fq.fp16_bits_to_fp32(want).view(np.uint32).tobytes()
    )
    before = x.copy()
    fq.fp32_to_fp16_bits(x)
    assert x.tobytes() == before.tobytes()


def test_wrong_types_are_type_errors_naming_the_argument():
    for bad in (np.ones(3, np.int32), np.ones(3, bool), np.ones(3, np.complex64), [1, 2]):
        with pytest.raises(TypeError, match="x must be a floating array"):
            fq.fp32_to_fp16_bits(bad)
    for bad in (np.ones(3, np.int16), np.ones(3, np.float16), [1, 2], np.ones(3, np.uint32)):
        with pytest.raises(TypeError, match="bits must be a uint16"):
            fq.fp16_bits_to_fp32(bad)


def test_large_inputs_do_not_depend_on_the_thread_count():
    x = _patterns(1 << 20, 7)
    old = fq.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            fq.set_num_threads(n)
            runs.append(fq.fp32_to_fp16_bits(x).tobytes())
    finally:
        fq.set_num_threads(old)
    assert runs[0] == runs[1] == runs[2] == ref.fp32_to_fp16_bits(x).tobytes()


def test_other_float_dtypes_are_read_as_float32_first(rng):
    # SPEC's general rules: float64, float16 and bfloat16 input is read as
    # float32 (the working precision) as the kernel reads it.
    x32 = (rng.standard_normal(5000) * np.float32(3e4)).astype(np.float32)
    x32[:6] = [np.inf, -np.inf, np.nan, 7e-8, -0.0, 65520.0]
    for dt in (np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            x = x32.astype(dt)  # exact in float32: the bits of its float32 value
        assert (
            fq.fp32_to_fp16_bits(x).tobytes()
            == ref.fp32_to_fp16_bits(x.astype(np.float32)).tobytes()
        )
    # float64: rounded to float32 (nearest even), then to float16 (a double rounding).
    x64 = x32.astype(np.float64) + rng.standard_normal(5000) * 1e-3
    x64[:3] = [1e300, -1e300, 1 + 2**-11 + 2**-30]  # past f32 -> inf; a double-rounding case
    got = fq.fp32_to_fp16_bits(x64)
    with np.errstate(over="ignore"):
        x64_as_32 = x64.astype(np.float32)
    assert got.tobytes() == ref.fp32_to_fp16_bits(x64_as_32).tobytes()
    assert got[:3].tolist() == [0x7C00, 0xFC00, 0x3C00]  # 1 + 2^-11 (f32) ties to even: 1.0
    assert fq.fp32_to_fp16_bits([1.0, 2.0]).tolist() == [0x3C00, 0x4000]
    assert fq.fp32_to_fp16_bits(x64[:2000]).tobytes() == got[:2000].tobytes()  # small: one thread
