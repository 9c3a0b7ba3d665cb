"""SPEC §3 (dynamic activation quantization, seed 002) and §4 (BitNet activations,
seed 003): bit-exact against the NumPy ports of the seeds, and each family's own
semantics: scale modes, formats, empty inputs, dataclasses, errors."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
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


def test_errors_name_the_argument():
    with pytest.raises(fq.ShapeMismatchError, match="x2d"):
        fq.dynamic_quantize_int8_per_row(np.zeros(4, np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="x2d"):
        fq.dynamic_quantize_int8_per_row(np.zeros((2, 2, 2), np.float32))
    for bad in (0.0, -0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(fq.InvalidConfigError, match="p"):
            fq.Percentile(bad)
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
