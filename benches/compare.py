"""Side-by-side comparison of ferroquant's kernels with NumPy and peers: the harness.

Everything runs in one process, interleaved (one call of each implementation
per round, rounds repeated), and reports medians after warm-up, so machine
noise hits every implementation alike. Ratios, not absolute times, are the
result: the copy floor (docs/PERF.md) is measured in the same run — the time
``np.copyto`` needs per byte of the input, times the bytes a kernel must move
(a pass that reads 4n and writes n bytes has a floor of 1.25 x the copy time).

Each family's cases live in ``benches/cases/<family>.py``. Peers are used when
installed (``pip install '.[bench]'``): onnxruntime + onnx, gguf-py,
bitsandbytes and torch. ONNX Runtime's spin-waiting is turned off,
``OMP_WAIT_POLICY=PASSIVE`` is set and OpenBLAS's thread timeout is at its
minimum, or their idle workers would steal the cores of whatever is timed next.

    python benches/compare.py                    # every family, 1 and 2 threads
    python benches/compare.py --family affine    # one family
    python benches/compare.py --quick            # CI smoke: small inputs, few rounds
    python benches/compare.py --markdown         # tables for benches/README.md
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch or ORT load OpenMP
# NumPy's OpenBLAS workers spin (sched_yield) for 2^28 cycles after each call by
# default, whatever OMP_WAIT_POLICY says: at 2 threads they took a core from the
# implementation timed after NumPy's GEMM (ferroquant's forward at batch 64: 36 ms
# with them spinning, 19 ms without). 2^4 cycles is OpenBLAS's minimum; set before
# NumPy loads it.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import argparse
import importlib
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np

import ferroquant as fq

FAMILIES = ("blockwise", "affine", "activation", "matmul", "ptq")
Row = Dict[str, object]


def interleaved(
    fns: Dict[str, Callable[[], object]], rounds: int, warmup: int = 2
) -> Dict[str, float]:
    """Median seconds per implementation, calling each once per round, each round in
    its own order (a fixed seed, so runs repeat): no implementation keeps the same
    predecessor. In a fixed order the implementation after the copy floor always paid
    for writing back the copy's 32 MiB of dirty lines: 2.19 ms for per-row int8
    against 1.64 ms for BitNet per-token, the same kernel, in one run; a rotated
    order still kept each one's predecessor in all but one round in n."""
    times: Dict[str, List[float]] = {k: [] for k in fns}
    order = list(fns.items())
    shuffle = random.Random(0x5EED).shuffle
    for r in range(warmup + rounds):
        shuffle(order)
        for name, fn in order:
            t = time.perf_counter()
            fn()
            dt = time.perf_counter() - t
            if r >= warmup:
                times[name].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_time(nbytes: int, rounds: int) -> float:
    """Median seconds ``np.copyto`` takes for ``nbytes`` (the floor's unit)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return interleaved({"copy": lambda: np.copyto(dst, src)}, rounds)["copy"] / nbytes


def rows_for(
    kernel: str, res: Dict[str, float], floor: float, moved: int, threads: int
) -> List[Row]:
    """Table rows: the floor, then every implementation (fastest first)."""
    ours = res["ferroquant"]
    rows: List[Row] = [
        {
            "kernel": kernel,
            "impl": "floor (copy bandwidth)",
            "threads": threads,
            "ms": floor * 1e3,
            "gbs": moved / floor / 1e9,
            "floor": 1.0,
            "speedup": None,
        }
    ]
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


def max_abs_nodes(x: str, keepdims: int) -> List[Any]:
    """ONNX nodes for ``m = max|x|`` along the axis in the initializer ``axes`` without an
    ``Abs`` temporary: ``max(ReduceMax(x), -ReduceMin(x))`` (the same value, one pass
    fewer over ``x`` than ``Abs`` then ``ReduceMax``)."""
    from onnx import helper

    return [
        helper.make_node("ReduceMax", [x, "axes"], ["hi"], keepdims=keepdims),
        helper.make_node("ReduceMin", [x, "axes"], ["lo"], keepdims=keepdims),
        helper.make_node("Neg", ["lo"], ["neg"]),
        helper.make_node("Max", ["hi", "neg"], ["m"]),
    ]


def ort_session(graph: Any, threads: int, opset: int = 21) -> Optional[Any]:
    """An ONNX Runtime session for ``graph`` on ``threads`` threads, spinning off."""
    try:
        import onnxruntime as ort
        from onnx import helper
    except ImportError:
        return None
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # ORT's workers spin-wait after each run by default; in an interleaved benchmark
    # on few cores they would steal the CPU from whatever runs next (ferroquant too).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def torch_module(threads: int) -> Optional[Any]:
    """torch with ``threads`` intra-op threads, if installed."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


def render(rows: List[Row], markdown: bool) -> str:
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
    fmt = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(head), *map(fmt, body)])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--quick", action="store_true", help="small smoke run (CI)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.rounds = 3
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    print(
        f"# ferroquant {fq.__version__} ({fq.simd_isa()}) on {cpu_name()}, {os.cpu_count()} CPUs; "
        f"{a.rounds} interleaved rounds; python {sys.version.split()[0]}, numpy {np.__version__}"
    )
    for family in FAMILIES if a.family == "all" else (a.family,):
        case = importlib.import_module(f"cases.{family}")
        rows = case.run(a.rounds, a.threads, a.quick)
        print(f"\n## {family}\n")
        print(render(rows, a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
