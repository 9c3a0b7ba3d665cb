"""Activation quantization (SPEC §3, §4) against the peers a user could pick instead.

The activations are 2048 x 4096 float32 normals (sigma 3) with 8 outlier channels 20x
larger, as real activations have.

- dynamic int8 per tensor, 2048 x 4096 float32: ONNX Runtime ``DynamicQuantizeLinear``.
- dynamic int8 per row and BitNet per token, 2048 x 4096: an ONNX Runtime graph (Abs,
  ReduceMax axis 1, Div, blocked QuantizeLinear with one block a row), the issue's peer;
  the same graph taking max(ReduceMax, -ReduceMin) instead of materializing Abs (the
  same codes, one pass fewer over 32 MiB, so a faster peer); and
  ``DynamicQuantizeLinear`` per element (it computes one scale, we compute 2048).
- p99 percentile scale of 2048 x 4096: NumPy ``abs`` + ``np.partition``.
- CalibStats over 16M values in 16 batches: NumPy (min, max, mean, std, partition).
- SmoothQuant factors, activations 2048 x 4096 and weights 4096 x 4096: NumPy column max
  and ``power``.
- one 4096-element token (per-token int8): NumPy faithful.

Floor: per row one read and one write (4n + n); per tensor two reads and a write.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
from compare import Row, interleaved, max_abs_nodes, ort_session, rows_for

import ferroquant as fq

COPY = "copy floor (np.copyto)"


def numpy_per_row(x: np.ndarray) -> np.ndarray:
    """Seed 002/003's per-row int8 in float32 (ties away from zero)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    y = x / scale
    r = np.trunc(y)
    r += np.where(np.abs(y - r) >= 0.5, np.copysign(np.float32(1), y), np.float32(0))
    return np.clip(r, -127, 127).astype(np.int8)


def numpy_p99(x: np.ndarray) -> float:
    a = np.abs(x).reshape(-1)
    k = int(np.ceil(0.99 * a.size)) - 1
    return float(np.partition(a, k)[k]) / 127.0


def numpy_calib(batches: List[np.ndarray]) -> tuple:
    allv = np.concatenate([b.reshape(-1) for b in batches])
    a = np.abs(allv)
    k = int(np.ceil(0.99 * a.size)) - 1
    p99 = np.partition(a, k)[k]
    return allv.min(), allv.max(), allv.mean(dtype=np.float64), allv.std(dtype=np.float64), p99


def numpy_smooth(a: np.ndarray, w: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    eps = np.float32(1e-5)
    am = np.abs(a).max(axis=0) + eps
    wm = np.abs(w).max(axis=0) + eps
    return np.maximum(am ** np.float32(alpha) / wm ** np.float32(1 - alpha), eps)


def ort_graphs(rows: int, cols: int, threads: int) -> Dict[str, Callable[..., Any]]:
    try:
        from onnx import TensorProto, helper
    except ImportError:
        return {}
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    dyn = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        "dyn",
        [helper.make_tensor_value_info("x", f, [rows, cols])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [rows, cols]),
            helper.make_tensor_value_info("s", f, []),
            helper.make_tensor_value_info("z", TensorProto.UINT8, []),
        ],
    )
    per_row = helper.make_graph(
        [
            helper.make_node("Abs", ["x"], ["a"]),
            helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=1),
            helper.make_node("Div", ["m", "c127"], ["s"]),
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=cols),
        ],
        "per_row",
        [helper.make_tensor_value_info("x", f, [rows, cols])],
        [helper.make_tensor_value_info("q", i8, [rows, cols])],
        [
            helper.make_tensor("c127", f, [], [127.0]),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
            helper.make_tensor("zp", i8, [rows, 1], np.zeros(rows, np.int8).tolist()),
        ],
    )
    # The same codes without the 32 MiB Abs temporary: max|x| = max(max x, -min x).
    per_row_mm = helper.make_graph(
        [
            *max_abs_nodes("x", keepdims=1),
            helper.make_node("Div", ["m", "c127"], ["s"]),
            helper.make_node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1, block_size=cols),
        ],
        "per_row_mm",
        per_row.input,
        per_row.output,
        per_row.initializer,
    )
    graphs = (("dyn", dyn), ("row", per_row), ("row_mm", per_row_mm))
    sessions = {k: ort_session(g, threads) for k, g in graphs}
    if any(s is None for s in sessions.values()):
        return {}
    return {
        "dynamic": lambda x: sessions["dyn"].run(None, {"x": x}),
        "per_row": lambda x: sessions["row"].run(None, {"x": x}),
        "per_row_mm": lambda x: sessions["row_mm"].run(None, {"x": x}),
    }


def run(rounds: int, threads_list: List[int], quick: bool = False) -> List[Row]:
    """The activation kernels at 1 and 2 threads (small inputs with ``quick``)."""
    rows_, cols = (64, 1024) if quick else (2048, 4096)
    n = rows_ * cols
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows_, cols)) * 3).astype(np.float32)
    # A few outlier channels, as real activations have (LLM.int8() reports a handful of
    # feature dimensions ~20x the rest): they set most rows' scales.
    x[:, rng.choice(cols, 8, replace=False)] *= 20
    w = (rng.standard_normal((cols, cols)) * 0.05).astype(np.float32)
    batches = [b.copy() for b in np.array_split(rng.standard_normal(4 * n).astype(np.float32), 16)]
    token = x[:1].copy()
    dst = np.empty_like(x)
    bitnet = fq.BitNetConfig()
    p99 = fq.Percentile(0.99)
    out: List[Row] = []
    for threads in threads_list:
        fq.set_num_threads(threads)
        ort = ort_graphs(rows_, cols, threads)
        copy = {COPY: lambda: np.copyto(dst, x)}
        per_row: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.dynamic_quantize_int8_per_row(x),
            "ferroquant bitnet per-token": lambda: fq.quantize_activations(x, bitnet),
            "numpy (faithful)": lambda: numpy_per_row(x),
        }
        per_tensor: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.dynamic_quantize_int8(x),
        }
        if ort:
            per_row["onnxruntime graph (blocked QuantizeLinear)"] = lambda o=ort: o["per_row"](x)
            per_row["onnxruntime graph, max/min instead of Abs"] = lambda o=ort: o["per_row_mm"](x)
            per_row["onnxruntime DynamicQuantizeLinear"] = lambda o=ort: o["dynamic"](x)
            per_tensor["onnxruntime DynamicQuantizeLinear"] = lambda o=ort: o["dynamic"](x)
        percentile: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.compute_scale(x, 127.0, p99),
            "numpy abs + partition": lambda: numpy_p99(x),
        }
        calib: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.CalibStats.collect(batches),
            "numpy": lambda: numpy_calib(batches),
        }
        smooth: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.compute_smooth_factors(x, w),
            "numpy": lambda: numpy_smooth(x, w),
        }
        small: Dict[str, Callable[[], object]] = {
            "ferroquant": lambda: fq.quantize_activations(token, bitnet),
            "ferroquant per-row": lambda: fq.dynamic_quantize_int8_per_row(token),
            "numpy (faithful)": lambda: numpy_per_row(token),
        }
        for kernel, fns, moved in (
            ("dynamic int8 per-row", per_row, 4 * n + n),
            ("dynamic int8 per-tensor", per_tensor, 4 * n + 4 * n + n),
            ("p99 percentile scale", percentile, 4 * n),
            ("CalibStats (4 x n values)", calib, 16 * n),
            ("SmoothQuant factors", smooth, 4 * n + 4 * cols * cols),
        ):
            res = interleaved(fns, rounds)
            per_byte = res.pop(COPY) / (4 * n)
            out += rows_for(kernel, res, per_byte * moved, moved, threads)
        res = interleaved(small, max(rounds, 9) * 50)
        out += rows_for("one 4096-element token", res, res["ferroquant"], 5 * cols, threads)[1:]
    return out
