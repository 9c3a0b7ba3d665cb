"""Blockwise 8-bit (SPEC §1) against NumPy (faithful to seed 000), the ONNX Runtime
graph Abs/ReduceMax/blocked QuantizeLinear, DequantizeLinear, gguf-py Q8_0 and
bitsandbytes."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
from compare import Row, interleaved, max_abs_nodes, ort_session, rows_for

import ferroquant as fq

BLOCK = 64


# -- NumPy, faithful to seed 000


def numpy_quantize(x: np.ndarray, block: int = BLOCK) -> Tuple[np.ndarray, np.ndarray]:
    flat = x.reshape(-1)
    n = flat.size
    nb = -(-n // block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = flat
    blocks = padded.reshape(nb, block)
    max_abs = np.abs(blocks).max(axis=1)
    scale = np.where(max_abs > 0, max_abs / np.float32(127), np.float32(1)).astype(np.float32)
    y = blocks / scale[:, None]
    t = np.trunc(y)
    r = t + np.where(np.abs(y - t) >= 0.5, np.copysign(np.float32(1), y), np.float32(0))
    codes = np.clip(r, -127, 127).astype(np.int8).reshape(-1)[:n]
    return codes, scale.astype(np.float16)


def numpy_dequantize(codes: np.ndarray, scales: np.ndarray, block: int = BLOCK) -> np.ndarray:
    n = codes.size
    nb = scales.size
    padded = np.zeros(nb * block, np.int8)
    padded[:n] = codes
    out = padded.reshape(nb, block).astype(np.float32) * scales.astype(np.float32)[:, None]
    return out.reshape(-1)[:n]


# -- peers -------------------------------------------------------------------------


def onnx_sessions(n: int, threads: int) -> Optional[Dict[str, Callable[..., object]]]:
    try:
        from onnx import TensorProto, helper
    except ImportError:
        return None
    nb = n // BLOCK
    # Quantize: X[nb, 64] -> scale = ReduceMax(|X|) / 127 -> blocked QuantizeLinear (opset 21).
    inits = [
        helper.make_tensor("c127", TensorProto.FLOAT, [], [127.0]),
        helper.make_tensor("zp", TensorProto.INT8, [nb, 1], np.zeros(nb, np.int8).tolist()),
        helper.make_tensor("axes", TensorProto.INT64, [1], [1]),
    ]
    q_graph = helper.make_graph(
        [
            helper.make_node("Abs", ["x"], ["a"]),
            helper.make_node("ReduceMax", ["a", "axes"], ["m"], keepdims=1),
            helper.make_node("Div", ["m", "c127"], ["scale"]),
            helper.make_node(
                "QuantizeLinear", ["x", "scale", "zp"], ["q"], axis=1, block_size=BLOCK
            ),
        ],
        "q",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [nb, BLOCK])],
        [
            helper.make_tensor_value_info("q", TensorProto.INT8, [nb, BLOCK]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [nb, 1]),
        ],
        inits,
    )
    # The same codes without the 64 MiB Abs temporary: max|x| = max(max x, -min x).
    q_mm_graph = helper.make_graph(
        [
            *max_abs_nodes("x", keepdims=1),
            helper.make_node("Div", ["m", "c127"], ["scale"]),
            helper.make_node(
                "QuantizeLinear", ["x", "scale", "zp"], ["q"], axis=1, block_size=BLOCK
            ),
        ],
        "q_mm",
        q_graph.input,
        q_graph.output,
        q_graph.initializer,
    )
    d_graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=BLOCK)],
        "d",
        [
            helper.make_tensor_value_info("q", TensorProto.INT8, [nb, BLOCK]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [nb, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [nb, BLOCK])],
    )
    qs, ds = ort_session(q_graph, threads), ort_session(d_graph, threads)
    qm = ort_session(q_mm_graph, threads)
    if qs is None or ds is None or qm is None:
        return None
    return {
        "quantize": lambda x: qs.run(None, {"x": x.reshape(nb, BLOCK)}),
        "quantize_mm": lambda x: qm.run(None, {"x": x.reshape(nb, BLOCK)}),
        "dequantize": lambda q, s: ds.run(None, {"q": q.reshape(nb, BLOCK), "s": s.reshape(nb, 1)}),
    }


def gguf_q8_0() -> Optional[Callable[[np.ndarray], object]]:
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:
        return None
    return lambda x: quants.quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0)


def bitsandbytes_blockwise() -> Optional[Callable[[np.ndarray], object]]:
    try:
        import bitsandbytes.functional as bnbf
        import torch
    except ImportError:
        return None
    return lambda x: bnbf.quantize_blockwise(torch.from_numpy(x), blocksize=BLOCK)


def run(rounds: int, threads_list: List[int], quick: bool = False) -> List[Row]:
    """Blockwise 8-bit, block 64, on 16M float32 (256K with ``quick``)."""
    n = (1 << 18) if quick else 16 * 1024 * 1024
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    dst = np.empty_like(x)
    q = fq.quantize_blockwise(x, BLOCK)
    deq_scales = q.scales.astype(np.float32)
    rows: List[Dict[str, object]] = []
    gguf = gguf_q8_0()
    bnb = bitsandbytes_blockwise()
    for threads in threads_list:
        fq.set_num_threads(threads)
        ort = onnx_sessions(n, threads)
        quant: Dict[str, Callable[[], object]] = {
            "copy floor (np.copyto)": lambda: np.copyto(dst, x),
            "ferroquant": lambda: fq.quantize_blockwise(x, BLOCK),
            "numpy (faithful)": lambda: numpy_quantize(x),
        }
        if ort:
            quant["onnxruntime graph"] = lambda ort=ort: ort["quantize"](x)
            quant["onnxruntime graph, max/min instead of Abs"] = lambda ort=ort: ort["quantize_mm"](
                x
            )
        if gguf:
            quant["gguf-py Q8_0 (block 32)"] = lambda: gguf(x)
        if bnb:
            quant["bitsandbytes"] = lambda: bnb(x)
        deq: Dict[str, Callable[[], object]] = {
            "ferroquant": lambda: fq.dequantize_blockwise(q),
            "numpy (faithful)": lambda: numpy_dequantize(q.data, q.scales),
        }
        if ort:
            deq["onnxruntime DequantizeLinear"] = lambda ort=ort: ort["dequantize"](
                q.data, deq_scales
            )
        tq = interleaved(quant, rounds)
        td = interleaved(deq, rounds)
        copy = tq.pop("copy floor (np.copyto)")
        floor_q = copy * (4 * n + n + 2 * (n // BLOCK)) / (4 * n)
        floor_d = copy * (n + 4 * n) / (4 * n)
        rows += rows_for("quantize_blockwise", tq, floor_q, 5 * n, threads)
        rows += rows_for("dequantize_blockwise", td, floor_d, 5 * n, threads)
    return rows
