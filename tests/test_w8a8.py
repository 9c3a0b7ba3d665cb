"""SPEC §3's W8A8 products (seed 002's ``w8a8_matvec`` and the batched form): bit-exact
against the seed's math in exact integers, sums past i32, errors that name the
argument and leave every array untouched, layouts, dtypes, threads."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import string_array
from hypothesis import given, settings
from hypothesis import strategies as st

import ferroquant as fq
from ferroquant import _reference as ref


def _weights(rng: np.random.Generator, out_f: int, in_f: int) -> np.ndarray:
    w = rng.integers(-128, 128, (out_f, in_f)).astype(np.int8)
    extremes = rng.random((out_f, in_f)) < 0.2
    w[extremes] = rng.choice(np.array([-128, 127, -127], np.int8), int(extremes.sum()))
    return w


def _activations(rng: np.random.Generator, shape) -> np.ndarray:
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0])).astype(np.float32)
    # Ties of the activation quantizer, zeros and a dominating outlier.
    flat = x.reshape(-1)
    if flat.size:
        flat[rng.random(flat.size) < 0.1] = 0.0
        flat[0] = np.float32(127.0 * rng.choice([1.0, -1.0]))
        flat[rng.random(flat.size) < 0.1] = np.float32(2.5)
    return x


@settings(max_examples=60, deadline=None)
@given(
    out_f=st.integers(0, 23),
    in_f=st.integers(1, 300),
    tokens=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_products_equal_the_exact_integer_reference(out_f, in_f, tokens, seed):
    rng = np.random.default_rng(seed)
    w = _weights(rng, out_f, in_f)
    s = (rng.random(out_f) * 0.02).astype(np.float32)
    x = _activations(rng, (tokens, in_f))
    got = fq.w8a8_matmul(w, s, x)
    assert got.dtype == np.float32 and got.shape == (tokens, out_f)
    assert got.tobytes() == ref.w8a8(w, s, x).tobytes()
    v = _activations(rng, (in_f,))
    got_v = fq.w8a8_matvec(w, s, v)
    assert got_v.dtype == np.float32 and got_v.shape == (out_f,)
    assert got_v.tobytes() == ref.w8a8(w, s, v).tobytes()


@pytest.mark.parametrize("in_f", [1, 63, 64, 65, 4096 + 31])
def test_every_row_and_token_remainder(in_f):
    rng = np.random.default_rng(in_f)
    for out_f, tokens in [(1, 1), (5, 3), (9, 7), (4, 4)]:
        w = _weights(rng, out_f, in_f)
        s = (rng.random(out_f) + 0.5).astype(np.float32)
        x = _activations(rng, (tokens, in_f))
        assert fq.w8a8_matmul(w, s, x).tobytes() == ref.w8a8(w, s, x).tobytes()


def test_sums_past_i32_are_exact():
    # 200,000 products of 127·127 sum to 3.2e9: the seed's i32 would wrap.
    n = 200_000
    w = np.full((3, n), 127, np.int8)
    w[1] = -128
    s = np.ones(3, np.float32)
    x = np.ones(n, np.float32)  # quantizes to 127 with scale 1/127
    got = fq.w8a8_matvec(w, s, x)
    a_scale = np.float32(1.0) / np.float32(127.0)
    for o, wv in enumerate([127, -128, 127]):
        acc = wv * 127 * n
        assert abs(acc) > 2**31
        assert got[o] == np.float32(np.float32(np.float32(acc) * np.float32(1.0)) * a_scale)
    batch = fq.w8a8_matmul(w, s, np.ones((2, n), np.float32))
    assert batch.tobytes() == np.stack([got, got]).tobytes()


def test_shapes_at_the_edges():
    w = np.ones((4, 3), np.int8)
    s = np.ones(4, np.float32)
    assert fq.w8a8_matmul(w, s, np.zeros((0, 3), np.float32)).shape == (0, 4)
    empty_w = np.zeros((0, 3), np.int8)
    assert fq.w8a8_matvec(empty_w, np.zeros(0, np.float32), np.ones(3, np.float32)).shape == (0,)
    assert fq.w8a8_matmul(empty_w, np.zeros(0, np.float32), np.ones((2, 3))).shape == (2, 0)
    # An all-zero activation has scale 0: every output is 0.
    assert not fq.w8a8_matvec(w, s, np.zeros(3, np.float32)).any()


def test_layouts_and_dtypes_give_the_values_read():
    rng = np.random.default_rng(3)
    w = _weights(rng, 16, 40)
    s = (rng.random(16) + 0.1).astype(np.float32)
    x = _activations(rng, (5, 40))
    want = ref.w8a8(w, s, x)
    wt = np.asfortranarray(w)  # not C-contiguous: read through one copy
    assert fq.w8a8_matmul(wt, s, x).tobytes() == want.tobytes()
    wide = np.zeros((5, 80), np.float32)
    wide[:, ::2] = x
    s_rev = s[::-1].copy()[::-1]  # a negative-stride view
    assert fq.w8a8_matmul(w, s_rev, wide[:, ::2]).tobytes() == want.tobytes()
    big_endian = x.astype(">f4")
    assert fq.w8a8_matmul(w, s, big_endian).tobytes() == want.tobytes()
    for dt in (np.float16, ml_dtypes.bfloat16, np.float64):
        xd = x.astype(dt)
        exact = ref.w8a8(w, s, xd.astype(np.float32))
        assert fq.w8a8_matmul(w, s, xd).tobytes() == exact.tobytes(), dt


def test_scales_of_any_byte_order_alignment_and_stride():
    rng = np.random.default_rng(8)
    w = _weights(rng, 3, 4)
    x = _activations(rng, (4,))
    s = np.array([1.0, 2.0, 3.0], np.float32)
    want = fq.w8a8_matvec(w, s, x)
    raw = bytearray(13)
    raw[1:] = s.tobytes()
    misaligned = np.frombuffer(raw, np.float32, offset=1)
    assert not misaligned.flags.aligned
    for variant in (misaligned, s.astype(">f4"), np.repeat(s, 2)[::2]):
        assert fq.w8a8_matvec(w, variant, x).tobytes() == want.tobytes()
        assert fq.w8a8_matmul(w, variant, x[None]).tobytes() == want.tobytes()


def test_scales_of_other_float_dtypes_are_read_as_float32():
    rng = np.random.default_rng(9)
    w = _weights(rng, 3, 40)
    x = _activations(rng, (2, 40))
    # Not representable in float32: the kernel multiplies by the rounded value.
    s64 = np.array([0.1, 1 / 3, 2.000000001])
    assert not np.array_equal(s64.astype(np.float32).astype(np.float64), s64)
    for s in (s64, s64.astype(np.float16), s64.astype(ml_dtypes.bfloat16), s64.tolist()):
        s32 = np.asarray(s).astype(np.float32)
        want = ref.w8a8(w, s32, x)
        assert fq.w8a8_matmul(w, s, x).tobytes() == want.tobytes()
        assert fq.w8a8_matvec(w, s, x[0]).tobytes() == want[0].tobytes()
    with pytest.raises(fq.NonFiniteError, match="weight_scales") as e:
        fq.w8a8_matvec(w, np.array([1.0, 1e39, 1.0]), x[0])  # past float32: inf
    assert e.value.index == 1


def test_errors_name_the_argument_and_change_nothing():
    w = np.ones((2, 3), np.int8)
    s = np.ones(2, np.float32)
    x = np.ones(3, np.float32)
    before = [a.copy() for a in (w, s, x)]
    with pytest.raises(fq.EmptyInputError, match="activation"):
        fq.w8a8_matvec(w, s, np.zeros(0, np.float32))
    # The seed checks the empty activation before any length: so do we, once the
    # types are known good.
    for weight, scales in ((w, np.ones(5, np.float32)), (np.ones(6, np.int8), s)):
        with pytest.raises(fq.EmptyInputError, match="activation"):
            fq.w8a8_matvec(weight, scales, np.zeros(0, np.float32))
    with pytest.raises(TypeError, match="weight_scales"):
        fq.w8a8_matvec(w, np.ones(2, np.int32), np.zeros(0, np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="activation"):
        fq.w8a8_matvec(w, s, np.ones(4, np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="activation"):
        fq.w8a8_matvec(w, s, np.ones((1, 3), np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="weight_i8"):
        fq.w8a8_matvec(np.ones(6, np.int8), s, x)
    with pytest.raises(fq.ShapeMismatchError, match="weight_scales"):
        fq.w8a8_matvec(w, np.ones(3, np.float32), x)
    with pytest.raises(TypeError, match="weight_i8 must be an int8"):
        fq.w8a8_matvec(w.astype(np.int16), s, x)
    with pytest.raises(TypeError, match="weight_i8 must be an int8"):
        fq.w8a8_matvec(w.astype(np.uint8), s, x)
    with pytest.raises(TypeError, match="weight_i8 must be an int8"):
        fq.w8a8_matvec(w.tolist(), s, x)
    with pytest.raises(TypeError, match="weight_i8 must be an int8"):
        fq.w8a8_matvec(None, s, np.zeros(0, np.float32))  # the type, before emptiness
    with pytest.raises(TypeError, match="weight_scales"):
        fq.w8a8_matvec(w, None, np.zeros(0, np.float32))
    with pytest.raises(TypeError, match="weight_scales"):
        fq.w8a8_matmul(np.zeros((2, 0), np.int8), None, np.zeros((3, 0), np.float32))
    with pytest.raises(TypeError, match="weight_scales must be a floating array"):
        fq.w8a8_matvec(w, s.astype(np.int32), x)
    with pytest.raises(TypeError, match="weight_scales must be a floating array"):
        fq.w8a8_matvec(w, string_array(["1", "2"]), x)
    with pytest.raises(TypeError, match="activation"):
        fq.w8a8_matvec(w, s, np.ones(3, np.int32))
    with pytest.raises(fq.NonFiniteError, match="activation") as e:
        fq.w8a8_matvec(w, s, np.array([1.0, np.nan, 2.0], np.float32))
    assert e.value.index == 1
    with pytest.raises(fq.NonFiniteError, match="weight_scales") as e:
        fq.w8a8_matvec(w, np.array([1.0, np.inf], np.float32), x)
    assert e.value.index == 1
    with pytest.raises(fq.NonFiniteError, match="activations") as e:
        fq.w8a8_matmul(w, s, np.array([[1.0, 2.0, 3.0], [0.0, 0.0, -np.inf]], np.float32))
    assert e.value.index == 5
    # A float64 value past float32's range is named with its own value, for either
    # argument (the scales' message once quoted the activation's value at that index).
    big = np.array([1.0, 1e300])
    for call, arg, value, index in (
        (lambda: fq.w8a8_matvec(w, big, x.astype(np.float64)), "weight_scales", 1e300, 1),
        (lambda: fq.w8a8_matmul(w, big, np.ones((2, 3))), "weight_scales", 1e300, 1),
        (lambda: fq.w8a8_matvec(w, s, np.array([1.0, 2.0, -1e300])), "activation", -1e300, 2),
        (
            lambda: fq.w8a8_matmul(w, big[:1].repeat(2), np.array([[1.0, 1e39, 0.0]])),
            "activations",
            1e39,
            1,
        ),
    ):
        with pytest.raises(fq.NonFiniteError) as e:
            call()
        said = f"{arg} holds {value!r} at flat index {index}, beyond float32's range"
        assert str(e.value).startswith(said)
        assert e.value.index == index
    with pytest.raises(fq.NonFiniteError, match=r"^weight_scales holds a non-finite value") as e:
        fq.w8a8_matvec(w, np.array([1.0, np.nan]), x.astype(np.float64))
    assert e.value.index == 1
    with pytest.raises(fq.EmptyInputError, match="in_features"):
        fq.w8a8_matmul(np.zeros((2, 0), np.int8), s, np.zeros((3, 0), np.float32))
    with pytest.raises(fq.ShapeMismatchError, match="activations"):
        fq.w8a8_matmul(w, s, x)
    for a, b in zip((w, s, x), before, strict=True):
        assert a.tobytes() == b.tobytes()


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(11)
    w = _weights(rng, 1000, 1500)
    s = (rng.random(1000) * 0.01).astype(np.float32)
    x = _activations(rng, (9, 1500))
    old = fq.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 3):
            fq.set_num_threads(n)
            runs.append((fq.w8a8_matmul(w, s, x).tobytes(), fq.w8a8_matvec(w, s, x[0]).tobytes()))
    finally:
        fq.set_num_threads(old)
    assert runs[0] == runs[1] == runs[2]
    assert np.array_equal(
        np.frombuffer(runs[0][0], np.float32).reshape(9, 1000)[:, :50], ref.w8a8(w[:50], s[:50], x)
    )
