"""Affine int8 / int4 (SPEC §2) against the peers a user could pick instead.

- per-tensor int8, scale computed, 16M float32: ONNX Runtime ``DynamicQuantizeLinear``
  (uint8 asymmetric; the per-element peer that also computes its scale),
  ``torch.quantize_per_tensor`` with the scale computed, NumPy faithful to seed 001.
- per-channel int8, 4096 x 4096: an ONNX Runtime graph (Abs, ReduceMax axis 1, Div,
  QuantizeLinear axis 0), the issue's peer; the same graph taking max(ReduceMax,
  -ReduceMin) instead of materializing Abs (one pass fewer over 64 MiB, a faster peer);
  ``torch.quantize_per_channel``, NumPy faithful.
- per-channel int4 with packing, 4096 x 4096: against ferroquant's own int8.
- dequantize per-tensor int8, 16M: ONNX Runtime ``DequantizeLinear``, NumPy.

Floors (docs/PERF.md): per tensor two reads of the input and one write (the scale
needs its own pass), per channel one read (a row is re-read from cache) and one write.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
from compare import Row, interleaved, max_abs_nodes, ort_session, rows_for, torch_module

import ferroquant as fq

COPY = "copy floor (np.copyto)"


def numpy_per_tensor(x: np.ndarray) -> np.ndarray:
    """Seed 001's symmetric per-tensor int8 in float64 (``f64::round``: ties away)."""
    d = x.astype(np.float64)
    amax = float(np.abs(d).max(initial=0.0))
    scale = 1.0 if amax < 1e-30 else amax / 127.0
    y = d * (0.0 if abs(scale) < 1e-30 else 1.0 / scale)
    r = np.trunc(y)
    r += np.where(np.abs(y - r) >= 0.5, np.copysign(1.0, y), 0.0)
    return np.clip(r, -127, 127).astype(np.int8)


def numpy_per_channel(w: np.ndarray) -> np.ndarray:
    d = w.astype(np.float64)
    amax = np.abs(d).max(axis=1, keepdims=True)
    scale = np.where(amax < 1e-30, 1.0, amax / 127.0)
    y = d * np.where(np.abs(scale) < 1e-30, 0.0, 1.0 / scale)
    r = np.trunc(y)
    r += np.where(np.abs(y - r) >= 0.5, np.copysign(1.0, y), 0.0)
    return np.clip(r, -127, 127).astype(np.int8)


def numpy_dequantize(q: fq.QuantizedTensor) -> np.ndarray:
    return ((q.data.astype(np.float64) - q.zero_points[0]) * q.scales[0]).astype(np.float32)


def ort_graphs(rows: int, cols: int, n: int, threads: int) -> Dict[str, Callable[..., Any]]:
    try:
        from onnx import TensorProto, helper
    except ImportError:
        return {}
    f, i8 = TensorProto.FLOAT, TensorProto.INT8
    dyn = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        "dyn",
        [helper.make_tensor_value_info("x", f, [n])],
        [
            helper.make_tensor_value_info("y", TensorProto.UINT8, [n]),
            helper.make_tensor_value_info("s", f, []),
            helper.make_tensor_value_info("z", TensorProto.UINT8, []),
        ],
    )
    per_channel = helper.make_graph(
        [
            helper.make_node("Abs", ["w"], ["a"]),
            helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=0),
            helper.make_node("Div", ["m", "c127"], ["s"]),
            helper.make_node("QuantizeLinear", ["w", "s", "zp"], ["q"], axis=0),
        ],
        "pc",
        [helper.make_tensor_value_info("w", f, [rows, cols])],
        [helper.make_tensor_value_info("q", i8, [rows, cols])],
        [
            helper.make_tensor("c127", f, [], [127.0]),
            helper.make_tensor("zp", i8, [rows], np.zeros(rows, np.int8).tolist()),
            helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
        ],
    )
    # The same codes without the 64 MiB Abs temporary: max|w| = max(max w, -min w).
    per_channel_mm = helper.make_graph(
        [
            *max_abs_nodes("w", keepdims=0),
            helper.make_node("Div", ["m", "c127"], ["s"]),
            helper.make_node("QuantizeLinear", ["w", "s", "zp"], ["q"], axis=0),
        ],
        "pc_mm",
        per_channel.input,
        per_channel.output,
        per_channel.initializer,
    )
    deq = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])],
        "deq",
        [
            helper.make_tensor_value_info("q", i8, [n]),
            helper.make_tensor_value_info("s", f, []),
            helper.make_tensor_value_info("z", i8, []),
        ],
        [helper.make_tensor_value_info("y", f, [n])],
    )
    graphs = (("dyn", dyn), ("pc", per_channel), ("pc_mm", per_channel_mm), ("deq", deq))
    sessions = {k: ort_session(g, threads) for k, g in graphs}
    if any(s is None for s in sessions.values()):
        return {}
    return {
        "dynamic": lambda x: sessions["dyn"].run(None, {"x": x}),
        "per_channel": lambda w: sessions["pc"].run(None, {"w": w}),
        "per_channel_mm": lambda w: sessions["pc_mm"].run(None, {"w": w}),
        "dequantize": lambda q, s, z: sessions["deq"].run(None, {"q": q, "s": s, "z": z}),
    }


def run(rounds: int, threads_list: List[int], quick: bool = False) -> List[Row]:
    """The four affine kernels at 1 and 2 threads (small inputs with ``quick``)."""
    rows_, cols = (256, 1024) if quick else (4096, 4096)
    n = rows_ * cols
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    w = x.reshape(rows_, cols)
    dst = np.empty_like(x)
    q8 = fq.quantize(x)
    s8, z8 = np.array(q8.scales[0], np.float32), np.array(0, np.int8)
    int8 = fq.QuantConfig.int8()
    asym = fq.QuantConfig.int8().asymmetric()
    pc8 = fq.QuantConfig.int8_per_channel()
    pc4 = fq.QuantConfig.int4_per_channel()
    out: List[Row] = []
    for threads in threads_list:
        fq.set_num_threads(threads)
        ort = ort_graphs(rows_, cols, n, threads)
        torch = torch_module(threads)
        copy = {COPY: lambda: np.copyto(dst, x)}

        per_tensor: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.quantize(x, int8),
            "ferroquant int8-asym": lambda: fq.quantize(x, asym),
            "numpy (faithful)": lambda: numpy_per_tensor(x),
        }
        per_channel: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.quantize(w, pc8),
            "numpy (faithful)": lambda: numpy_per_channel(w),
        }
        packed: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.quantize(w, pc4),
            "ferroquant int8-per-channel": lambda: fq.quantize(w, pc8),
        }
        deq: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.dequantize(q8),
            "numpy (faithful)": lambda: numpy_dequantize(q8),
        }
        if ort:
            per_tensor["onnxruntime DynamicQuantizeLinear"] = lambda o=ort: o["dynamic"](x)
            per_channel["onnxruntime graph (QuantizeLinear axis 0)"] = lambda o=ort: o[
                "per_channel"
            ](w)
            per_channel["onnxruntime graph, max/min instead of Abs"] = lambda o=ort: o[
                "per_channel_mm"
            ](w)
            deq["onnxruntime DequantizeLinear"] = lambda o=ort: o["dequantize"](q8.data, s8, z8)
        if torch is not None:
            tx, tw = torch.from_numpy(x), torch.from_numpy(w)

            def torch_per_tensor(t: Any = torch, tx: Any = tx) -> object:
                scale = float(tx.abs().max()) / 127.0
                return t.quantize_per_tensor(tx, scale, 0, t.qint8)

            def torch_per_channel(t: Any = torch, tw: Any = tw) -> object:
                scales = tw.abs().amax(dim=1).div(127.0).double()
                zps = t.zeros(rows_, dtype=t.int64)
                return t.quantize_per_channel(tw, scales, zps, 0, t.qint8)

            per_tensor["torch.quantize_per_tensor"] = torch_per_tensor
            per_channel["torch.quantize_per_channel"] = torch_per_channel

        for kernel, fns, moved in (
            ("quantize int8 per-tensor", per_tensor, 4 * n + 4 * n + n),
            ("quantize int8 per-channel", per_channel, 4 * n + n),
            ("quantize int4 per-channel", packed, 4 * n + n // 2),
            ("dequantize int8 per-tensor", deq, n + 4 * n),
        ):
            res = interleaved(fns, rounds)
            per_byte = res.pop(COPY) / (4 * n)
            out += rows_for(kernel, res, per_byte * moved, moved, threads)
    return out
