"""Saving and loading quantized tensors as safetensors files.

Layout: each quantized value named ``name`` is stored as its arrays, named
``name::<role>`` (``name::data``, ``name::scales``, ...), plus one metadata
entry ``ferroquant:<name>`` whose value is JSON::

    {"format_version": 1, "scheme": "blockwise8", "shape": [...], "dtype": "float32",
     "block_size": 64, "arrays": {"data": "name::data", "scales": "name::scales"}}

Plain NumPy arrays are stored under their own name with no entry, so any
safetensors reader can open the file and any safetensors file without
ferroquant entries loads as plain arrays. Files are written and read through
the ``safetensors`` package (its Rust parser bounds the header, checks offsets
and never executes code); everything ferroquant adds on top is validated on
load and refused with :class:`~ferroquant.errors.FormatError`.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import tempfile
from typing import (
    IO,
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Tuple,
    Union,
)

import ml_dtypes
import numpy as np
from safetensors import TensorSpec, deserialize, safe_open, serialize, serialize_file

from .errors import FormatError
from .types import BlockwiseQuantized

__all__ = ["FORMAT_VERSION", "load", "load_bytes", "save", "save_bytes"]

#: Version of the metadata layout written by this release.
FORMAT_VERSION = 1

_ENTRY_PREFIX = "ferroquant:"
_ROLE_SEP = "::"
_SINGLE = "value"  # name used by to_bytes/from_bytes for one value

#: Quantized result types by the scheme tag stored in files.
SCHEMES: Dict[str, type] = {BlockwiseQuantized.scheme: BlockwiseQuantized}

Quantized = Union[BlockwiseQuantized]
Entry = Union[Quantized, np.ndarray]
PathLike = Union[str, "os.PathLike[str]"]

# safetensors dtype tags -> numpy dtypes. Importing ml_dtypes also registers the
# "bfloat16" dtype that safe_open needs to read BF16 tensors.
_ST_DTYPES: Dict[str, Any] = {
    "BF16": ml_dtypes.bfloat16,
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}


def _storable(arr: np.ndarray, name: str) -> np.ndarray:
    """Contiguous, little-endian array safetensors can write (it mis-writes strided ones)."""
    dt = arr.dtype
    if not ((dt.kind in "biuf" and dt.itemsize <= 8) or dt.name == "bfloat16"):
        raise TypeError(f"tensors[{name!r}] has dtype {dt}, which safetensors cannot store")
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        arr = arr.astype(dt.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _spec(arr: np.ndarray) -> TensorSpec:
    return TensorSpec(
        dtype=arr.dtype.name, shape=list(arr.shape), data_ptr=arr.ctypes.data, data_len=arr.nbytes
    )


def _entry_json(name: str, value: Quantized) -> Tuple[str, Dict[str, np.ndarray]]:
    arrays, params = value._record()
    names = {role: f"{name}{_ROLE_SEP}{role}" for role in arrays}
    entry = {"format_version": FORMAT_VERSION, "scheme": value.scheme, **params, "arrays": names}
    return json.dumps(entry), {names[role]: arr for role, arr in arrays.items()}


def _user_metadata(metadata: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """Check caller metadata: str -> str, no key in ferroquant's reserved namespace."""
    meta: Dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
        if k.startswith(_ENTRY_PREFIX):
            raise ValueError(f"metadata key {k!r} is reserved (prefix {_ENTRY_PREFIX!r})")
        meta[k] = v
    return meta


def _flatten(
    tensors: Mapping[str, Entry], metadata: Optional[Mapping[str, str]]
) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Split values into the arrays to store and the header metadata describing them."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a mapping of names to arrays, got {type(tensors).__name__}"
        )
    meta = _user_metadata(metadata)
    flat: Dict[str, np.ndarray] = {}

    def put(key: str, arr: np.ndarray) -> None:
        if key in flat:
            raise ValueError(f"tensor name {key!r} is used twice; rename one of the tensors")
        flat[key] = _storable(arr, key)

    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if isinstance(value, np.ndarray):
            put(name, value)
        elif type(value) in SCHEMES.values():
            text, arrays = _entry_json(name, value)
            meta[_ENTRY_PREFIX + name] = text
            for key, arr in arrays.items():
                put(key, arr)
        else:
            raise TypeError(
                f"tensors[{name!r}] must be a numpy array or a ferroquant quantized value, "
                f"got {type(value).__name__}"
            )
    return flat, meta


def save(
    path: PathLike, tensors: Mapping[str, Entry], metadata: Optional[Mapping[str, str]] = None
) -> None:
    """Write arrays and quantized values to a safetensors file.

    Args:
        path: destination file (overwritten).
        tensors: name -> numpy array or quantized value (e.g. BlockwiseQuantized).
        metadata: extra str -> str header entries (keys may not start with ``ferroquant:``).

    Raises:
        TypeError: an entry is neither an array nor a quantized value.
        ValueError: two entries would store an array under the same name.
    """
    flat, meta = _flatten(tensors, metadata)
    serialize_file({k: _spec(a) for k, a in flat.items()}, os.fspath(path), metadata=meta or None)


def save_bytes(tensors: Mapping[str, Entry], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """Like :func:`save`, into bytes."""
    flat, meta = _flatten(tensors, metadata)
    return bytes(serialize({k: _spec(a) for k, a in flat.items()}, metadata=meta or None))


def _plan(names: Iterable[str], meta: Mapping[str, str]) -> Dict[str, Any]:
    """Validate every ferroquant entry against the file's tensor names.

    Returns name -> (class, parsed entry) for quantized values and name -> None
    for plain arrays, in name order. Reads no tensor data.
    """
    present = set(names)
    plan: Dict[str, Any] = {}
    claimed: set = set()
    for key in sorted(meta):
        if not key.startswith(_ENTRY_PREFIX):
            continue
        name = key[len(_ENTRY_PREFIX) :]
        try:
            entry = json.loads(meta[key])
        except (ValueError, RecursionError) as e:
            raise FormatError(f"metadata entry for {name!r} is not valid JSON: {e}") from None
        if not isinstance(entry, dict):
            raise FormatError(f"metadata entry for {name!r} must be a JSON object")
        version = entry.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise FormatError(f"entry {name!r} has no valid format_version: {version!r}")
        if version > FORMAT_VERSION:
            raise FormatError(
                f"entry {name!r} has format_version {version}; this ferroquant reads up to "
                f"{FORMAT_VERSION}: upgrade ferroquant"
            )
        scheme = entry.get("scheme")
        cls = SCHEMES.get(scheme) if isinstance(scheme, str) else None
        if cls is None:
            raise FormatError(
                f"entry {name!r} has unknown scheme {scheme!r}; known: {sorted(SCHEMES)}"
            )
        refs = entry.get("arrays")
        if not isinstance(refs, dict) or not all(
            isinstance(r, str) and isinstance(a, str) for r, a in refs.items()
        ):
            raise FormatError(f"entry {name!r}: 'arrays' must map roles to tensor names")
        for arr_name in refs.values():
            if arr_name not in present:
                raise FormatError(f"entry {name!r} refers to missing tensor {arr_name!r}")
            if arr_name in claimed:
                raise FormatError(f"tensor {arr_name!r} is claimed by two entries")
            claimed.add(arr_name)
        plan[name] = (cls, entry)
    for name in present - claimed:
        if name in plan:
            raise FormatError(f"{name!r} is both a plain tensor and a quantized entry")
        plan[name] = None
    return dict(sorted(plan.items()))


def _decode(
    names: Iterable[str], meta: Mapping[str, str], get: Callable[[str], np.ndarray]
) -> Iterator[Tuple[str, Entry]]:
    """Yield (name, value) in name order, reading each tensor only when its value is due."""
    for name, how in _plan(names, meta).items():
        if how is None:
            yield name, get(name)
        else:
            cls, entry = how
            parts = {role: get(arr_name) for role, arr_name in entry["arrays"].items()}
            yield name, cls._from_record(parts, entry)


def _freeze(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class TensorReader:
    """A safetensors file opened for lazy reads, every parser error mapped to FormatError."""

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb"):
            pass  # the usual OSError for missing/unreadable paths, not a FormatError
        try:
            self._f = safe_open(self.path, framework="np")
            self.metadata: Dict[str, str] = self._f.metadata() or {}
            self.names: List[str] = list(self._f.keys())
        except Exception as e:  # the safetensors parser's errors (SafetensorError, ...)
            raise FormatError(f"{self.path}: not a valid safetensors file: {e}") from None

    def get(self, name: str) -> np.ndarray:
        try:
            return _freeze(self._f.get_tensor(name))
        except Exception as e:
            raise FormatError(f"{self.path}: cannot read tensor {name!r}: {e}") from None

    def entries(self) -> Iterator[Tuple[str, Entry]]:
        """Yield (name, value) one at a time (quantized values are rebuilt)."""
        return _decode(self.names, self.metadata, self.get)


def load(path: PathLike) -> Dict[str, Entry]:
    """Read a safetensors file written by :func:`save` (or any safetensors file).

    Returns:
        name -> quantized value (for ferroquant entries) or numpy array, in name order.

    Raises:
        FileNotFoundError / PermissionError / IsADirectoryError: as ``open`` would.
        FormatError: the file is truncated, corrupt, or its entries are inconsistent.
    """
    return dict(TensorReader(path).entries())


def load_bytes(data: bytes) -> Dict[str, Entry]:
    """Like :func:`load`, from bytes made by :func:`save_bytes`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        flat = deserialize(data)
    except Exception as e:
        raise FormatError(f"not valid safetensors bytes: {e}") from None
    arrays: Dict[str, np.ndarray] = {}
    for name, info in flat:
        tag = info["dtype"]
        dt = _ST_DTYPES.get(tag)
        if dt is None:
            raise FormatError(f"tensor {name!r} has dtype {tag}, which ferroquant does not read")
        # safetensors data is little-endian, as is every host ferroquant's wheels target.
        arr = np.frombuffer(info["data"], dtype=dt)
        arrays[name] = _freeze(arr.reshape(info["shape"]))
    # deserialize validated the buffer; its header is 8 bytes of length then JSON.
    (hlen,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + hlen]).get("__metadata__") or {}
    return dict(_decode(arrays, meta, arrays.__getitem__))


def to_bytes(value: Quantized) -> bytes:
    """Serialize one quantized value (the dataclasses' ``to_bytes``)."""
    return save_bytes({_SINGLE: value})


def from_bytes(data: bytes) -> Entry:
    """Inverse of :func:`to_bytes` (the dataclasses' ``from_bytes``)."""
    out = load_bytes(data)
    if list(out) != [_SINGLE]:
        raise FormatError(f"bytes hold tensors {sorted(out)[:5]}, not one serialized value")
    return out[_SINGLE]


class StreamingWriter:
    """Write a safetensors file one tensor at a time, holding one tensor in memory.

    safetensors has no streaming writer (its header, which lists every
    tensor's offsets, comes first), so each tensor's bytes are spilled to an
    anonymous temporary file as they are added; :meth:`close` maps that file
    and has ``safetensors.serialize_file`` write the real file from it. Peak
    memory is the largest tensor, not the model.
    """

    def __init__(self, path: PathLike, metadata: Optional[Mapping[str, str]] = None) -> None:
        self._path = os.fspath(path)
        self._meta = _user_metadata(metadata)
        self._spill: IO[bytes] = tempfile.TemporaryFile(
            dir=os.path.dirname(os.path.abspath(self._path)) or None
        )
        self._index: Dict[str, Tuple[str, List[int], int, int]] = {}
        self._offset = 0

    def add(self, name: str, value: Entry) -> None:
        """Append one array or quantized value."""
        flat, meta = _flatten({name: value}, None)
        for key in flat:
            if key in self._index:
                raise ValueError(f"tensor name {key!r} is used twice")
        for key, arr in flat.items():
            # Raw bytes through a uint8 view: memoryview() refuses dtypes it has no
            # buffer format for (bfloat16), and tobytes() would copy the tensor.
            self._spill.write(arr.reshape(-1).view(np.uint8).data)
            self._index[key] = (arr.dtype.name, list(arr.shape), self._offset, arr.nbytes)
            self._offset += arr.nbytes
        self._meta.update(meta)

    def close(self) -> None:
        """Write the file and drop the spill."""
        self._spill.flush()
        try:
            if self._offset == 0:
                buf = np.zeros(1, np.uint8)
                base, mm = buf.ctypes.data, None
            else:
                mm = mmap.mmap(self._spill.fileno(), self._offset, access=mmap.ACCESS_READ)
                buf = np.frombuffer(mm, np.uint8)
                base = buf.ctypes.data
            specs = {
                key: TensorSpec(dtype=dt, shape=shape, data_ptr=base + off, data_len=size)
                for key, (dt, shape, off, size) in self._index.items()
            }
            serialize_file(specs, self._path, metadata=self._meta or None)
            del buf
            if mm is not None:
                mm.close()
        finally:
            self._spill.close()

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._spill.close()
