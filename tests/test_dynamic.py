"""SPEC §3 (dynamic activation quantization, seed 002) and §4 (BitNet activations,
seed 003): bit-exact against the NumPy ports of the seeds, and each family's own
semantics: scale modes, formats, empty inputs, dataclasses, errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ferroquant as fq
from ferroquant import _reference as ref

FORMATS = {
    "int8_per_tensor": fq.dynamic_quantize_int8,
    "int8_per_row": fq.dynamic_quantize_int8_per_row,
    "int4_per_tensor": fq.dynamic_quantize_int4,
}
MODES = [fq.MaxAbs(), fq.Percentile(0.99), fq.Percentile(0.5), fq.Percentile(1.0)]


def p_of(mode):
    return None if isinstance(mode, fq.MaxAbs) else mode.p


def check_dynamic(x: np.ndarray, fmt: str, mode) -> fq.DynQuantTensor:
    q = FORMATS[fmt](x, mode)
    data, scales = ref.dynamic_quantize(x, fmt, p_of(mode))
    assert q.format == fmt and q.shape == x.shape
    assert q.data.dtype == data.dtype and q.data.tobytes() == data.tobytes(), fmt
    assert q.scales.dtype == np.float32 and q.scales.tobytes() == scales.tobytes()
    codes = ref.unpack_int4(data, x.size) if fmt == "int4_per_tensor" else data
    assert q.values().tobytes() == codes.tobytes()
    group = (x.shape[1] if fmt == "int8_per_row" else x.size) if x.size else 1
    want = ref.dequantize_groups(codes, scales, group).reshape(x.shape)
    y = q.dequantize()
    assert y.dtype == np.float32 and y.tobytes() == want.tobytes()
    return q


def f32_arrays(shapes):
    return hnp.arrays(
        np.float32, shapes, elements=st.floats(width=32, allow_nan=False, allow_infinity=False)
    )


mode_st = st.sampled_from(MODES) | st.floats(1e-6, 1.0).map(fq.Percentile)
any_shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=20)
two_d = hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=20)


@given(f32_arrays(any_shape), st.sampled_from(["int8_per_tensor", "int4_per_tensor"]), mode_st)
def test_per_tensor_matches_the_seed(x, fmt, mode):
    check_dynamic(x, fmt, mode)


@given(f32_arrays(two_d), mode_st)
def test_per_row_matches_the_seed(x, mode):
    check_dynamic(x, "int8_per_row", mode)


@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 400),
    st.sampled_from(list(FORMATS)),
    st.sampled_from(MODES),
)
def test_ties_match_the_seed(seed, n, fmt, mode):
    # Multiples of scale/2 put many values exactly on rounding ties.
    rng = np.random.default_rng(seed)
    x = (rng.integers(-254, 255, size=(n, 3)) * 0.5 * 0.37).astype(np.float32)
    check_dynamic(x, fmt, mode)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_other_dtypes_are_read_as_their_f32_values(rng, dtype, fmt):
    x = (rng.standard_normal((37, 129)) * 4).astype(dtype)
    for mode in MODES[:2]:
        q = FORMATS[fmt](x, mode)
        same = FORMATS[fmt](x.astype(np.float32), mode)
        assert q == same
        check_dynamic(x.astype(np.float32), fmt, mode)


def test_large_inputs_match_on_the_pool(rng):
    x = (rng.standard_normal((2048, 1024)) * 3).astype(np.float32)
    for fmt in FORMATS:
        for mode in (fq.MaxAbs(), fq.Percentile(0.999)):
            if fmt == "int8_per_row" or isinstance(mode, fq.MaxAbs):
                check_dynamic(x, fmt, mode)
            outs = []
            for t in (1, 2, 3):
                fq.set_num_threads(t)
                outs.append(FORMATS[fmt](x, mode))
            assert outs[0] == outs[1] == outs[2]


def test_percentile_rank_is_exact():
    # SPEC §3: p = 0.9, n = 10 gives rank 8 (f32 arithmetic would give 9).
    x = np.arange(1, 11, dtype=np.float32)
    assert fq.compute_scale(x, 1.0, fq.Percentile(0.9)) == 9.0
    assert ref.percentile_rank(0.9, 10) == 8
    assert fq.compute_scale(x, 1.0, fq.Percentile(1.0)) == 10.0
    assert fq.compute_scale(x, 1.0, fq.Percentile(1e-9)) == 1.0
    assert fq.compute_scale(-x, 2.0, fq.MaxAbs()) == np.float32(10.0) / np.float32(2.0)


@given(f32_arrays(any_shape), st.floats(0.5, 300.0, width=32), mode_st)
def test_compute_scale_matches_the_seed(x, clip, mode):
    got = fq.compute_scale(x, clip, mode)
    want = ref.compute_scale(x, clip, p_of(mode))
    assert np.float32(got).tobytes() == want.tobytes()


def test_empty_inputs_keep_the_seeds_shapes():
    q = fq.dynamic_quantize_int8(np.zeros(0, np.float32))
    assert q.data.size == 0 and q.scales.tolist() == [0.0]
    assert fq.dynamic_quantize_int4(np.zeros((0, 3), np.float32)).scales.tolist() == [0.0]
    r = fq.dynamic_quantize_int8_per_row(np.zeros((3, 0), np.float32))
    assert r.scales.size == 0 and r.dequantize().shape == (3, 0)
    assert fq.compute_scale(np.zeros(0, np.float32), 127.0) == 0.0
    z = fq.dynamic_quantize_int8(np.zeros(5, np.float32))
    assert z.scales.tolist() == [0.0] and z.data.tolist() == [0] * 5
    assert z.dequantize().tolist() == [0.0] * 5


def test_dyn_quant_tensor_accounting():
    x = np.linspace(-3, 3, 1001, dtype=np.float32)
    q = fq.dynamic_quantize_int4(x)
    assert q.element_count() == 1001 and q.data.size == 501
    assert q.memory_bytes() == q.nbytes == 501 + 4
    assert q.compression_ratio() == pytest.approx(4 * 1001 / 505, rel=1e-6)
    assert "DynQuantTensor" in repr(q) and "dynamic-int4" in repr(q) and "[" not in repr(q)
    assert q == fq.dynamic_quantize_int4(x) and q != fq.dynamic_quantize_int8(x)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.format = "int8_per_tensor"  # type: ignore[misc]
    assert fq.DynQuantTensor.from_bytes(q.to_bytes()) == q


def test_quantization_mae_matches_the_seed(rng):
    x = rng.standard_normal((64, 33)).astype(np.float32)
    for fn in FORMATS.values():
        q = fn(x)
        want = ref.quantization_mae(x, q.dequantize())
        assert np.float32(fq.quantization_mae(x, q)).tobytes() == want.tobytes()
    # Seed 002's own test: MAE below 0.5 % of max |x| for int8.
    d = (np.arange(256, dtype=np.float32) - 128) * np.float32(0.1)
    assert fq.quantization_mae(d, fq.dynamic_quantize_int8(d)) < 0.005 * 12.8


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_quantization_mae_over_common_lengths_reads_codes_in_place(rng, dtype):
    # Each value is dequantized as it is read (no float32 copy of the input's
    # size): the same sum as against q.dequantize(), for every format, with the
    # original longer or shorter than q and an odd int4 length.
    import tracemalloc

    x = (rng.standard_normal((37, 41)) * 4).astype(dtype)
    for fn in FORMATS.values():
        q = fn(x)
        restored = q.dequantize()
        for original in (x, x.reshape(-1)[:1000], np.concatenate([x.reshape(-1), x[0]])):
            want = ref.quantization_mae(original, restored)
            assert np.float32(fq.quantization_mae(original, q)).tobytes() == want.tobytes()
    big = rng.standard_normal(4 * 2**20).astype(np.float32)
    q = fq.dynamic_quantize_int4(big)
    tracemalloc.start()
    try:
        fq.quantization_mae(big, q)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # the dequantized values would be 16 MiB
    bad = np.concatenate([x.reshape(-1), [np.nan]]).astype(dtype)
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantization_mae(bad, fq.dynamic_quantize_int8(x))
    assert e.value.index == x.size


def test_errors_name_the_argument():
    with pytest.raises(fq.ShapeMismatchError, match="x2d"):
        fq.dynamic_quantize_int8_per_row(np.zeros(4, np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="x2d"):
        fq.dynamic_quantize_int8_per_row(np.zeros((2, 2, 2), np.float32))
    above_one = np.longdouble(1) + np.longdouble(2.0**-60)  # float() rounds it to 1.0

    class Hostile(float):
        def __gt__(self, other):  # type: ignore[override]
            raise ZeroDivisionError

    assert fq.Percentile(Hostile(0.5)).p == 0.5
    bads = [0.0, -0.1, 1.5, float("nan"), "0.5", True, np.timedelta64(1)]
    if above_one > 1:  # long double wider than float64 on this platform
        bads.append(above_one)
    for bad in bads:
        with pytest.raises(fq.InvalidConfigError, match="p"):
            fq.Percentile(bad)
    assert fq.Percentile(np.longdouble(1)).p == 1.0
    with pytest.raises(TypeError, match="mode"):
        fq.dynamic_quantize_int8(np.ones(3, np.float32), 0.99)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="x"):
        fq.dynamic_quantize_int8(np.ones(3, np.int32))
    x = np.ones((4, 5), np.float32)
    x[2, 3] = np.nan
    for fn in FORMATS.values():
        for mode in (fq.MaxAbs(), fq.Percentile(0.5)):
            with pytest.raises(fq.NonFiniteError) as e:
                fn(x, mode)
            assert e.value.index == 13
            # The message names the function's own parameter.
            arg = "x2d" if fn is fq.dynamic_quantize_int8_per_row else "x"
            assert str(e.value).startswith(f"{arg} holds a non-finite value")
    with pytest.raises(fq.NonFiniteError):
        fq.compute_scale(np.array([1, np.inf], np.float32), 127.0)
    # float64 values beyond float32's range are non-finite in the working precision.
    with pytest.raises(fq.NonFiniteError):
        fq.dynamic_quantize_int8(np.array([1.0, 1e300]))


def test_constructor_validates():
    q = fq.dynamic_quantize_int8_per_row(np.ones((2, 3), np.float32))
    with pytest.raises(fq.InvalidConfigError, match="format"):
        fq.DynQuantTensor(q.data, q.scales, q.shape, "int2")
    with pytest.raises(fq.ShapeMismatchError, match="scales"):
        fq.DynQuantTensor(q.data, q.scales[:1], q.shape, "int8_per_row")
    with pytest.raises(fq.InvalidConfigError, match=r"-127\.\.127"):
        fq.DynQuantTensor(np.full(6, -128, np.int8), q.scales, q.shape, "int8_per_row")
    with pytest.raises(fq.InvalidConfigError, match=r"-7\.\.7"):
        fq.DynQuantTensor(np.full(3, 0x88, np.uint8), q.scales[:1], (6,), "int4_per_tensor")
    with pytest.raises(TypeError, match="float32"):
        fq.DynQuantTensor(q.data, q.scales.astype(np.float64), q.shape, "int8_per_row")
    # A zero scale codes its group as zeros (SPEC §3): other codes are refused, in
    # the constructor and so in from_bytes; the kernels' own zero groups pass.
    x = np.array([[0, 0, 0], [1, -2, 3]], np.float32)
    rows = fq.dynamic_quantize_int8_per_row(x)
    assert rows.scales[0] == 0 and fq.DynQuantTensor.from_bytes(rows.to_bytes()) == rows
    bad = rows.data.copy()
    bad[1] = 5
    with pytest.raises(fq.InvalidConfigError, match=r"scale is 0 must be 0.*row 0"):
        fq.DynQuantTensor(bad, rows.scales, rows.shape, "int8_per_row")
    zero = np.zeros(1, np.float32)
    with pytest.raises(fq.InvalidConfigError, match="scale is 0"):
        fq.DynQuantTensor(np.array([127, -5], np.int8), zero, (2,))
    with pytest.raises(fq.InvalidConfigError, match="scale is 0"):
        fq.DynQuantTensor(np.array([0x10, 0], np.uint8), zero, (3,), "int4_per_tensor")
    assert fq.DynQuantTensor(
        np.zeros(2, np.uint8), zero, (3,), "int4_per_tensor"
    ).values().tolist() == [0, 0, 0]


# -- BitNet (SPEC §4) -----------------------------------------------------------------

bitnet_shapes = hnp.array_shapes(min_dims=2, max_dims=3, min_side=0, max_side=12)


@given(f32_arrays(bitnet_shapes), st.integers(2, 8), st.booleans())
def test_bitnet_matches_the_seed(x, bits, per_token):
    cfg = fq.BitNetConfig(bits, per_token)
    q = fq.quantize_activations(x, cfg)
    codes, scales = ref.bitnet_quantize(x, bits, per_token)
    assert q.data.shape == x.shape and q.data.tobytes() == codes.tobytes()
    assert q.scales.tobytes() == scales.tobytes()
    group = x.size // scales.size if scales.size else 1
    want = ref.dequantize_groups(codes, scales, group).reshape(x.shape)
    assert fq.dequantize_activations(q).tobytes() == want.tobytes()
    assert fq.quantize_ste(x, cfg).tobytes() == want.tobytes()


@pytest.mark.parametrize(
    ("shape", "per_token", "dtype"),
    [
        ((3, 700_001), True, np.float32),
        ((5, 3, 100_003), False, np.float16),
        ((2600, 800), True, np.float64),
    ],
)
def test_quantize_ste_across_slabs_is_quantize_then_dequantize(rng, shape, per_token, dtype):
    # The fused STE holds codes for about a million values at a time: groups
    # larger than that, a slab of several groups, every input dtype.
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    cfg = fq.BitNetConfig(6, per_token)
    want = fq.dequantize_activations(fq.quantize_activations(x, cfg))
    got = fq.quantize_ste(x, cfg)
    assert got.shape == x.shape and got.dtype == np.float32
    assert got.tobytes() == want.tobytes()
    bad = x.copy()
    bad.reshape(-1)[x.size - 7] = np.inf
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_ste(bad, cfg)
    assert e.value.index == x.size - 7


def test_bitnet_shapes_and_properties(rng):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    q = fq.quantize_activations(x)
    assert q.scales.shape == (4,) and q.batch_size == 4 and q.seq_len == 1
    assert q.hidden_dim == 128 and q.numel == 512
    x3 = rng.standard_normal((2, 5, 16)).astype(np.float32)
    assert fq.quantize_activations(x3).scales.shape == (10,)
    per_batch = fq.quantize_activations(x3, fq.BitNetConfig(per_token_activation=False))
    assert per_batch.scales.shape == (2,) and not per_batch.per_token
    assert per_batch.seq_len == 5
    zero = fq.quantize_activations(np.zeros((2, 3), np.float32))
    assert zero.scales.tolist() == [1.0, 1.0] and not zero.data.any()
    empty = fq.quantize_activations(np.zeros((3, 0), np.float32))
    assert empty.scales.tolist() == [1.0] * 3
    assert fq.QuantizedActivations.from_bytes(q.to_bytes()) == q
    assert "QuantizedActivations" in repr(q) and "[" not in repr(q)
    assert q.nbytes == 512 + 16
    # The source dtype is recorded (and saved), outside equality.
    q16 = fq.quantize_activations(x.astype(np.float16))
    assert (q.dtype, q16.dtype) == ("float32", "float16") and "dtype=float16" in repr(q16)
    assert fq.QuantizedActivations.from_bytes(q16.to_bytes()).dtype == "float16"
    assert q16 == fq.quantize_activations(x.astype(np.float16).astype(np.float32))
    with pytest.raises(fq.InvalidConfigError, match="dtype"):
        fq.QuantizedActivations(q.data, q.scales, q.shape, dtype="float8")


def test_bitnet_errors():
    for bits in (0, 1, 9, 16):
        with pytest.raises(fq.InvalidConfigError, match="activation_bits"):
            fq.BitNetConfig(bits)
    with pytest.raises(TypeError):
        fq.BitNetConfig(8.0)  # type: ignore[arg-type]
    for shape in [(3,), (1, 2, 3, 4), ()]:
        with pytest.raises(fq.InvalidConfigError, match="x"):
            fq.quantize_activations(np.zeros(shape, np.float32))
    bad = np.ones((2, 4), np.float32)
    bad[1, 2] = -np.inf
    with pytest.raises(fq.NonFiniteError) as e:
        fq.quantize_activations(bad)
    assert e.value.index == 6


def test_registry_entries(rng):
    x = rng.standard_normal((8, 32)).astype(np.float32)
    for name in ("dynamic-int8", "dynamic-int8-per-row", "dynamic-int4", "bitnet-act"):
        qz = fq.get_quantizer(name)
        q = qz.quantize(x)
        assert q.label == name
        assert qz.dequantize(q).shape == x.shape
    assert fq.get_quantizer("dynamic-int8", percentile=0.99).quantize(x) == (
        fq.dynamic_quantize_int8(x, fq.Percentile(0.99))
    )
    assert fq.get_quantizer("dynamic-int8-per-row").fits((3,), np.float32) is not None
    assert fq.get_quantizer("bitnet-act").fits((2, 2, 2, 2), np.float32) is not None


# -- SmoothQuant ----------------------------------------------------------------------


@given(
    st.integers(0, 2**32 - 1),
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 20),
    st.floats(0.0, 1.0),
)
def test_smooth_factors_match_the_seed(seed, tokens, out, cols, alpha):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((tokens, cols)) * rng.uniform(0, 50)).astype(np.float32)
    w = (rng.standard_normal((out, cols)) * rng.uniform(0, 2)).astype(np.float32)
    a[:, :1] = 0  # an all-zero column: (0 + eps)^alpha
    cfg = fq.SmoothQuantConfig(alpha)
    s = fq.compute_smooth_factors(a, w, cfg)
    want = ref.smooth_factors(a, w, np.float32(alpha), np.float32(1e-5))
    assert s.dtype == np.float32 and s.tobytes() == want.tobytes()


def test_smooth_factors_of_an_infinite_quotient_pair_are_epsilon():
    # (a + eps)^alpha and (w + eps)^(1 - alpha) both overflow: inf / inf is NaN, and
    # the seed's f32::max(NaN, eps) is eps. The reference once kept the NaN.
    big = np.float32(3e38)
    a = np.array([[big, 1.0]], np.float32)
    w = np.array([[big, 1.0]], np.float32)
    for alpha in (0.5, 0.25):
        cfg = fq.SmoothQuantConfig(alpha, epsilon=float(big))
        s = fq.compute_smooth_factors(a, w, cfg)
        want = ref.smooth_factors(a, w, np.float32(alpha), big)
        assert s[0] == big and s.tobytes() == want.tobytes()


def test_smoothing_is_in_place_and_exact(rng):
    a = rng.standard_normal((16, 8)).astype(np.float32)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    s = fq.compute_smooth_factors(a, w)
    a0, w0 = a.copy(), w.copy()
    assert fq.smooth_activations(a, s) is a
    assert fq.smooth_weights(w, s) is w
    assert a.tobytes() == (a0 / s).tobytes() and w.tobytes() == (w0 * s).tobytes()


def test_smoothing_refuses_bad_arrays_and_changes_nothing(rng):
    s = np.full(4, 2.0, np.float32)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    ro = a.copy()
    ro.flags.writeable = False
    for bad in (ro, a[:, ::2].copy().T, np.asfortranarray(a), a.astype(np.float64), [1.0]):
        with pytest.raises(ValueError):
            fq.smooth_activations(bad, s)
    with pytest.raises(ValueError, match="a"):
        fq.smooth_activations(a.T, s)  # not C-contiguous
    with pytest.raises(fq.ShapeMismatchError, match="s"):
        fq.smooth_activations(a, s[:3])
    with pytest.raises(fq.ShapeMismatchError, match="w"):
        fq.smooth_weights(a.reshape(-1), s)
    with pytest.raises(TypeError, match="s must be a floating array"):
        fq.smooth_weights(a, s.astype(np.int32))
    before = a.copy()
    a[2, 3] = np.nan
    before[2, 3] = np.nan
    with pytest.raises(fq.NonFiniteError) as e:
        fq.smooth_activations(a, s)
    assert e.value.index == 11
    assert a.tobytes() == before.tobytes()
    b = rng.standard_normal((3, 4)).astype(np.float32)
    b0 = b.copy()
    for bad_s in (np.array([1, 2, np.inf, 1], np.float32), np.array([1, np.nan, 1, 1])):
        with pytest.raises(fq.NonFiniteError, match="s"):
            fq.smooth_weights(b, bad_s)
    for zero in (0.0, -0.0):
        with pytest.raises(fq.InvalidConfigError, match=r"s\[1\] = -?0: a\[:, 1\] / s\[1\]"):
            fq.smooth_activations(b, np.array([1, zero, 1, 1], np.float32))
    assert b.tobytes() == b0.tobytes()
    for bad in (b.astype(np.int32), b > 0, b.astype(np.complex64), b.astype(object)):
        with pytest.raises(TypeError, match="a must be a writable C-contiguous float32"):
            fq.smooth_activations(bad, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="w must be a writable C-contiguous float32"):
        fq.smooth_weights(b.astype(np.float64), np.ones(4, np.float32))


def test_smoothing_takes_any_finite_factor_as_the_seed_does(rng):
    # Negative factors flip signs and `w * 0` is 0, value for value as seed 002's loops.
    a = rng.standard_normal((5, 4)).astype(np.float32)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    s = np.array([-2.0, 0.5, -0.0, 3.0], np.float32)
    want_w = w * s
    fq.smooth_weights(w, s)
    assert w.tobytes() == want_w.tobytes()
    s = np.array([-2.0, 0.5, -1e-3, 3.0], np.float32)
    want_a = a / s
    fq.smooth_activations(a, s)
    assert a.tobytes() == want_a.tobytes()


def test_smoothing_refuses_results_past_float32_and_changes_nothing():
    # Finite values and factors > 0 whose quotient or product is not finite:
    # a subnormal factor, or a product past float32's largest value.
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    a0 = a.copy()
    with pytest.raises(fq.InvalidConfigError, match=r"a\[0, 0\] / s\[0\]"):
        fq.smooth_activations(a, np.array([1e-45, 1.0], np.float32))
    assert a.tobytes() == a0.tobytes()
    w = np.array([[2.0, 3e37], [1.0, 1.0]], np.float32)
    w0 = w.copy()
    with pytest.raises(fq.InvalidConfigError, match=r"w\[0, 1\] \* s\[1\]"):
        fq.smooth_weights(w, np.array([1.0, 20.0], np.float32))
    assert w.tobytes() == w0.tobytes()
    # Up to the last value that stays finite, the results are the seed's.
    big = np.float32(np.finfo(np.float32).max) / np.float32(20.0)
    w = np.array([[big, -big]], np.float32)
    fq.smooth_weights(w, np.array([20.0, 20.0], np.float32))
    assert np.isfinite(w).all()
    assert w[0, 0] == big * np.float32(20.0)


def test_smooth_config_and_factor_errors(rng):
    for alpha in (-0.01, 1.01, float("nan")):
        with pytest.raises(fq.InvalidConfigError, match="alpha"):
            fq.SmoothQuantConfig(alpha)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    with pytest.raises(fq.ShapeMismatchError, match="weights"):
        fq.compute_smooth_factors(a, np.ones((2, 5), np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="activations"):
        fq.compute_smooth_factors(a.reshape(-1), np.ones((2, 4), np.float32))
    a[1, 1] = np.inf
    with pytest.raises(fq.NonFiniteError, match="activations") as e:
        fq.compute_smooth_factors(a, np.ones((2, 4), np.float32))
    assert e.value.index == 5


# -- Calibration statistics ------------------------------------------------------------


def check_stats(got: fq.CalibStats, batches):
    want = ref.calib_stats(batches)
    assert (got.min, got.max, got.p99, got.suggested_scale) == (
        want[0],
        want[1],
        want[4],
        want[5],
    )
    assert got.mean == pytest.approx(want[2], rel=1e-6, abs=1e-30)
    assert got.std_dev == pytest.approx(want[3], rel=1e-5, abs=1e-30)


@given(st.lists(f32_arrays(hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=30))))
def test_calib_stats_match_the_seed(batches):
    big = [b for b in batches if b.size and np.abs(b).max() > 1e30]
    if big:  # f64 sums of ~1e38 values are fine, but the oracle's squares overflow
        return
    check_stats(fq.CalibStats.collect(batches), batches)
    check_stats(fq.CalibStats.collect(iter(batches)), batches)


def test_calib_stats_seed_example_and_empty():
    s = fq.CalibStats.collect([np.array([1.0, 2, 3], np.float32), np.array([-1.0, 0, 4])])
    assert (s.min, s.max, s.p99) == (-1.0, 4.0, 4.0)
    assert s.mean == 1.5 and s.suggested_scale == np.float32(4) / np.float32(127)
    assert fq.CalibStats.collect([]) == fq.CalibStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert fq.CalibStats.collect(iter([np.zeros(0, np.float32)])).p99 == 0.0
    zeros = fq.CalibStats.collect([np.zeros(10, np.float32)])
    assert zeros.suggested_scale == np.float32(1) / np.float32(127)


def test_calib_stats_p99_is_exact_for_lists_and_streams(tmp_path, monkeypatch):
    # Distinct values first, then many zeros: the exact p99 lies among values a
    # stream that only kept the top 1 % of what it had seen would have dropped.
    import warnings

    batches = [np.arange(1, 100_001, dtype=np.float32), np.zeros(5_000_000, np.float32)]
    exact = fq.CalibStats.collect(batches)
    assert exact.p99 == ref.calib_stats(batches)[4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The spill of every value (read back once, for the p99's bin) ...
        assert fq.CalibStats.collect(iter(batches)) == exact
        # ... or the count announced, which keeps just what the p99 needs.
        assert fq.CalibStats.collect(iter(batches), total=5_100_000) == exact
        assert fq.CalibStats.collect(iter(batches), total=2**40) == exact
    # An unusable TMPDIR is passed over, as Python's tempfile passes over it.
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() looks again
    monkeypatch.setenv("TMPDIR", str(tmp_path / "missing"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fq.CalibStats.collect(iter(batches)) == exact
    # Without a usable temporary directory the spill fails: an upper bound, and
    # the warning says why.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    with pytest.warns(fq.PrecisionWarning, match="upper bound(.|\\n)*temporary file"):
        approx = fq.CalibStats.collect(iter(batches))
    assert approx.p99 >= exact.p99
    # Not needed (the kept values give the p99): no file, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small = [np.arange(1, 1001, dtype=np.float32)] * 3
        assert fq.CalibStats.collect(iter(small)) == fq.CalibStats.collect(small)
    # A stationary stream far larger than what is kept: exact, memory bounded.
    import tracemalloc

    def gen():
        r = np.random.default_rng(7)
        for _ in range(100):
            yield r.standard_normal(100_000).astype(np.float32)

    tracemalloc.start()
    try:
        s = fq.CalibStats.collect(gen())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, peak  # the 10 M values are 40 MiB
    assert s.p99 == ref.calib_stats(list(gen()))[4]


def test_calib_stats_stream_with_its_largest_values_first_is_exact(rng):
    # 100 000 values near ±100, then 10 M near ±0.01: the p99 is a small value,
    # and the large ones that outrank it were let go while the count was small.
    # The stream's counts of every value (by bin) place it exactly.
    import warnings

    big = (rng.standard_normal(100_000) * 100).astype(np.float32)
    small = [(rng.standard_normal(1_000_000) * 0.01).astype(np.float32) for _ in range(10)]
    batches = [big, *small]
    want = fq.CalibStats.collect(batches)
    assert want.p99 == ref.calib_stats(batches)[4] and want.p99 < 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fq.CalibStats.collect(b for b in batches)
    assert got == want


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_calib_stats_stream_of_falling_magnitudes_is_exact(rng, dtype):
    # Each batch smaller than the last: the final p99 needs values of the first
    # batches that fell below what the count so far needed (found by a review,
    # the p99 was an upper bound with a warning). Also ties crowding one bin.
    import warnings

    falling = [(rng.standard_normal(1 << 17) * (16 - i)).astype(dtype) for i in range(16)]
    ties = [np.ones(1100, dtype), np.full(108_900, 0.25, dtype)]
    for batches in (falling, ties):
        want = ref.calib_stats(batches)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = fq.CalibStats.collect(b for b in batches)
        assert got == fq.CalibStats.collect(batches)
        assert (got.min, got.max, got.p99, got.suggested_scale) == (
            want[0],
            want[1],
            want[4],
            want[5],
        )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_calib_stats_fork_mid_stream_keeps_the_parent_exact():
    # The spill's file is shared with a child forked mid-stream (descriptor and
    # offset): the child must not use it (its p99 becomes a warned bound), and the
    # parent's values stay its own (found by a review: a silently wrong p99).
    import math
    import warnings

    parent = os.getpid()
    first = np.arange(1, 300_001, dtype=np.float32)  # past the 1 MiB buffer: on file

    def gen():
        yield first
        pid = os.fork()
        if pid:
            _, status = os.waitpid(pid, 0)
            gen.child_status = status
        for _ in range(4):
            yield np.full(500_000, 0.5 if pid == 0 else 0.0, np.float32)

    a = np.sort(np.concatenate([first, np.zeros(2_000_000, np.float32)]))
    want = float(a[math.ceil(0.99 * a.size) - 1])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = fq.CalibStats.collect(gen())
    except BaseException:
        if os.getpid() != parent:
            os._exit(3)
        raise
    if os.getpid() != parent:
        ok = any("forked" in str(w.message) for w in caught)
        os._exit(0 if ok else 1)
    assert not caught and got.p99 == want
    assert os.waitstatus_to_exitcode(gen.child_status) == 0


def test_calib_stats_total_is_checked():
    batches = [np.ones(10, np.float32)] * 3
    for bad in (1.5, "30", True, [30]):
        with pytest.raises(TypeError, match="total must be an int"):
            fq.CalibStats.collect(iter(batches), total=bad)
    for bad in (-1, 2**64):
        with pytest.raises(fq.InvalidConfigError, match="total must be a count"):
            fq.CalibStats.collect(iter(batches), total=bad)
    with pytest.raises(fq.InvalidConfigError, match=r"total.*25 values were announced"):
        fq.CalibStats.collect(iter(batches), total=25)
    # More announced than arrive: still exact (what more values would need is kept).
    assert fq.CalibStats.collect(iter(batches), total=np.int64(1000)) == fq.CalibStats.collect(
        batches
    )

    # A list is sized from its batches' shapes; a batch that then holds more values
    # (its shape lied) is named as such, not as a `total` the caller never passed.
    class Lying(np.ndarray):
        @property
        def shape(self):
            return (1,)

    with pytest.raises(fq.ShapeMismatchError, match=r"batches\[1\].*added up to 11 values"):
        fq.CalibStats.collect([np.ones(10, np.float32), np.arange(5, dtype=np.float32).view(Lying)])

    # Shapes that are no shapes are named too, not left to Python's arithmetic.
    class Shaped:
        def __init__(self, shape):
            self.shape = shape

        def __array__(self, dtype=None, copy=None):
            return np.ones(3, np.float32)

    for shape in ((2.5,), (-5,)):
        with pytest.raises(TypeError, match=r"batches\[1\] must be a floating array"):
            fq.CalibStats.collect([np.ones(3, np.float32), Shaped(shape)])
    with pytest.raises(fq.ShapeMismatchError, match=r"more than 2\*\*64 - 1"):
        fq.CalibStats.collect((Shaped((2**40, 2**40)),))


def test_calib_stats_errors():
    with pytest.raises(fq.NonFiniteError) as e:
        fq.CalibStats.collect([np.ones(3, np.float32), np.array([1, np.nan], np.float32)])
    assert e.value.index == 4 and "batches[1]" in str(e.value)
    with pytest.raises(TypeError, match=r"batches\[0\]"):
        fq.CalibStats.collect([np.ones(3, np.int64)])


# -- Regressions from the adversarial review -------------------------------------------


def test_smooth_factors_of_a_huge_empty_matrix_raise_memory_error():
    from helpers import run_python

    r = run_python(
        "import numpy as np, ferroquant as fq\n"
        "a = np.zeros((0, 2**40), np.float32)\n"
        "try:\n    fq.compute_smooth_factors(a, a)\n"
        "except MemoryError:\n    print('MemoryError')\n"
    )
    assert r.returncode == 0 and r.stdout.strip() == "MemoryError", r.stderr


def test_mae_and_compute_scale_check_their_arguments():
    q = fq.dynamic_quantize_int8(np.ones(3, np.float32))
    for bad in (np.array([1, np.nan, 1], np.float32), np.array([1.0, 1e39, 1.0])):
        with pytest.raises(fq.NonFiniteError, match="original") as e:
            fq.quantization_mae(bad, q)
        assert e.value.index == 1
    x = np.ones(3, np.float32)
    for bad in (0, -127, 1e39, float("nan"), float("inf")):
        with pytest.raises(fq.InvalidConfigError, match="clip_val"):
            fq.compute_scale(x, bad)
    for bad in (None, "127", True):
        with pytest.raises(TypeError, match="clip_val"):
            fq.compute_scale(x, bad)  # type: ignore[arg-type]
    # A valid clip that overflows the float32 quotient gives the seed's inf.
    assert fq.compute_scale(x, 1e-38) == np.float32(1) / np.float32(1e-38)
    assert fq.compute_scale(np.array([1, -3], np.float32), 1e-45) == math.inf
    assert fq.compute_scale(np.array([1, -3e38], np.float32), 0.5, fq.Percentile(1.0)) == math.inf


def test_config_values_beyond_float_range_are_invalid_configs():
    with pytest.raises(fq.InvalidConfigError):
        fq.Percentile(2**2000)
    with pytest.raises(fq.InvalidConfigError):
        fq.SmoothQuantConfig(alpha=2**2000)
    with pytest.raises(fq.InvalidConfigError, match="epsilon"):
        fq.SmoothQuantConfig(epsilon=1e39)
    with pytest.raises(fq.InvalidConfigError, match="epsilon"):
        fq.SmoothQuantConfig(epsilon=-1.0)


def test_smoothing_misaligned_and_aliased_arrays():
    buf = np.zeros(25, np.uint8)
    a = buf[1:].view(np.float32).reshape(3, 2)
    assert not a.flags.aligned
    a[:] = np.arange(6, dtype=np.float32).reshape(3, 2) * np.float32(0.3)
    want = a / np.float32(3.0)
    assert fq.smooth_activations(a, np.full(2, 3.0, np.float32)) is a  # in place all the same
    assert a.tobytes() == want.tobytes()
    before = a.copy()
    with pytest.raises(fq.NonFiniteError, match="s"):
        fq.smooth_weights(a, np.array([1.0, np.nan], np.float32))
    assert a.tobytes() == before.tobytes()
    a = np.arange(2, 8, dtype=np.float32).reshape(3, 2)
    want = a / a[0].copy()
    fq.smooth_activations(a, a[0])  # factors read as they were before the call
    assert a.tobytes() == want.tobytes()


def test_smoothing_factors_of_any_float_dtype_and_layout(rng):
    # s is read as any floating array: f64/f16/bf16 rounded to float32 value by
    # value, strided, misaligned and big-endian copies, a list.
    a = rng.standard_normal((3, 5)).astype(np.float32)
    s64 = rng.uniform(0.5, 4.0, 5)
    s32 = s64.astype(np.float32)
    raw = np.zeros(5 * 4 + 1, np.uint8)
    misaligned = raw[1:].view(np.float32)
    misaligned[:] = s32
    for s, want_s in (
        (s64, s32),
        (s64.astype(np.float16), s64.astype(np.float16).astype(np.float32)),
        (s64.astype(ml_dtypes.bfloat16), s64.astype(ml_dtypes.bfloat16).astype(np.float32)),
        (np.repeat(s32, 2)[::2], s32),
        (misaligned, s32),
        (s32.astype(">f4"), s32),
        (list(s64), s32),
    ):
        got_a, got_w = a.copy(), a.copy()
        fq.smooth_activations(got_a, s)
        fq.smooth_weights(got_w, s)
        assert got_a.tobytes() == (a / want_s).tobytes()
        assert got_w.tobytes() == (a * want_s).tobytes()
    # A float64 factor past float32's range is a non-finite factor.
    with pytest.raises(fq.NonFiniteError, match="s"):
        fq.smooth_weights(a.copy(), np.array([1.0, 1e39, 1.0, 1.0, 1.0]))


def test_dyn_quant_tensor_records_the_source_dtype_outside_equality(rng):
    x = rng.standard_normal((4, 6))
    for dt in (np.float16, ml_dtypes.bfloat16, np.float64, np.float32):
        q = fq.dynamic_quantize_int8_per_row(x.astype(dt))
        assert q.dtype == np.dtype(dt).name
        assert q.dequantize().dtype == np.float32  # the seed's dequantize, whatever the source
        back = fq.DynQuantTensor.from_bytes(q.to_bytes())
        assert back == q and back.dtype == q.dtype
    q16 = fq.dynamic_quantize_int4(x.astype(np.float16))
    q32 = fq.dynamic_quantize_int4(x.astype(np.float16).astype(np.float32))
    assert q16 == q32 and (q16.dtype, q32.dtype) == ("float16", "float32")
    assert "dtype=float16" in repr(q16) and "dtype" not in repr(q32)
    with pytest.raises(fq.InvalidConfigError, match="dtype"):
        fq.DynQuantTensor(q32.data, q32.scales, q32.shape, q32.format, dtype="int8")
    # A file written before the field existed (no "dtype" key) loads as float32.
    raw = q16.to_bytes()
    n = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8 : 8 + n])["__metadata__"]
    entry = json.loads(meta["ferroquant:value"])
    del entry["dtype"]
    meta["ferroquant:value"] = json.dumps(entry)
    old = safetensors.numpy.save(safetensors.numpy.load(raw), metadata=meta)
    back = fq.DynQuantTensor.from_bytes(old)
    assert back == q16 and back.dtype == "float32"
    entry["dtype"], entry["extra"] = "float16", 1
    meta["ferroquant:value"] = json.dumps(entry)
    with pytest.raises(fq.FormatError, match="unknown"):
        fq.DynQuantTensor.from_bytes(
            safetensors.numpy.save(safetensors.numpy.load(raw), metadata=meta)
        )


def test_int4_unused_high_nibble_must_be_zero():
    with pytest.raises(fq.InvalidConfigError, match="nibble"):
        fq.DynQuantTensor(
            np.array([0x71], np.uint8), np.ones(1, np.float32), (1,), "int4_per_tensor"
        )


def test_calib_stats_takes_an_array_as_one_batch_and_names_ragged_batches(rng):
    x = rng.standard_normal((50, 40)).astype(np.float32)
    assert fq.CalibStats.collect(x) == fq.CalibStats.collect(list(x))
    with pytest.raises(TypeError, match=r"batches\[1\]"):
        fq.CalibStats.collect([np.ones(3), [1.0, [2.0, 3.0]]])


def test_smooth_factors_report_activations_first_whatever_the_column():
    a = np.ones((2, 5000), np.float32)
    w = np.ones((2, 5000), np.float32)
    a[0, 4500] = np.nan  # second block of 4096 columns
    w[1, 0] = np.nan  # first block
    with pytest.raises(fq.NonFiniteError, match="activations") as e:
        fq.compute_smooth_factors(a, w)
    assert e.value.index == 4500
    s = fq.CalibStats.collect(np.float32(3.0))
    assert (s.min, s.max, s.p99) == (3.0, 3.0, 3.0)


def _stats_blob(**change):
    from helpers import craft

    entry = {
        "format_version": 1,
        "scheme": "calib-stats",
        "min": -1.0,
        "max": 4.0,
        "mean": 1.5,
        "std_dev": 1.7,
        "p99": 4.0,
        "suggested_scale": 4.0 / 127,
        "arrays": {},
    }
    entry.update(change)
    entry = {k: v for k, v in entry.items() if v is not ...}
    return craft({"__metadata__": {"ferroquant:value": json.dumps(entry)}})


def test_calib_stats_round_trip_and_refuse_hostile_entries(tmp_path):
    s = fq.CalibStats.collect([np.array([1.0, 2, 3], np.float32), np.array([-1.0, 0, 4])])
    assert fq.CalibStats.from_bytes(s.to_bytes()) == s
    fq.save(tmp_path / "s.safetensors", {"stats": s})
    assert fq.load(tmp_path / "s.safetensors") == {"stats": s}
    assert fq.CalibStats.from_bytes(_stats_blob()).p99 == 4.0
    for bad in (
        {"p99": "4"},
        {"p99": float("nan")},
        {"p99": -1.0},
        {"min": 5.0},
        {"mean": True},
        {"suggested_scale": ...},
        {"extra": 1},
        {"arrays": {"data": "x"}},
    ):
        with pytest.raises(fq.FormatError):
            fq.CalibStats.from_bytes(_stats_blob(**bad))
    with pytest.raises(fq.InvalidConfigError):
        fq.CalibStats(0.0, 1.0, 0.5, -0.1, 0.9, 0.01)
