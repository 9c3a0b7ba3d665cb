"""Saving and loading quantized tensors as safetensors files (SPEC §6).

Layout: each quantized value named ``name`` is stored as its arrays, named
``name::<role>`` (``name::data``, ``name::scales``, ...), plus one metadata
entry ``ferroquant:<name>`` whose value is JSON (see :mod:`ferroquant._format`).
Plain NumPy arrays are stored under their own name with no entry, so any
safetensors reader can open the file and any safetensors file without
ferroquant entries loads as plain arrays. Everything ferroquant adds on top of
safetensors is validated on load and refused with
:class:`~ferroquant.errors.FormatError`.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _ferroquant as _native
from . import _format
from ._format import FORMAT_VERSION, PathLike
from .errors import FormatError

__all__ = ["FORMAT_VERSION", "load", "load_bytes", "save", "save_bytes"]

Entry = Union[Any, np.ndarray]


def save(
    path: PathLike, tensors: Mapping[str, Entry], metadata: Optional[Mapping[str, str]] = None
) -> None:
    """Write arrays and quantized values to a safetensors file.

    The file is written beside ``path`` and renamed into place, so a failed
    write leaves an existing file untouched. A new file gets mode ``0o666``
    less the umask; a replaced file keeps its mode.

    Args:
        path: destination file (replaced if it exists).
        tensors: name -> numpy array or quantized value (e.g. BlockwiseQuantized).
        metadata: extra str -> str header entries (keys may not start with ``ferroquant:``).

    Raises:
        TypeError: an entry is neither an array nor a quantized value.
        ValueError: two entries would store an array under the same name.
        OSError: the file cannot be written (missing directory, a directory in its
            place, no permission, disk full); the message names ``path``.
    """
    flat, meta = _format.flatten(tensors, metadata)
    _format.write_tensors(path, _format.specs(flat), meta)


def save_bytes(tensors: Mapping[str, Entry], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """Like :func:`save`, into bytes."""
    return _format.dump_bytes(tensors, metadata)


def load(path: PathLike) -> Dict[str, Entry]:
    """Read a safetensors file written by :func:`save` (or any safetensors file).

    Every dtype NumPy or ml_dtypes can hold loads (bool, ints, float16/32/64,
    bfloat16, the float8 formats, complex64); arrays are read-only copies.

    Returns:
        name -> quantized value (for ferroquant entries) or numpy array, in name order.

    Raises:
        FileNotFoundError / PermissionError / IsADirectoryError: as ``open`` would.
        FormatError: the file is truncated, corrupt, or its entries are inconsistent.
    """
    reader = _format.FileReader(path)
    try:
        return dict(reader.entries())
    finally:
        reader.close()


def load_bytes(data: bytes) -> Dict[str, Entry]:
    """Like :func:`load`, from bytes made by :func:`save_bytes` (or any safetensors bytes)."""
    return _format.parse_bytes(data)


class TensorReader(_format.FileReader):
    """A safetensors file opened for lazy, one-tensor-at-a-time reads (used by the CLI,
    which copies a tensor NumPy cannot hold as its bytes: see ``FileReader.opaque``)."""

    opaque = True


class StreamingWriter:
    """Write a safetensors file one tensor at a time, holding one tensor in memory.

    safetensors has no streaming writer (its header, which lists every
    tensor's offsets, comes first), so each tensor's bytes are spilled to an
    unnamed temporary file beside the destination as they are added;
    :meth:`close` has the safetensors crate write the real file, reading each
    tensor back from the spill only when it is written. Peak memory is the
    largest tensor, not the model (a memory map of the spill would count every
    page of it as resident while the file is written). The destination is
    checked when the writer is created, so a bad output path fails before any
    work is done.
    With ``replace=False`` an existing file is never replaced, even one
    that appears while the writer runs (``FileExistsError``). ``on_done`` is
    called as soon as the file is in place.
    """

    def __init__(
        self,
        path: PathLike,
        metadata: Optional[Mapping[str, str]] = None,
        replace: bool = True,
        on_done: Optional[Callable[[], None]] = None,
    ) -> None:
        self._path = path
        self._replace = replace
        self._on_done = on_done
        _, real = _format.prepare_destination(path)
        self._meta = _format.user_metadata(metadata)
        try:
            self._spill = _native.SpillFile(os.path.dirname(real) or ".")
        except OSError as e:  # the spill sits beside the output: name the output
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
        self._index: Dict[str, Tuple[str, List[int], int, int]] = {}
        self._names: set[str] = set()
        # One call at a time: a second thread waits (the spill is not shared).
        self._lock = threading.Lock()

    def add(self, name: str, value: Entry) -> None:
        """Append one array or quantized value (``ValueError`` for a name used before,
        as a plain array or a quantized value)."""
        with self._lock:
            if self._spill.closed:
                raise ValueError(f"the writer of {os.fspath(self._path)!r} is closed")
            if isinstance(value, _format.OpaqueTensor):
                if value.data is None:
                    raise ValueError(f"tensor {name!r}: only its header was read")
                flat: Dict[str, Any] = {name: value.data}
                meta: Dict[str, str] = {}
                tags = {name: value.dtype_tag}
                shapes = {name: list(value.shape)}
            else:
                flat, meta = _format.flatten({name: value}, None)
                tags = {key: _format.writer_tag(arr) for key, arr in flat.items()}
                shapes = {key: list(arr.shape) for key, arr in flat.items()}
            if name in self._names:
                raise ValueError(f"tensor name {name!r} is used twice")
            for key in flat:
                if key in self._index or key in self._names:
                    raise ValueError(f"tensor name {key!r} is used twice")
            for key, arr in flat.items():
                # Raw bytes through a uint8 view (no copy of a C-contiguous tensor).
                try:
                    offset = self._spill.append(arr.reshape(-1).view(np.uint8))
                except OSError as e:  # the spill sits beside the output: name the output
                    if e.errno is None:  # not the system's (a forked child's use)
                        raise
                    raise OSError(e.errno, e.strerror, os.fspath(self._path)) from None
                self._index[key] = (tags[key], shapes[key], offset, arr.nbytes)
            self._names.add(name)
            self._meta.update(meta)

    def close(self) -> None:
        """Write the file and drop the spill (once: closing again does nothing)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._spill.closed:
            return
        try:
            entries = [
                (key, tag, shape, offset, size)
                for key, (tag, shape, offset, size) in self._index.items()
            ]
            meta = self._meta or None
            try:
                _format.write_file(
                    self._path,
                    lambda tmp: self._spill.write_safetensors(tmp, entries, meta),
                    self._replace,
                    self._on_done,
                )
            except FormatError as e:  # safetensors refused the header: name the file
                raise FormatError(
                    f"cannot write {os.fspath(self._path)!r}: its header (names, shapes, "
                    f"metadata) is refused by safetensors' writer ({e})"
                ) from None
        finally:
            self._drop_spill()

    def _drop_spill(self) -> None:
        self._spill.close()

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            with self._lock:
                self._drop_spill()
