"""Quantized matrix kernels (SPEC §3 W8A8, SPEC §2 QuantizedLinear.forward) against peers.

- ``w8a8_matvec`` on 4096 x 4096 with warm caches, and on 11008 x 4096 with the caches
  flushed before every call (a 64 MiB copy, untimed): ONNX Runtime
  ``DynamicQuantizeMatMul`` (com.microsoft; u8 activations x s8 weights, its weight
  pre-packed at session creation) and NumPy float32 ``W @ x``.
- ``w8a8_matmul`` with 32 tokens, 4096 x 4096: the same peers.
- ``QuantizedLinear.forward`` with int8 and int4 per-channel weights, 4096 x 4096: batch
  1 with flushed caches against NumPy's float32 GEMV, batch 64 against NumPy's float32
  GEMM on the pre-dequantized weight.

torch (``_int_mm``, dynamic quantized Linear) is used when installed. Floor: the weight's
bytes at copy bandwidth (what one pass over the quantized weight costs).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np
from compare import Row, rows_for

import ferroquant as fq

_FLUSH = np.ones((64 << 20) // 4, np.float32)
_FLUSH_DST = np.empty_like(_FLUSH)


def flush() -> None:
    """Evict the caches: copy 64 MiB (more than this machine's L3)."""
    np.copyto(_FLUSH_DST, _FLUSH)


def timed(fns: Dict[str, Callable[[], object]], rounds: int, cold: bool) -> Dict[str, float]:
    """Median seconds per implementation, interleaved. ``cold``: the caches are flushed
    (untimed) before every call; else each timed call follows an untimed one of the
    same implementation, so its data is as warm as it can be (the others in the
    round, NumPy's 64 MiB float32 weight above all, evict everything)."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for r in range(2 + rounds):
        for name, fn in fns.items():
            if cold:
                flush()
            else:
                fn()
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if r >= 2:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def ort_dqmm(w: np.ndarray, tokens: int, threads: int) -> Any:
    """An ONNX Runtime ``DynamicQuantizeMatMul`` session for int8 ``w`` (out x in), one
    float32 scale per output column, or None without onnxruntime."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    out_f, in_f = w.shape
    graph = helper.make_graph(
        [
            helper.make_node(
                "DynamicQuantizeMatMul", ["a", "b", "bs", "bz"], ["y"], domain="com.microsoft"
            )
        ],
        "dqmm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [tokens, in_f])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [tokens, out_f])],
        [
            helper.make_tensor(
                "b", TensorProto.INT8, [in_f, out_f], np.ascontiguousarray(w.T).tobytes(), raw=True
            ),
            helper.make_tensor(
                "bs",
                TensorProto.FLOAT,
                [out_f],
                np.full(out_f, 0.01, np.float32).tobytes(),
                raw=True,
            ),
            helper.make_tensor(
                "bz", TensorProto.INT8, [out_f], np.zeros(out_f, np.int8).tobytes(), raw=True
            ),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"a": x})


def _blas_limit(threads: int) -> Any:
    """NumPy's BLAS held to ``threads`` threads (threadpoolctl), or None without it."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(limits=threads, user_api="blas")


def _torch_peers(threads: int) -> Any:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


def run(rounds: int, threads_list: List[int], quick: bool = False) -> List[Row]:
    """The W8A8 products and the fused forward at 1 and 2 threads (small with ``quick``)."""
    sq, big, cols = (256, 512, 256) if quick else (4096, 11008, 4096)
    rng = np.random.default_rng(0)
    w_sq = rng.integers(-127, 128, (sq, cols)).astype(np.int8)
    w_big = rng.integers(-127, 128, (big, cols)).astype(np.int8)
    s_sq = np.full(sq, 0.01, np.float32)
    s_big = np.full(big, 0.01, np.float32)
    wf_sq = rng.standard_normal((sq, cols)).astype(np.float32)
    wf_big = rng.standard_normal((big, cols)).astype(np.float32)
    x1 = rng.standard_normal(cols).astype(np.float32)
    x32 = rng.standard_normal((32, cols)).astype(np.float32)
    x64 = rng.standard_normal((64, cols)).astype(np.float32)
    layers = {
        bits: fq.QuantizedLinear.from_linear(wf_sq, None, cfg)
        for bits, cfg in (
            (8, fq.QuantConfig.int8_per_channel()),
            (4, fq.QuantConfig.int4_per_channel()),
        )
    }
    deq = fq.dequantize(layers[8].weight_quantized).astype(np.float32)
    out: List[Row] = []
    for threads in threads_list:
        fq.set_num_threads(threads)
        torch = _torch_peers(threads)
        blas = _blas_limit(threads)
        ort_sq1, ort_big1, ort_sq32 = (
            ort_dqmm(w, t, threads) for w, t in ((w_sq, 1), (w_big, 1), (w_sq, 32))
        )
        cases = []
        for kernel, w, s, wf, x, ort, cold in (
            (f"w8a8_matvec {sq}x{cols} warm", w_sq, s_sq, wf_sq, x1, ort_sq1, False),
            (f"w8a8_matvec {big}x{cols} flushed", w_big, s_big, wf_big, x1, ort_big1, True),
            (f"w8a8_matmul 32 tokens {sq}x{cols}", w_sq, s_sq, wf_sq, x32, ort_sq32, False),
        ):
            vec = x.ndim == 1
            fns: Dict[str, Callable[[], object]] = {
                "ferroquant": (lambda w=w, s=s, x=x: fq.w8a8_matvec(w, s, x))
                if vec
                else (lambda w=w, s=s, x=x: fq.w8a8_matmul(w, s, x)),
                "numpy float32 W @ x": lambda wf=wf, x=x: wf @ x.T,
            }
            if ort is not None:
                xa = x.reshape(1, -1) if vec else x
                fns["onnxruntime DynamicQuantizeMatMul"] = lambda ort=ort, xa=xa: ort(xa)
            if torch is not None:
                wt = torch.from_numpy(w)
                xt = torch.from_numpy(
                    np.clip(np.round(np.atleast_2d(x) * 20), -127, 127).astype(np.int8)
                )
                if xt.shape[0] < 32:  # _int_mm wants at least 17 rows
                    xt = xt.repeat(32, 1)
                fns["torch _int_mm (s8 x s8)"] = lambda xt=xt, wt=wt, tc=torch: tc._int_mm(
                    xt, wt.t()
                )
            cases.append((kernel, fns, w.nbytes, cold))
        for bits, layer in layers.items():
            qbytes = layer.weight_quantized.size_bytes()
            fns1: Dict[str, Callable[[], object]] = {
                "ferroquant": lambda layer=layer: layer.forward(x1),
                "numpy float32 GEMV": lambda: wf_sq @ x1,
            }
            fns64: Dict[str, Callable[[], object]] = {
                "ferroquant": lambda layer=layer: layer.forward(x64),
                "numpy float32 GEMM (pre-dequantized)": lambda: x64 @ deq.T,
            }
            if torch is not None:
                lin = torch.nn.Linear(cols, sq)
                lin.weight.data = torch.from_numpy(wf_sq)
                dq = torch.ao.quantization.quantize_dynamic(
                    torch.nn.Sequential(lin), {torch.nn.Linear}, torch.qint8
                )
                t1, t64 = torch.from_numpy(x1.reshape(1, -1)), torch.from_numpy(x64)
                fns1["torch dynamic quantized Linear"] = lambda dq=dq, t=t1: dq(t)
                fns64["torch dynamic quantized Linear"] = lambda dq=dq, t=t64: dq(t)
            cases.append((f"forward int{bits} per-channel batch 1 flushed", fns1, qbytes, True))
            cases.append((f"forward int{bits} per-channel batch 64", fns64, qbytes, False))
        copy = {"copy": lambda: np.copyto(_FLUSH_DST, _FLUSH)}
        per_byte = timed(copy, rounds, False)["copy"] / _FLUSH.nbytes
        for kernel, fns, moved, cold in cases:
            res = timed(fns, rounds, cold)
            out += rows_for(kernel, res, per_byte * moved, moved, threads)
        if blas is not None:
            blas.unregister()
    return out
