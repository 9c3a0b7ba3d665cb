"""SPEC §1 (blockwise 8-bit) against the plain-NumPy reference of seed 000,
plus the general rules: dtypes, layouts, errors, warnings, dataclass behaviour."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
import textwrap
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ferroquant as fq
from ferroquant import _reference as ref


def quiet_quantize(x, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fq.PrecisionWarning)
        return fq.quantize_blockwise(x, *args, **kwargs)


def assert_matches_reference(x, block_size, scale_dtype=np.float16):
    q = quiet_quantize(x, block_size, scale_dtype)
    x32 = np.asarray(x).astype(np.float32)
    codes, scales = ref.quantize_blockwise(x32, block_size, scale_dtype)
    np.testing.assert_array_equal(q.data, codes)
    assert q.scales.dtype == np.dtype(scale_dtype)
    assert q.scales.tobytes() == scales.tobytes()
    deq = fq.dequantize_blockwise(q)
    want = ref.dequantize_blockwise(codes, scales, block_size).reshape(np.shape(x))
    assert deq.dtype == np.float32
    assert deq.tobytes() == want.tobytes()
    return q


# Finite f32 values small enough that f16 scales never overflow (max|x| < 8.3e6),
# reaching down into the subnormals.
f16_safe = st.floats(-8.0e6, 8.0e6, width=32, allow_subnormal=True)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)


@given(hnp.arrays(np.float32, shapes, elements=f16_safe), st.integers(1, 130))
def test_matches_reference_f16_scales(x, block_size):
    assert_matches_reference(x, block_size)


@given(
    hnp.arrays(
        np.float32, shapes, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
    ),
    st.integers(1, 130),
)
def test_matches_reference_f32_scales_full_range(x, block_size):
    assert_matches_reference(x, block_size, np.float32)


@given(
    st.sampled_from([np.float16, np.float64, ml_dtypes.bfloat16]),
    hnp.array_shapes(min_dims=1, max_dims=2, max_side=50),
    st.integers(1, 70),
    st.integers(0, 2**32 - 1),
)
def test_other_float_dtypes_match_reference_of_converted_values(dtype, shape, block_size, seed):
    x = (np.random.default_rng(seed).standard_normal(shape) * 30).astype(dtype)
    assert_matches_reference(x, block_size)


@given(st.integers(0, 2**32 - 1), st.integers(1, 16))
def test_exact_ties_round_half_away_from_zero(seed, k):
    # Scale exactly 2**-k (max_abs = 127 * 2**-k); values at exact .5 code ties.
    rng = np.random.default_rng(seed)
    scale = np.float32(2.0**-k)
    ties = (rng.integers(-126, 126, 63) + 0.5).astype(np.float32) * scale
    x = np.concatenate([[127 * scale], ties]).astype(np.float32)
    q = quiet_quantize(x, 64)
    halves = ties / scale
    want = np.trunc(halves) + np.sign(halves)  # away from zero
    np.testing.assert_array_equal(q.data[1:], want.astype(np.int8))


def test_seed_roundtrip_example():
    # Seed 000's own test: 0.0, 0.1, ..., 25.5, blocks of 64, ratio > 3, error < 0.5.
    x = (np.arange(256, dtype=np.float32) * np.float32(0.1)).astype(np.float32)
    q = fq.quantize_blockwise(x, 64)
    assert q.compression_ratio() > 3.0
    assert np.abs(fq.dequantize_blockwise(q) - x).max() < 0.5


def test_known_values():
    x = np.array([1.0, -3.0, 5.0, 254.0, 0.0, -127.0, 63.5], np.float32)
    q = fq.quantize_blockwise(x, 4)
    np.testing.assert_array_equal(q.data, [1, -2, 3, 127, 0, -127, 64])
    np.testing.assert_array_equal(q.scales, np.array([2.0, 1.0], np.float16))
    np.testing.assert_array_equal(
        fq.dequantize_blockwise(q), [2.0, -4.0, 6.0, 254.0, 0.0, -127.0, 64.0]
    )


def test_all_zero_block_has_scale_one_and_underflow_gives_zero_codes():
    tiny = np.float32(1e-45)  # max_abs / 127 underflows to 0 in f32
    x = np.array([0, 0, 0, tiny, -tiny, 0], np.float32)
    with pytest.warns(fq.PrecisionWarning, match="1 of 2 blocks"):
        q = fq.quantize_blockwise(x, 3)
    np.testing.assert_array_equal(q.scales, np.array([1.0, 0.0], np.float16))
    np.testing.assert_array_equal(q.data, np.zeros(6, np.int8))


def test_sizes_ratio_and_nbytes():
    x = np.ones((10, 100), np.float32)
    q = fq.quantize_blockwise(x, 64)
    assert q.scales.shape == (16,)
    assert q.size_bytes() == 1000 + 2 * 16 == q.nbytes
    assert q.original_size_bytes() == 4000
    assert q.compression_ratio() == float(np.float32(4000) / np.float32(1032))
    q32 = fq.quantize_blockwise(x, 64, np.float32)
    assert q32.size_bytes() == 1000 + 4 * 16 == q32.nbytes
    empty = fq.quantize_blockwise(np.zeros((0, 3), np.float32))
    assert empty.data.shape == (0,) and empty.scales.shape == (0,)
    assert empty.compression_ratio() == 1.0
    assert fq.dequantize_blockwise(empty).shape == (0, 3)


def test_zero_dim_input_round_trips_its_shape():
    q = fq.quantize_blockwise(np.float32(3.5))
    assert q.shape == ()
    y = fq.dequantize_blockwise(q)
    assert y.shape == () and y.dtype == np.float32
    assert abs(float(y) - 3.5) <= float(q.scales[0]) / 2  # within half a step of the f16 scale


def test_precision_warning_counts_blocks():
    x = np.concatenate([np.full(64, 1e-3), np.ones(64), np.full(64, 5e-4)]).astype(np.float32)
    with pytest.warns(fq.PrecisionWarning, match=r"2 of 3 blocks") as rec:
        fq.quantize_blockwise(x, 64)
    assert len(rec) == 1
    assert "float32" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fq.quantize_blockwise(x, 64, np.float32)  # exact scales: no warning
        fq.quantize_blockwise(np.ones(100, np.float32))


def test_f16_scale_overflow_raises_and_f32_scales_work():
    x = np.ones(256, np.float32)
    x[130] = 9.0e6
    with pytest.raises(fq.InvalidConfigError, match="float32") as e:
        fq.quantize_blockwise(x, 64)
    assert "block 2" in str(e.value)
    assert str(e.value).startswith("invalid scale_dtype:")
    assert "use scale_dtype=np.float32" in str(e.value)
    q = fq.quantize_blockwise(x, 64, scale_dtype=np.float32)
    assert q.scales[2] == np.float32(9.0e6) / np.float32(127)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_non_finite_names_first_flat_index_and_leaves_input_alone(bad, dtype):
    x = np.arange(300, dtype=np.float32).reshape(3, 100).astype(dtype)
    x[1, 7] = bad
    x[2, 50] = bad
    before = x.copy()
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_blockwise(x, 16)
    assert e.value.index == 107
    assert "107" in str(e.value) and "x" in str(e.value)
    assert isinstance(e.value, ValueError)
    assert x.tobytes() == before.tobytes()


def test_non_finite_wins_over_scale_overflow():
    x = np.ones(200, np.float32)
    x[5] = 1e7
    x[150] = np.nan
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_blockwise(x, 64)
    assert e.value.index == 150


def test_float64_beyond_float32_range_is_non_finite():
    x = np.array([1.0, 2.0, 1e39], np.float64)
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_blockwise(x, scale_dtype=np.float32)
    assert e.value.index == 2


def test_non_finite_index_in_large_parallel_input(restore_threads):
    x = np.ones(3_000_000, np.float32)
    x[2_500_001] = np.inf
    x[2_900_000] = np.nan
    for threads in (1, 2):
        fq.set_num_threads(threads)
        with pytest.raises(fq.NonFiniteError) as e:
            fq.quantize_blockwise(x)
        assert e.value.index == 2_500_001


def test_a_large_output_on_one_thread_has_the_codes_of_small_calls(restore_threads):
    # Outputs of 8 MiB and more, on one thread, are streamed: whole lines made of
    # one block's codes and the next one's (AVX-512), at whatever offset NumPy's
    # allocation starts. Small calls store their codes the ordinary way.
    rng = np.random.default_rng(7)
    n = (8 << 20) + 64 * 5 + 17
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    x[64 * 100 : 64 * 101] = 0.0  # an all-zero block: scale 1, codes 0
    x[64 * 2000 : 64 * 2001] *= np.float32(1e-41)  # subnormal scales
    x[64 * 3001 + 5] = np.float32(3e38)
    # Exact ties: scale 0.25 (max 31.75), values (k + 0.5) * 0.25.
    x[64 * 4000 : 64 * 4001] = ((np.arange(64) - 31.5) * 0.25).astype(np.float32)
    x[64 * 4000] = 127.0 / 4
    fq.set_num_threads(1)
    big = fq.quantize_blockwise(x, 64, scale_dtype=np.float32)
    step = 64 * 1024
    for at in range(0, n, step):
        part = fq.quantize_blockwise(x[at : at + step], 64, scale_dtype=np.float32)
        assert np.array_equal(big.data[at : at + step], part.data), at
        assert np.array_equal(
            big.scales[at // 64 : (at + step) // 64 + 1][: part.scales.size], part.scales
        )
    # (The Rust tests cover every output offset within a line.)
    x[n - 3] = np.nan
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_blockwise(x, 64)
    assert e.value.index == n - 3


@pytest.mark.parametrize(
    "x",
    [
        np.arange(10, dtype=np.int32),
        np.arange(10, dtype=np.int8),
        np.arange(10, dtype=np.uint64),
        np.ones(10, dtype=bool),
        np.ones(10, dtype=np.complex64),
        np.array(["a", "b"]),
        np.array([object(), object()]),
        np.ones(4, dtype="m8[s]"),
        np.ones(4, dtype=np.longdouble),
        [1, 2, 3],
    ],
    ids=lambda a: str(np.asarray(a).dtype),
)
def test_non_float_input_is_a_type_error(x):
    with pytest.raises(TypeError, match=r"^x must be a floating array"):
        fq.quantize_blockwise(x)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"block_size": 0}, fq.InvalidConfigError, "block_size must be an integer >= 1, got 0"),
        ({"block_size": -5}, fq.InvalidConfigError, "block_size"),
        ({"block_size": 2**64}, fq.InvalidConfigError, "block_size"),
        ({"block_size": 1.5}, TypeError, "block_size must be an integer"),
        ({"block_size": True}, TypeError, "block_size must be an integer, got bool"),
        ({"block_size": "64"}, TypeError, "block_size"),
        ({"scale_dtype": np.float64}, fq.InvalidConfigError, "scale_dtype"),
        ({"scale_dtype": np.int8}, fq.InvalidConfigError, "scale_dtype"),
        ({"scale_dtype": "nonsense"}, fq.InvalidConfigError, "scale_dtype"),
        ({"scale_dtype": object()}, fq.InvalidConfigError, "scale_dtype"),
    ],
)
def test_bad_parameters_raise_typed_errors_naming_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        fq.quantize_blockwise(np.ones(10, np.float32), **kwargs)


def test_python_floats_and_numpy_integer_block_sizes_are_accepted():
    q = fq.quantize_blockwise([0.5, -1.0, 2.0], np.int64(2), "float32")
    assert q.block_size == 2 and q.scales.dtype == np.float32


def test_block_size_larger_than_input_is_one_block():
    q = fq.quantize_blockwise(np.arange(5, dtype=np.float32), 2**62)
    assert q.scales.shape == (1,)


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a[:, ::2],
        lambda a: a.T,
        lambda a: np.asfortranarray(a),
        lambda a: a.astype(">f4"),
        lambda a: a.astype(">f8"),
        lambda a: a[::-1],
        lambda a: np.lib.stride_tricks.as_strided(a, (40, 3), (a.strides[0], 0)),
    ],
    ids=["strided", "transposed", "fortran", "big-f4", "big-f8", "reversed", "zero-stride"],
)
def test_any_layout_gives_the_contiguous_result(make, rng):
    base = (rng.standard_normal((40, 30)) * 10).astype(np.float32)
    x = make(base)
    before = x.copy()
    q = fq.quantize_blockwise(x, 32)
    want = fq.quantize_blockwise(np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("=")), 32)
    assert q == want
    assert q.dtype == x.dtype.newbyteorder("=").name
    np.testing.assert_array_equal(x, before)


def test_read_only_input_is_accepted_and_never_modified(rng):
    x = rng.standard_normal(1000).astype(np.float32)
    x.flags.writeable = False
    before = x.copy()
    q = fq.quantize_blockwise(x)
    np.testing.assert_array_equal(x, before)
    assert q == fq.quantize_blockwise(before)


def test_outputs_are_fresh_owned_arrays_and_frozen(rng):
    q = fq.quantize_blockwise(rng.standard_normal(5000).astype(np.float32))
    for arr in (q.data, q.scales):
        # A read-only view of the one buffer the kernel filled (no copy), which
        # NumPy will not let anyone make writable again.
        assert arr.base.flags.owndata and arr.flags.c_contiguous and arr.base.base is None
        assert not arr.flags.writeable and not arr.base.flags.writeable
        with pytest.raises(ValueError, match="WRITEABLE"):
            arr.flags.writeable = True
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.block_size = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        q.data[0] = 1
    deq = fq.dequantize_blockwise(q)
    assert deq.flags.writeable and (deq.base is None or deq.base.flags.owndata)


def test_equality_is_by_value_and_repr_is_short(rng):
    x = rng.standard_normal((300, 300)).astype(np.float32)
    a, b = fq.quantize_blockwise(x), fq.quantize_blockwise(x.copy())
    assert a == b and a is not b
    assert a != fq.quantize_blockwise(x, 32)
    assert a != fq.quantize_blockwise(x, scale_dtype=np.float32)
    assert (a == "other") is False
    with pytest.raises(TypeError):
        hash(a)
    r = repr(a)
    assert r.startswith("BlockwiseQuantized(shape=(300, 300), scheme='blockwise8'")
    assert "ratio=3.88x" in r and len(r) < 200
    assert pickle.loads(pickle.dumps(a)) == a


def test_constructor_validates_consistency():
    data = np.zeros(10, np.int8)
    scales = np.ones(3, np.float16)
    fq.BlockwiseQuantized(data, scales, (2, 5), 4)
    with pytest.raises(fq.ShapeMismatchError, match="scales"):
        fq.BlockwiseQuantized(data, np.ones(2, np.float16), (2, 5), 4)
    with pytest.raises(fq.ShapeMismatchError, match="data"):
        fq.BlockwiseQuantized(data, scales, (3, 5), 4)
    with pytest.raises(TypeError, match="data must be an int8 array"):
        fq.BlockwiseQuantized(data.astype(np.int16), scales, (2, 5), 4)
    with pytest.raises(TypeError, match="scales"):
        fq.BlockwiseQuantized(data, scales.astype(np.float64), (2, 5), 4)
    with pytest.raises(fq.InvalidConfigError, match="block_size"):
        fq.BlockwiseQuantized(data, scales, (2, 5), 0)


def test_dequantize_rejects_other_types():
    with pytest.raises(TypeError, match="q must be a BlockwiseQuantized"):
        fq.dequantize_blockwise(np.zeros(3, np.int8))  # type: ignore[arg-type]


def test_simd_isa_reports_a_supported_choice():
    assert fq.simd_isa() in fq.supported_isas()
    assert fq.supported_isas()[0] == "scalar"


def test_a_foreign_dtype_named_bfloat16_is_a_type_error_not_a_panic():
    # rust-numpy resolves bf16 by the name "bfloat16" and panics if numpy cannot;
    # here (no ml_dtypes imported) a look-alike dtype must get a TypeError instead.
    code = textwrap.dedent(
        """
        import numpy as np
        from ferroquant import _ferroquant as native
        class bfloat16(np.void):
            pass
        a = np.zeros(3, np.dtype((bfloat16, 2)))
        try:
            native.quantize_blockwise(a, 64, False)
        except BaseException as e:
            print(type(e).__name__, e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("TypeError x must have dtype"), out.stdout + out.stderr
