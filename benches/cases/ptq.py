"""Post-training int8 and float16 bits (SPEC §5) against the peers a user could pick.

- f32 -> f16 bits and back, 16M values: ONNX Runtime ``Cast`` and NumPy ``astype``
  (``view(uint16)`` is free).
- ``QuantizedWeights.from_f32`` of a 4096 x 4096 float32 weight (max-abs scale, codes):
  NumPy faithful to the seed (float32 division, ties away from zero) and ONNX Runtime
  ``DynamicQuantizeLinear`` (uint8 asymmetric, one scale: the same bytes moved).
- The seed's JSON of a 1024 x 1024 layer: Python's ``json.dumps(indent=2)`` of the same
  dict (which prints floats as float64, so not the seed's bytes: a speed reference only).
- ``ferroquant compare --demo``: its wall time (no peer).

Floor: f16 conversion reads 4n and writes 2n bytes (or 2n and 4n); from_f32 reads 4n
twice (scale, then codes) and writes n.
"""

from __future__ import annotations

import json
from typing import Callable, Dict, List

import numpy as np
from compare import Row, interleaved, ort_session, rows_for

import ferroquant as fq

COPY = "copy floor (np.copyto)"


def numpy_from_f32(w: np.ndarray) -> np.ndarray:
    """Seed 004's ``from_f32`` codes in float32 (ties away from zero)."""
    s = max(np.float32(np.abs(w).max()) / np.float32(127), np.float32(1e-8))
    y = w / s
    r = np.trunc(y)
    r += np.where(np.abs(y - r) >= 0.5, np.copysign(np.float32(1), y), np.float32(0))
    return np.clip(r, -127, 127).astype(np.int8)


def ort_casts(n: int, threads: int) -> Dict[str, Callable[[np.ndarray], object]]:
    try:
        from onnx import TensorProto, helper
    except ImportError:
        return {}
    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    graphs = {
        "to16": helper.make_graph(
            [helper.make_node("Cast", ["x"], ["y"], to=f16)],
            "to16",
            [helper.make_tensor_value_info("x", f32, [n])],
            [helper.make_tensor_value_info("y", f16, [n])],
        ),
        "to32": helper.make_graph(
            [helper.make_node("Cast", ["x"], ["y"], to=f32)],
            "to32",
            [helper.make_tensor_value_info("x", f16, [n])],
            [helper.make_tensor_value_info("y", f32, [n])],
        ),
        "dyn": helper.make_graph(
            [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
            "dyn",
            [helper.make_tensor_value_info("x", f32, [n])],
            [
                helper.make_tensor_value_info("y", TensorProto.UINT8, [n]),
                helper.make_tensor_value_info("s", f32, []),
                helper.make_tensor_value_info("z", TensorProto.UINT8, []),
            ],
        ),
    }
    sessions = {k: ort_session(g, threads) for k, g in graphs.items()}
    if any(s is None for s in sessions.values()):
        return {}
    return {k: (lambda a, s=s: s.run(None, {"x": a})) for k, s in sessions.items()}


def run(rounds: int, threads_list: List[int], quick: bool = False) -> List[Row]:
    """The §5 kernels at 1 and 2 threads (small inputs with ``quick``)."""
    n = 1 << 16 if quick else 1 << 24
    side = int(np.sqrt(n))
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    h = x.astype(np.float16)
    bits = h.view(np.uint16)
    w = x.reshape(side, side)
    dst = np.empty_like(x)
    js = 256 if quick else 1024
    layer = fq.QuantizedWeights.from_f32("enc.0", w[:js, :js].copy(), bias=np.ones(js, np.float32))
    model = fq.QuantizedModel("{}", (layer,), "symmetric_per_tensor_int8", js * js, 4 * js * js)
    as_dict = json.loads(model.to_json())
    out: List[Row] = []
    for threads in threads_list:
        fq.set_num_threads(threads)
        ort = ort_casts(n, threads)
        copy = {COPY: lambda: np.copyto(dst, x)}
        to16: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.fp32_to_fp16_bits(x),
            "numpy astype(float16)": lambda: x.astype(np.float16),
        }
        to32: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.fp16_bits_to_fp32(bits),
            "numpy astype(float32)": lambda: h.astype(np.float32),
        }
        ptq: Dict[str, Callable[[], object]] = {
            **copy,
            "ferroquant": lambda: fq.QuantizedWeights.from_f32("w", w),
            "numpy (faithful)": lambda: numpy_from_f32(w),
        }
        if ort:
            to16["onnxruntime Cast"] = lambda o=ort: o["to16"](x)
            to32["onnxruntime Cast"] = lambda o=ort: o["to32"](h)
            ptq["onnxruntime DynamicQuantizeLinear"] = lambda o=ort: o["dyn"](x)
        for kernel, fns, moved in (
            ("f32 -> f16 bits", to16, 6 * n),
            ("f16 bits -> f32", to32, 6 * n),
            ("ptq-int8 from_f32", ptq, 9 * n),
        ):
            res = interleaved(fns, rounds)
            per_byte = res.pop(COPY) / (4 * n)
            out += rows_for(kernel, res, per_byte * moved, moved, threads)
    saves: Dict[str, Callable[[], object]] = {
        "ferroquant": lambda: model.to_json(),
        "python json.dumps(indent=2)": lambda: json.dumps(as_dict, indent=2),
    }
    res = interleaved(saves, max(3, rounds // 3))
    text = len(model.to_json())
    out += rows_for(f"PTQ JSON text ({js}x{js} layer)", res, res["ferroquant"], text, 1)[1:]
    if not quick:
        out += compare_demo()
    return out


def compare_demo() -> List[Row]:
    """Wall time of ``ferroquant compare --demo`` (every weight scheme over MiniLM), in
    this process, once: the command a user runs first (skipped without the weights)."""
    import contextlib
    import io
    import os
    import tempfile
    import time

    from ferroquant import cli

    try:
        cli.demo_model_path()
    except cli.CliError:
        return []
    fq.set_num_threads(2)
    with tempfile.TemporaryDirectory() as d:
        args = ["compare", "--demo", "--no-progress", "--json", os.path.join(d, "c.json")]
        with contextlib.redirect_stdout(io.StringIO()):
            t = time.perf_counter()
            status = cli.main(args)
            t = time.perf_counter() - t
    if status != 0:
        return []
    nbytes = os.path.getsize(cli.demo_model_path())
    return rows_for("compare --demo (wall, 2 threads)", {"ferroquant": t}, t, nbytes, 2)[1:]
