"""Side-by-side comparison of ferroquant's blockwise kernels with NumPy and peers.

Everything runs in one process, interleaved (one call of each implementation
per round, rounds repeated), and reports medians after warm-up, so machine
noise hits every implementation alike. Ratios, not absolute times, are the
result: PERF.md's copy floor is measured in the same run (np.copyto of the
input's bytes; a pass that reads 4n and writes ~n bytes has a floor of
(4n + n) / copy bandwidth = 1.25 x the copy time).

Peers are used when installed: onnxruntime (+ onnx) graph Abs/ReduceMax/
blocked QuantizeLinear and DequantizeLinear; gguf-py Q8_0; bitsandbytes.

    python benches/compare.py                # 16M elements, 1 and 2 threads
    python benches/compare.py --quick        # CI smoke: small input, few rounds
    python benches/compare.py --markdown     # table for benches/README.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

import ferroquant as fq

BLOCK = 64


# -- NumPy, faithful to seed 000 -----------------------------------------------------


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
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return None
    nb = n // BLOCK
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # ORT's workers spin-wait after each run by default; in an interleaved benchmark
    # on few cores they would steal the CPU from whatever runs next (ferroquant too).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")

    def session(graph, opset):
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10
        )
        cpu = ["CPUExecutionProvider"]
        return ort.InferenceSession(model.SerializeToString(), opts, providers=cpu)

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
    d_graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=BLOCK)],
        "d",
        [
            helper.make_tensor_value_info("q", TensorProto.INT8, [nb, BLOCK]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [nb, 1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [nb, BLOCK])],
    )
    qs, ds = session(q_graph, 21), session(d_graph, 21)
    return {
        "quantize": lambda x: qs.run(None, {"x": x.reshape(nb, BLOCK)}),
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


# -- timing ------------------------------------------------------------------------


def interleaved(
    fns: Dict[str, Callable[[], object]], rounds: int, warmup: int = 2
) -> Dict[str, float]:
    """Median seconds per implementation, calling each once per round in rotation."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    for r in range(warmup + rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if r >= warmup:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def run(n: int, rounds: int, threads_list: List[int]) -> List[Dict[str, object]]:
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
        for kernel, res, floor, moved in (
            ("quantize_blockwise", tq, floor_q, 5 * n),
            ("dequantize_blockwise", td, floor_d, 5 * n),
        ):
            ours = res["ferroquant"]
            rows.append(
                {
                    "kernel": kernel,
                    "impl": "floor (copy bandwidth)",
                    "threads": threads,
                    "ms": floor * 1e3,
                    "gbs": moved / floor / 1e9,
                    "floor": 1.0,
                    "speedup": None,
                }
            )
            for impl, t in sorted(res.items(), key=lambda kv: kv[1]):
                rows.append(
                    {
                        "kernel": kernel,
                        "impl": impl,
                        "threads": threads,
                        "ms": t * 1e3,
                        "gbs": moved / t / 1e9,
                        "floor": t / floor,
                        "speedup": None if impl == "ferroquant" else t / ours,
                    }
                )
    return rows


def render(rows: List[Dict[str, object]], markdown: bool) -> str:
    head = [
        "kernel",
        "implementation",
        "threads",
        "median ms",
        "GB/s",
        "x floor",
        "ferroquant speedup",
    ]
    body = []
    for r in rows:
        sp = r["speedup"]
        body.append(
            [
                str(r["kernel"]),
                str(r["impl"]),
                str(r["threads"]),
                f"{r['ms']:.2f}",
                f"{r['gbs']:.1f}",
                f"{r['floor']:.2f}",
                "-" if sp is None else f"{sp:.1f}x",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths))  # noqa: E731
    return "\n".join([fmt(head), *map(fmt, body)])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=16 * 1024 * 1024, help="elements (multiple of 64)")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quick", action="store_true", help="small smoke run (CI)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.n, a.rounds = 1 << 18, 3
    a.n -= a.n % BLOCK
    rows = run(a.n, a.rounds, a.threads)
    print(
        f"# ferroquant {fq.__version__} ({fq.simd_isa()}), n={a.n}, block={BLOCK}, "
        f"{a.rounds} interleaved rounds; {platform.processor() or platform.machine()}, "
        f"python {sys.version.split()[0]}, numpy {np.__version__}"
    )
    print(render(rows, a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
