"""Every array the kernels read, placed against an unmapped page.

``python tests/fence.py`` patches the native module so that each array argument of
each native call is first copied into memory that ends (and then, in a second call,
starts) at a page with no access rights, and runs the whole public API over many
lengths, shapes and dtypes. A vector load one byte past the end of an input, or one
byte before its start, then faults at once instead of reading a neighbour's bytes.
The two calls must also give the same results, whatever the input's alignment.

The instruction set is chosen once a process, so ``test_fence.py`` runs this driver
once for each tier the CPU supports (``FERROQUANT_SIMD``). A fault kills the process
with SIGSEGV; the last ``call`` line on stderr names the native function and lengths.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, List, Tuple

import numpy as np

import ferroquant as fq
from ferroquant import _ferroquant as native

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PROT_NONE = 0


def fenced(arr: np.ndarray, at_end: bool) -> np.ndarray:
    """A C-contiguous copy of ``arr`` whose bytes end (``at_end``) or start right at
    a page that faults on any access; writable exactly when ``arr`` is."""
    arr = np.asarray(arr)
    nbytes = arr.nbytes
    pages = max(1, -(-nbytes // PAGE))
    region = mmap.mmap(-1, (pages + 2) * PAGE)
    base = np.frombuffer(region, np.uint8)
    addr = base.ctypes.data
    for page in (0, pages + 1):
        if _libc.mprotect(addr + page * PAGE, PAGE, PROT_NONE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
    start = PAGE + (pages * PAGE - nbytes if at_end else 0)
    out = base[start : start + nbytes].view(arr.dtype).reshape(arr.shape)
    out[...] = arr
    if not arr.flags.writeable:
        out.flags.writeable = False
    return out


def _fence_args(args: Tuple[Any, ...], at_end: bool) -> List[Any]:
    out: List[Any] = []
    for a in args:
        if isinstance(a, np.ndarray) and a.flags.c_contiguous and a.dtype != object:
            out.append(fenced(a, at_end))
        elif isinstance(a, list):
            out.append(_fence_args(tuple(a), at_end))
        elif isinstance(a, tuple):
            out.append(tuple(_fence_args(a, at_end)))
        else:
            out.append(a)
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float):
        return isinstance(b, float) and (a == b or (a != a and b != b))
    return bool(a == b)


def _shapes(args: Tuple[Any, ...]) -> str:
    return ", ".join(
        f"{a.dtype}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__ for a in args
    )


CALLS = {"count": 0}


def _agree(name: str, calls: List[Callable[[], Any]]) -> Any:
    """Run the end-fenced and start-fenced calls: both must agree (or raise the same
    exception type)."""
    results = []
    for f in calls:
        try:
            results.append(("ok", f()))
        except Exception as e:  # compared below, then re-raised
            results.append(("err", e))
    (k1, r1), (k2, r2) = results
    if k1 != k2 or (k1 == "err" and type(r1) is not type(r2)):
        raise AssertionError(f"{name}: end-fenced {r1!r} but start-fenced {r2!r}")
    if k1 == "err":
        raise r2
    if not _same(r1, r2):
        raise AssertionError(f"{name}: the result depends on the input's placement")
    return r2


def _pure(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Call ``fn`` with inputs fenced at their end, then at their start; both must
    agree (or raise the same exception type)."""

    def call(*args: Any) -> Any:
        CALLS["count"] += 1
        print(f"call {name}({_shapes(args)})", file=sys.stderr, flush=True)
        return _agree(name, [lambda e=e: fn(*_fence_args(args, e)) for e in (True, False)])

    return call


_REAL_PLAN = native.LinearPlan


class _Plan:
    """``LinearPlan`` (``QuantizedLinear.forward``'s fast path) built twice, on the
    weight's arrays fenced at their end and at their start; a call runs both, on an
    ``x`` the fast path takes fenced the same way (any other ``x`` as it is)."""

    def __init__(self, *args: Any) -> None:
        self._plans = [_REAL_PLAN(*_fence_args(args, e)) for e in (True, False)]

    def __call__(self, x: Any) -> Any:
        CALLS["count"] += 1
        print(f"call LinearPlan({_shapes((x,))})", file=sys.stderr, flush=True)
        direct = type(x) is np.ndarray and x.flags.c_contiguous
        calls = [
            lambda p=p, e=e: p(fenced(x, e) if direct else x)
            for p, e in zip(self._plans, (True, False), strict=True)
        ]
        return _agree("LinearPlan", calls)

    def run(self, x: np.ndarray, tokens: int) -> Any:
        CALLS["count"] += 1
        print(f"call LinearPlan.run({_shapes((x,))})", file=sys.stderr, flush=True)
        calls = [
            lambda p=p, e=e: p.run(fenced(x, e), tokens)
            for p, e in zip(self._plans, (True, False), strict=True)
        ]
        return _agree("LinearPlan.run", calls)


def _in_place(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``smooth_in_place``: the array it writes is fenced at its end, then copied
    back; the factors are fenced too."""

    def call(x: np.ndarray, arg: str, factors: np.ndarray, multiply: bool) -> None:
        CALLS["count"] += 1
        print(f"call smooth_in_place({_shapes((x, factors))})", file=sys.stderr, flush=True)
        for at_end in (True, False):
            work = fenced(x, at_end)
            fn(work, arg, fenced(factors, not at_end), multiply)
        x[...] = work

    return call


class _Accumulator:
    """``CalibAccumulator`` with each pushed batch fenced (end and start alternate)."""

    def __init__(self, *args: Any) -> None:
        self._inner = _REAL_ACC(*args)
        self._flip = False

    def push(self, batch: np.ndarray) -> None:
        CALLS["count"] += 1
        print(f"call CalibAccumulator.push({_shapes((batch,))})", file=sys.stderr, flush=True)
        self._flip = not self._flip
        self._inner.push(fenced(batch, self._flip) if batch.flags.c_contiguous else batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_REAL_ACC = native.CalibAccumulator
_READERS = [
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_affine",
    "dequantize_affine",
    "to_float32",
    "compute_scale",
    "quantize_dynamic",
    "dequantize_groups",
    "quantize_bitnet",
    "fake_quantize_bitnet",
    "compute_smooth_factors",
    "w8a8_product",
    "fp32_to_fp16_bits",
    "fp16_bits_to_fp32",
    "ptq_quantize",
    "ptq_range",
    "quantization_mae",
    "ptq_write_json",
]


def install() -> None:
    for name in _READERS:
        setattr(native, name, _pure(name, getattr(native, name)))
    native.smooth_in_place = _in_place(native.smooth_in_place)
    native.CalibAccumulator = _Accumulator
    native.LinearPlan = _Plan


LENGTHS = [*range(131), 191, 255, 256, 257, 1000, 1023, 4095, 4097, 16385]
BIG = [(1 << 18) + 13, (1 << 20) + 7]


def run(rng: np.random.Generator) -> None:
    dtypes = [np.float32, np.float16, np.float64]
    try:
        import ml_dtypes

        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    configs = [
        fq.QuantConfig.int8(),
        fq.QuantConfig.int8().asymmetric(),
        fq.QuantConfig.int4(),
        fq.QuantConfig.int4().asymmetric(),
        fq.QuantConfig.int8_per_channel(),
        fq.QuantConfig.int4_per_channel(),
        fq.QuantConfig.int4_per_channel().asymmetric(),
    ]

    def values(n: int, dtype: Any = np.float32) -> np.ndarray:
        return (rng.standard_normal(n) * 3).astype(dtype)

    # 1-D kernels over every length, in each float dtype.
    for n in LENGTHS + BIG:
        for dtype in dtypes if n <= 4097 else [np.float32]:
            x = values(n, dtype)
            for bs in (1, 7, 64):
                if n > 4097 and bs != 64:
                    continue
                q = fq.quantize_blockwise(x, block_size=bs)
                fq.dequantize_blockwise(q)
            for cfg in configs[:4]:
                fq.dequantize(fq.quantize(x, cfg))
            fq.fp16_bits_to_fp32(fq.fp32_to_fp16_bits(x))
            if n:
                fq.compute_scale(x, 127.0)
                fq.compute_scale(x, 127.0, fq.Percentile(0.99))
                for fn in (fq.dynamic_quantize_int8, fq.dynamic_quantize_int4):
                    d = fn(x)
                    d.dequantize()
                    fq.quantization_mae(x, d)
                w = fq.QuantizedWeights.from_f32("w", x)
                w.dequantize()
                fq.CalibStats.collect([x, x[: n // 2]])
                fq.CalibStats.collect(iter([x[: n // 3], x]))
    # 2-D and 3-D kernels: rows of every small width, and a few wide ones.
    shapes = [(r, c) for r in (1, 2, 3) for c in range(1, 71)]
    shapes += [(5, 4099), (33, 1001), (300, 1000), (64, 4096 + 3)]
    for shape in shapes:
        x = values(int(np.prod(shape))).reshape(shape)
        for cfg in configs[4:]:
            fq.dequantize(fq.quantize(x, cfg))
        d = fq.dynamic_quantize_int8_per_row(x)
        d.dequantize()
        fq.quantization_mae(x, d)
        for per_token in (True, False):
            cfg = fq.BitNetConfig(8, per_token)
            fq.dequantize_activations(fq.quantize_activations(x, cfg))
            fq.quantize_ste(x.reshape(1, *shape), fq.BitNetConfig(4, per_token))
        weights = values(3 * shape[1]).reshape(3, shape[1])
        s = fq.compute_smooth_factors(x, weights)
        fq.smooth_activations(x.copy(), s)
        fq.smooth_weights(weights.copy(), s)
    # Matrix kernels: odd widths, int8 and int4, one token and several.
    widths = [(1, 1), (3, 5), (7, 63), (5, 64), (9, 65), (17, 127), (4, 129), (16, 1000)]
    for out_f, in_f in [*widths, (33, 4097), (130, 2049)]:
        w = values(out_f * in_f).reshape(out_f, in_f)
        bias = values(out_f)
        for cfg in configs[4:] + configs[:2]:
            layer = fq.QuantizedLinear.from_linear(w, bias, cfg)
            for tokens in (1, 2, 9, 40):
                x = values(tokens * in_f).reshape(tokens, in_f)
                layer.forward(x)
                layer.forward(x[0])
                layer.forward(x.astype(np.float64))
        codes = rng.integers(-127, 128, (out_f, in_f), dtype=np.int8)
        scales = np.abs(values(out_f)) + 0.01
        fq.w8a8_matvec(codes, scales, values(in_f))
        for tokens in (1, 2, 9, 33):
            fq.w8a8_matmul(codes, scales, values(tokens * in_f).reshape(tokens, in_f))
    # PTQ: a model through JSON, and the calibrator.
    cal = fq.Calibrator()
    layers = []
    for i, n in enumerate([1, 5, 64, 65, 1000]):
        w = values(n)
        cal.record_layer(f"l{i}", w)
        layers.append((f"l{i}", w, [n], values(n) if i % 2 else None))
    cal.finish()
    model = fq.quantize_model_weights("{}", layers)
    with tempfile.TemporaryDirectory() as d:
        model.save(os.path.join(d, "m.json"))
        fq.QuantizedModel.load(os.path.join(d, "m.json"))


def main() -> None:
    warnings.simplefilter("ignore", fq.PrecisionWarning)
    install()
    for threads in (1, 2):
        fq.set_num_threads(threads)
        run(np.random.default_rng(threads))
    print(f"fenced {CALLS['count']} calls on {fq.simd_isa()}", flush=True)


if __name__ == "__main__":
    main()
