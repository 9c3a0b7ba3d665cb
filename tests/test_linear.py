"""The fused ``QuantizedLinear.forward``: within float32 rounding of
``x @ dequantize(W).T + bias`` on both paths (a few tokens: dequantizing dot products;
from 8 tokens: exact panels through a GEMM), for every weight scheme and layout, never
holding the float32 weight, with typed errors."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ferroquant as fq

CONFIGS = [
    fq.QuantConfig.int8(),
    fq.QuantConfig.int8().asymmetric(),
    fq.QuantConfig.int8_per_channel(),
    fq.QuantConfig.int8_per_channel().asymmetric(),
    fq.QuantConfig.int4(),
    fq.QuantConfig.int4().asymmetric(),
    fq.QuantConfig.int4_per_channel(),
    fq.QuantConfig.int4_per_channel().asymmetric(),
]


def check(layer: fq.QuantizedLinear, x: np.ndarray) -> np.ndarray:
    """forward(x) against the product in float64 of the float32 dequantized weight,
    with a bound of (in + 3) unit roundoffs of Σ|x·w| + |b| per output."""
    got = layer.forward(x)
    w = fq.dequantize(layer.weight_quantized).astype(np.float32).astype(np.float64)
    x64 = np.asarray(x, np.float32).astype(np.float64)
    b = np.zeros(layer.out_features) if layer.bias is None else layer.bias.astype(np.float64)
    want = x64 @ w.T + b
    bound = (np.abs(x64) @ np.abs(w).T + np.abs(b)) * (layer.in_features + 3) * 2.0**-23
    assert got.dtype == np.float32
    assert got.shape == (*x.shape[:-1], layer.out_features)
    assert np.all(np.abs(got - want) <= bound + 1e-30)
    return got


@settings(max_examples=40, deadline=None)
@given(
    out_f=st.integers(1, 40),
    in_f=st.integers(1, 150),
    tokens=st.sampled_from([1, 2, 3, 7, 8, 9, 20]),
    config=st.sampled_from(CONFIGS),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_forward_is_within_float32_rounding(out_f, in_f, tokens, config, with_bias, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out_f, in_f)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    if rng.random() < 0.3:
        w += np.float32(rng.choice([5.0, -5.0]))  # one-signed rows: large zero points
    b = rng.standard_normal(out_f).astype(np.float32) if with_bias else None
    layer = fq.QuantizedLinear.from_linear(w, b, config)
    check(layer, rng.standard_normal((tokens, in_f)).astype(np.float32))


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_batch_shapes_and_both_paths(config):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((33, 65)).astype(np.float32)  # odd in: int4 rows split bytes
    layer = fq.QuantizedLinear.from_linear(w, rng.standard_normal(33).astype(np.float32), config)
    for shape in [(65,), (1, 65), (4, 65), (2, 3, 65), (8, 65), (64, 65), (2, 40, 65)]:
        check(layer, rng.standard_normal(shape).astype(np.float32))
    assert layer.forward(np.zeros((0, 65), np.float32)).shape == (0, 33)
    assert layer.forward(np.zeros((2, 0, 65), np.float32)).shape == (2, 0, 33)


def test_inputs_of_every_dtype_and_layout():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 48)).astype(np.float32)
    layer = fq.QuantizedLinear.from_linear(w, None, fq.QuantConfig.int8_per_channel())
    x = rng.standard_normal((10, 48)).astype(np.float32)
    want = layer.forward(x)
    assert layer.forward(np.asfortranarray(x)).tobytes() == want.tobytes()
    assert layer.forward(x.astype(">f4")).tobytes() == want.tobytes()
    wide = np.zeros((10, 96), np.float32)
    wide[:, ::2] = x
    assert layer.forward(wide[:, ::2]).tobytes() == want.tobytes()
    assert layer.forward(x.astype(np.float64)).tobytes() == want.tobytes()
    check(layer, x.astype(np.float16))


class _Sub(np.ndarray):
    pass


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_the_direct_path_agrees_with_the_general_one(config):
    """C-contiguous float32 tokens (1-D or 2-D) go straight to the kernel; a subclass,
    another byte order, a misaligned or strided buffer or a 3-D batch take the general
    path: the same bytes either way."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    layer = fq.QuantizedLinear.from_linear(w, rng.standard_normal(40).astype(np.float32), config)
    for shape in [(64,), (1, 64), (3, 64), (12, 64)]:
        x = rng.standard_normal(shape).astype(np.float32)
        got = check(layer, x)
        raw = np.zeros(x.nbytes + 1, np.uint8)
        misaligned = raw[1:].view(np.float32).reshape(shape)
        misaligned[...] = x
        strided = np.zeros((*shape[:-1], 128), np.float32)
        strided[..., ::2] = x
        for other in (x.view(_Sub), x.astype(">f4"), misaligned, strided[..., ::2]):
            assert layer.forward(other).tobytes() == got.tobytes()
        assert layer.forward(x[None]).tobytes() == got.tobytes()  # 3-D (or 2-D) batch
        assert not np.shares_memory(got, x)


def test_errors_name_the_argument():
    rng = np.random.default_rng(3)
    layer = fq.QuantizedLinear.from_linear(rng.standard_normal((4, 6)).astype(np.float32))
    x = np.ones((3, 6), np.float32)
    x[1, 2] = np.nan
    with pytest.raises(fq.NonFiniteError, match="x") as e:
        layer.forward(x)
    assert e.value.index == 8
    big = np.ones(6)
    big[4] = 1e300  # beyond float32
    with pytest.raises(fq.NonFiniteError, match="x") as e:
        layer.forward(big)
    assert e.value.index == 4
    with pytest.raises(fq.ShapeMismatchError, match="x"):
        layer.forward(np.ones((3, 5), np.float32))
    with pytest.raises(TypeError, match="x"):
        layer.forward(np.ones(6, np.int32))


@pytest.mark.parametrize("tokens", [1, 16])
@pytest.mark.parametrize(
    "config", [fq.QuantConfig.int8_per_channel(), fq.QuantConfig.int4_per_channel()], ids=str
)
def test_no_temporary_as_large_as_the_float_weight(tokens, config):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((1024, 2048)).astype(np.float32)  # 8 MiB as float32
    layer = fq.QuantizedLinear.from_linear(w, None, config)
    x = rng.standard_normal((tokens, 2048)).astype(np.float32)
    layer.forward(x)  # warm up
    tracemalloc.start()
    try:
        layer.forward(x)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < w.nbytes // 8, peak


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((500, 700)).astype(np.float32)
    layer = fq.QuantizedLinear.from_linear(w, None, fq.QuantConfig.int4_per_channel().asymmetric())
    old = fq.get_num_threads()
    try:
        for tokens in (1, 12):
            x = rng.standard_normal((tokens, 700)).astype(np.float32)
            runs = []
            for n in (1, 2, 3):
                fq.set_num_threads(n)
                runs.append(layer.forward(x).tobytes())
            assert runs[0] == runs[1] == runs[2]
    finally:
        fq.set_num_threads(old)


def test_intermediate_sums_do_not_overflow_where_the_product_does_not():
    # Σ x·(q - zp) alone would pass float32's range (127x the result); each value is
    # dequantized before it is multiplied, on the dot path as on the panel path.
    w = np.array([[1e-3, -2e-3]], np.float32)
    layer = fq.QuantizedLinear.from_linear(w, None, fq.QuantConfig.int8())
    x = np.array([[1e37, 1e37]], np.float32)
    want = x.astype(np.float64) @ fq.dequantize(layer.weight_quantized).astype(np.float64).T
    for xs in (x, np.repeat(x, 8, 0)):
        got = layer.forward(xs)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.parametrize("scale", [1e300, 1.234567e-40, 1e-60])
def test_scales_outside_float32_take_the_exact_path(scale):
    # dequantize() computes (q - zp) * scale in float64 and rounds once: a scale
    # beyond float32 (or subnormal in it) must not be rounded on its own first.
    # (A scale beyond float32 comes only from a float64 source.)
    rng = np.random.default_rng(6)
    cfg = fq.QuantConfig.int8()
    codes = rng.integers(-127, 128, 64).astype(np.int8)
    codes[:8] = 0
    src = "float64" if scale > 1 else "float32"
    qt = fq.QuantizedTensor(codes, np.array([scale]), np.array([0.0]), (1, 64), src, cfg)
    layer = fq.QuantizedLinear(qt)
    deq = fq.dequantize(qt).astype(np.float64)
    for tokens in (1, 8):
        x = rng.uniform(0.5, 1, (tokens, 64)).astype(np.float32)
        x[:, 8:] = 0.0 if scale > 1 else x[:, 8:] * np.float32(1e30)
        got = layer.forward(x)
        with np.errstate(invalid="ignore", over="ignore"):
            want = x.astype(np.float64) @ deq.T
        assert np.array_equal(np.isnan(got), np.isnan(want))
        ok = np.isfinite(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=1e-6)


def _pack(codes: np.ndarray) -> np.ndarray:
    c = np.concatenate([codes, np.zeros(len(codes) % 2, np.int8)]).astype(np.uint8)
    return ((c[0::2] & 15) | ((c[1::2] & 15) << 4)).astype(np.uint8)


def test_values_near_float32_max_stay_finite_on_the_dot_path():
    # The scale and zero point of data at +-float32's max (2 max / (qmax - qmin),
    # zero point -1): the widest codes' values (which padding lanes may compute)
    # pass float32's range, the codes used do not. The few-token path must give
    # the finite product the panel path and dequantize() give.
    top = float(np.finfo(np.float32).max)
    cases = [
        fq.QuantizedTensor(
            np.array([1, 2, 3, 4, 5], np.int8),
            np.array([2 * top / 255]),
            np.array([-1.0]),
            (1, 5),
            "float32",
            fq.QuantConfig.int8().asymmetric(),
        ),
        fq.QuantizedTensor(
            _pack(np.array([1, 2, 3, 4, 5, 6], np.int8)),
            np.array([2 * top / 15]),
            np.array([-1.0]),
            (1, 6),
            "float32",
            fq.QuantConfig.int4().asymmetric(),
        ),
    ]
    for bits, qt in zip((8, 4), cases, strict=True):
        cfg = fq.QuantConfig(bits, "asymmetric")
        made = fq.quantize(np.array([[-top, top]], np.float32), cfg)
        assert (made.scales, made.zero_points) == (qt.scales, qt.zero_points)
    for qt in cases:
        layer = fq.QuantizedLinear(qt)
        x = np.full((1, qt.shape[1]), 1e-30, np.float32)
        want = x.astype(np.float64) @ fq.dequantize(qt).astype(np.float64).T
        for xs in (x, np.repeat(x, 8, 0)):
            np.testing.assert_allclose(layer.forward(xs)[0], want[0], rtol=1e-5)
    w = np.array([[np.finfo(np.float32).max, 1.0, 2.0]], np.float32)
    layer = fq.QuantizedLinear.from_linear(w, None, fq.QuantConfig.int8())
    x = np.array([[1e-3, 1.0, 1.0]], np.float32)
    want = x.astype(np.float64) @ fq.dequantize(layer.weight_quantized).astype(np.float64).T
    for xs in (x, np.repeat(x, 8, 0)):
        np.testing.assert_allclose(layer.forward(xs)[0], want[0], rtol=1e-6)


def test_sums_that_leave_float32_only_in_a_fixed_order_are_redone():
    # Terms near 2e38 of both signs: the exact sum is finite, a float32 sum in the
    # wrong order is not. Both paths give the finite value.
    layer = fq.QuantizedLinear.from_linear(np.ones((1, 3), np.float32), None, fq.QuantConfig.int8())
    x = np.array([[2e38, -2e38, 2e38]], np.float32)
    want = x.astype(np.float64) @ fq.dequantize(layer.weight_quantized).astype(np.float64).T
    for xs in (x, np.repeat(x, 8, 0)):
        got = layer.forward(xs)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    # A product that truly leaves float32 stays inf.
    over = np.array([[3e38, 3e38, 3e38]], np.float32)
    assert np.all(np.isinf(layer.forward(over)))


def test_float64_weights_past_float32_keep_their_float64_values():
    # An adversarial review: a float64 weight holding +1e39 and -1e39 gave NaN, where
    # x @ dequantize(W).T (float64 values, as dequantize returns them) is finite.
    w = np.linspace(-1, 1, 37)
    w[5], w[6] = 1e39, -1e39
    layer = fq.QuantizedLinear.from_linear(w.reshape(1, -1), np.array([0.5], np.float32))
    deq = fq.dequantize(layer.weight_quantized)
    assert deq.dtype == np.float64 and deq[0, 5] == 1e39
    for tokens in (1, 9):
        for x6 in (1.0, 0.5):  # cancelling: finite; not cancelling: past float32, inf
            x = np.ones((tokens, 37), np.float32)
            x[:, 6] = x6
            with np.errstate(over="ignore"):
                want = (x.astype(np.float64) @ deq.T + 0.5).astype(np.float32)
            got = layer.forward(x)
            assert np.isfinite(want).all() == (x6 == 1.0)
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_weights_use_their_dequantized_half_values(dtype):
    # A review: forward used each weight rounded to float32, where dequantize()
    # rounds it to the weight's own dtype (f16: 2^-11 relative), and a value past
    # 65504 is inf there but finite in float32.
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    rng = np.random.default_rng(12)
    npdt = np.dtype(dtype)
    for cfg in CONFIGS:
        w = rng.standard_normal((16, 64)).astype(npdt)
        layer = fq.QuantizedLinear.from_linear(w, None, cfg)
        deq = fq.dequantize(layer.weight_quantized)
        assert deq.dtype == npdt
        deq64 = deq.astype(np.float64)
        for tokens in (1, 9):
            x = rng.standard_normal((tokens, 64)).astype(np.float32)
            want = x.astype(np.float64) @ deq64.T
            bound = (np.abs(x).astype(np.float64) @ np.abs(deq64).T) * 67 * 2.0**-24
            assert np.all(np.abs(layer.forward(x) - want) <= bound + 1e-30), (cfg, tokens)
    if dtype == "float16":
        w16 = np.array([[65504, -65504, 1, 2]], np.float16)
        for cfg in (fq.QuantConfig.int8().asymmetric(), fq.QuantConfig.int4().asymmetric()):
            layer = fq.QuantizedLinear.from_linear(w16, None, cfg)
            deq = fq.dequantize(layer.weight_quantized).astype(np.float64)
            assert np.isinf(deq).any()
            for tokens in (1, 9):
                x = np.ones((tokens, 4), np.float32)
                with np.errstate(invalid="ignore", over="ignore"):
                    want = (x.astype(np.float64) @ deq.T).astype(np.float32)
                np.testing.assert_array_equal(layer.forward(x), want)


def test_float64_weights_below_float32_range_keep_their_values():
    # A review: a hand-built float64 tensor with a scale below float32's normal
    # range (1e-50) had its values rounded to float32 (0) on the panel path.
    for scale in (1e-50, 1e-44, 3e-39):
        q = fq.QuantizedTensor(
            np.array([100, -50, 25, 7, -1, 3], np.int8),
            np.array([scale, 2 * scale]),
            np.zeros(2),
            (2, 3),
            "float64",
            fq.QuantConfig(8, "symmetric", "per_channel"),
        )
        layer = fq.QuantizedLinear(q, np.array([0.0, 1e-30], np.float32))
        for tokens in (1, 9):
            x = np.full((tokens, 3), 1e30, np.float32)
            want = (x.astype(np.float64) @ fq.dequantize(q).T + [0.0, 1e-30]).astype(np.float32)
            np.testing.assert_allclose(layer.forward(x), want, rtol=1e-6, atol=0)


def test_pickles_rebuild_the_layer_from_private_arrays():
    """A layer pickles as its constructor call: out-of-band buffers (protocol 5) are
    the caller's memory, and changing them after the load must not reach the loaded
    layer's direct path; every copy's bias is read-only; the slot state older
    versions pickled still loads."""
    import copy
    import pickle

    rng = np.random.default_rng(6)
    for config in (fq.QuantConfig.int8_per_channel(), fq.QuantConfig.int4().asymmetric()):
        w = rng.standard_normal((16, 32)).astype(np.float32)
        layer = fq.QuantizedLinear.from_linear(w, rng.standard_normal(16), config)
        x = rng.standard_normal(32).astype(np.float32)
        want = layer.forward(x).tobytes()
        buffers: list = []
        blob = pickle.dumps(layer, protocol=5, buffer_callback=buffers.append)
        mutable = [bytearray(b.raw()) for b in buffers]
        assert mutable, "the weight's arrays go out of band"
        clone = pickle.loads(blob, buffers=mutable)
        for m in mutable:
            m[:] = b"\x80" * len(m)
        assert clone.forward(x).tobytes() == want
        assert clone.forward(x.view(_Sub)).tobytes() == want
        copies = [copy.copy(layer), copy.deepcopy(layer)]
        copies += [pickle.loads(pickle.dumps(layer, protocol=p)) for p in range(6)]
        for c in copies:
            assert c.forward(x).tobytes() == want
            assert not c.bias.flags.writeable
        old = fq.QuantizedLinear.__new__(fq.QuantizedLinear)
        old.__setstate__((None, {"_bias": layer.bias, "_weight_q": layer.weight_quantized}))
        assert old.forward(x).tobytes() == want
        bad_states = [
            (None, {}),
            ("garbage", {"_weight_q": layer.weight_quantized}),
            (None, {"_weight_q": layer.weight_quantized, "unknown": 1}),
            {"_native_head": ()},
            {"_plan": None},
            {"tag": 1},  # plain layers have no attributes of their own
            [1, 2],
        ]
        for state in bad_states:
            with pytest.raises(TypeError, match="pickled state"):
                clone.__setstate__(state)
        with pytest.raises(TypeError, match="pickled state"):  # not built by the constructor
            fq.QuantizedLinear.__new__(fq.QuantizedLinear).__setstate__({})


def test_a_failed_rebuild_leaves_the_layer_as_it_was():
    """``__init__`` called again with a bad bias, or an old-style pickled state on a
    built layer, changes nothing: both paths still give the first layer's result."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((4, 8)).astype(np.float32)
    layer = fq.QuantizedLinear.from_linear(w, np.ones(4, np.float32))
    other = fq.QuantizedLinear.from_linear(w * 10)
    x = rng.standard_normal(8).astype(np.float32)
    want = layer.forward(x).tobytes()
    with pytest.raises(fq.ShapeMismatchError, match="bias"):
        layer.__init__(other.weight_quantized, np.ones(3, np.float32))
    with pytest.raises(TypeError, match="pickled state"):
        layer.__setstate__((None, {"_weight_q": other.weight_quantized, "_bias": None}))
    assert layer.weight_quantized is not other.weight_quantized
    for arg in (x, x.astype(">f4")):  # the plan, and the general path
        assert layer.forward(arg).tobytes() == want


def test_the_native_plan_refuses_other_code_widths():
    from ferroquant import _ferroquant

    codes, ones, zeros = np.zeros(8, np.int8), np.ones(2), np.zeros(2)
    with pytest.raises(ValueError, match="bits: expected 8 or 4, got 3"):
        _ferroquant.LinearPlan(codes, 3, 2, 4, ones, zeros, None, "float32")
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="bits: expected 8 or 4, got 16"):
        _ferroquant.LinearPlan(codes, 16, 2, 4, ones, zeros, None, "float32")
    plan = _ferroquant.LinearPlan(codes + 1, 8, 2, 4, ones, zeros, None, "float32")
    assert plan(x).tolist() == [4.0, 4.0]
    assert plan(x.astype(np.float64)) is None  # the general path's to take


class _Tagged(fq.QuantizedLinear):
    pass


class _Scaled(fq.QuantizedLinear):
    __slots__ = ("__private", "scale")

    def __init__(self, weight_q, scale=1.0):
        super().__init__(weight_q)
        self.scale = scale
        self.__private = -scale


def test_subclasses_keep_their_class_and_attributes_through_copies():
    import copy
    import pickle

    rng = np.random.default_rng(7)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    x = rng.standard_normal(16).astype(np.float32)
    tagged = _Tagged.from_linear(w, None, fq.QuantConfig.int8_per_channel())
    tagged.tag = "kept"
    tagged._native_tail = "its own"  # a name the layer itself used before its plan
    scaled = _Scaled(fq.quantize(w, fq.QuantConfig.int4_per_channel()), 2.0)
    tagged_attrs = {"tag": "kept", "_native_tail": "its own"}
    cases = [(tagged, tagged_attrs), (scaled, {"scale": 2.0, "_Scaled__private": -2.0})]
    for layer, attrs in cases:
        want = layer.forward(x).tobytes()
        copies = [copy.copy(layer), copy.deepcopy(layer)]
        copies += [pickle.loads(pickle.dumps(layer, protocol=p)) for p in range(6)]
        for c in copies:
            assert type(c) is type(layer)
            assert c.forward(x).tobytes() == want
            for name, value in attrs.items():
                assert getattr(c, name) == value
    # The slot state older versions wrote for a subclass, attributes included.
    old = _Tagged.__new__(_Tagged)
    slots = {"_weight_q": tagged.weight_quantized, "_bias": None, "_native_head": ()}
    old.__setstate__(({"tag": "old"}, slots))
    assert old.tag == "old" and old.forward(x).tobytes() == tagged.forward(x).tobytes()


def test_a_half_or_double_activation_is_summed_a_block_of_tokens_at_a_time():
    # 8192 columns: blocks of 256 tokens (8 MiB of float32); 600 tokens make
    # blocks of 256, 256 and 88, each summed as a float32 call of its own tokens.
    rng = np.random.default_rng(5)
    in_f, tokens = 8192, 600
    layer = fq.QuantizedLinear.from_linear(
        rng.standard_normal((24, in_f)).astype(np.float32),
        rng.standard_normal(24).astype(np.float32),
        fq.QuantConfig.int4_per_channel(),
    )
    x16 = rng.standard_normal((tokens, in_f)).astype(np.float16)
    x32 = x16.astype(np.float32)

    def by_blocks(x):
        x32 = x.astype(np.float32)
        return np.concatenate(
            [layer.forward(x32[a:b]) for a, b in ((0, 256), (256, 512), (512, 600))]
        )

    for x in (x16, x16.astype(np.float64), x32.astype(ml_dtypes.bfloat16)):
        assert layer.forward(x).tobytes() == by_blocks(x).tobytes(), x.dtype
    check(layer, x16)
    # A few tokens: one block, the float32 call's own bits.
    assert layer.forward(x16[:5]).tobytes() == layer.forward(x32[:5]).tobytes()
    # The first non-finite value is counted from the start of x, in any block.
    for where in ((3, 7), (300, 11), (590, 8191)):
        bad = x16.astype(np.float64)
        bad[where] = 1e39  # finite in float64, +inf in float32
        with pytest.raises(fq.NonFiniteError) as e:
            layer.forward(bad)
        assert e.value.index == where[0] * in_f + where[1]
