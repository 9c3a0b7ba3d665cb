"""The file format under :mod:`ferroquant.serialization`: generic, knows no scheme.

A file is a standard safetensors file. Each quantized value named ``name`` is
stored as its arrays ``name::<role>`` plus one metadata entry
``ferroquant:<name>`` whose value is JSON::

    {"format_version": 1, "scheme": "blockwise8", "shape": [...], "dtype": "float32",
     "block_size": 64, "arrays": {"data": "name::data", "scales": "name::scales"}}

Value classes register their scheme here (``_base.Quantized`` does it for every
subclass) and declare their array roles and parameters; this module checks an
entry against that declaration exactly (no missing, unknown or extra key, no
extra array) and lets the class's own constructor validate the contents. It
never imports a value class.

Headers are parsed once, by the ``safetensors`` crate (the parser the
``safetensors`` package wraps), through the native module; tensor bytes are
then read from the offsets it validated. Files are written through the
``safetensors`` package to a temporary file in the destination directory and
renamed into place, with the permissions any tool that creates files gives
(``0o666`` less the umask, or the mode of the file being replaced).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
import stat
import struct
import sys
import threading
from typing import (
    Any,
    BinaryIO,
    Callable,
    ClassVar,
    Dict,
    Iterator,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    Union,
)

import ml_dtypes
import numpy as np
from safetensors import TensorSpec, serialize, serialize_file

from . import _ferroquant as _native
from ._checks import MAX_NDIM, any_masked, owned
from .errors import FormatError, QuantizationError

#: Version of the metadata layout written by this release.
FORMAT_VERSION = 1

ENTRY_PREFIX = "ferroquant:"
ROLE_SEP = "::"
SINGLE = "value"  # name used by to_bytes/from_bytes for one value

#: The largest header the safetensors parser accepts (its MAX_HEADER_SIZE).
MAX_HEADER = 100_000_000

#: Keys of an entry besides the class's parameters.
_ENTRY_KEYS = ("format_version", "scheme", "arrays")

PathLike = Union[str, "os.PathLike[str]"]

# safetensors dtype tag -> numpy dtype, for every tag NumPy or ml_dtypes can
# hold one element per item of (F4 and F6 pack elements into bits: they cannot).
_TAGS: Dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _TAGS["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
#: numpy dtype name -> the name the safetensors writer takes (its own spelling).
_WRITABLE = {dt.name: dt.name for dt in _TAGS.values()}

# -- schemes -------------------------------------------------------------------------

_SCHEMES: Dict[str, type] = {}


def register_scheme(scheme: str, cls: type) -> None:
    """Make ``cls`` the class that files with entries of ``scheme`` decode to."""
    if scheme in _SCHEMES and _SCHEMES[scheme] is not cls:
        raise ValueError(f"scheme {scheme!r} is already registered by {_SCHEMES[scheme]!r}")
    _SCHEMES[scheme] = cls


def is_quantized(value: Any) -> bool:
    """Whether ``value`` is an instance (or a subclass's) of a registered quantized class."""
    return isinstance(value, tuple(_SCHEMES.values()))


def schemes() -> List[str]:
    """The registered scheme tags."""
    return sorted(_SCHEMES)


# -- writing -------------------------------------------------------------------------


def storable(arr: np.ndarray, name: str) -> np.ndarray:
    """Contiguous, little-endian array safetensors can write (it mis-writes strided ones)."""
    dt = arr.dtype
    try:
        native = dt.newbyteorder("=").name
    except (TypeError, ValueError):  # NumPy 2's new-style dtypes (StringDType) have no byte order
        native = ""
    if native not in _WRITABLE:
        raise TypeError(f"tensors[{name!r}] has dtype {dt}, which safetensors cannot store")
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        arr = arr.astype(dt.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def writer_dtype(arr: np.ndarray) -> str:
    """The dtype name the safetensors writer takes for ``arr``."""
    return _WRITABLE[arr.dtype.newbyteorder("=").name]


#: numpy dtype name -> the safetensors dtype tag of the file format ("F32", ...).
_TAG_OF = {dt.name: tag for tag, dt in _TAGS.items()}


def writer_tag(arr: np.ndarray) -> str:
    """The safetensors dtype tag for ``arr`` (as the file format spells it)."""
    return _TAG_OF[arr.dtype.newbyteorder("=").name]


def _spec(arr: np.ndarray) -> TensorSpec:
    return TensorSpec(
        dtype=writer_dtype(arr),
        shape=list(arr.shape),
        data_ptr=arr.ctypes.data,
        data_len=arr.nbytes,
    )


def specs(flat: Mapping[str, np.ndarray]) -> Dict[str, TensorSpec]:
    """TensorSpecs for arrays made by :func:`storable` (they must stay alive)."""
    return {k: _spec(a) for k, a in flat.items()}


def user_metadata(metadata: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """Check caller metadata: str -> str, no key in ferroquant's reserved namespace."""
    if metadata is not None and not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a mapping of str to str, got {type(metadata).__name__}")
    meta: Dict[str, str] = {}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map str to str, got {k!r}: {type(v).__name__}")
        for text in (k, v):
            _utf8(text, f"metadata[{k!r}]")
        if k.startswith(ENTRY_PREFIX):
            raise ValueError(f"metadata key {k!r} is reserved (prefix {ENTRY_PREFIX!r})")
        meta[k] = v
    return meta


def _utf8(text: str, what: str) -> None:
    """safetensors headers are UTF-8 JSON: refuse text that cannot be encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid UTF-8: {text!r}") from None


def _entry(name: str, value: Any) -> Tuple[str, Dict[str, np.ndarray]]:
    arrays, params = value._record()
    names = {role: f"{name}{ROLE_SEP}{role}" for role in arrays}
    tag = type(value)._tag or value.scheme
    entry = {"format_version": FORMAT_VERSION, "scheme": tag, **params, "arrays": names}
    return json.dumps(entry), {names[role]: arr for role, arr in arrays.items()}


def flatten(
    tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]]
) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """Split values into the arrays to store and the header metadata describing them."""
    if not isinstance(tensors, Mapping):
        raise TypeError(
            f"tensors must be a mapping of names to arrays, got {type(tensors).__name__}"
        )
    meta = user_metadata(metadata)
    flat: Dict[str, np.ndarray] = {}

    def put(key: str, arr: np.ndarray) -> None:
        if key == "__metadata__":
            raise ValueError("'__metadata__' is reserved by safetensors and cannot name a tensor")
        if key in flat:
            raise ValueError(f"tensor name {key!r} is used twice; rename one of the tensors")
        flat[key] = storable(arr, key)

    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        _utf8(name, "tensor name")
        if name == "__metadata__":
            # For a quantized value too: its arrays would be stored (as
            # "__metadata__::data"), but restoring it needs a tensor of this name.
            raise ValueError("'__metadata__' is reserved by safetensors and cannot name a value")
        if isinstance(value, np.ndarray):
            if isinstance(value, np.ma.MaskedArray) and any_masked(value):
                # safetensors stores values only: the mask would be lost without
                # a word, and the masked values read back as data.
                raise TypeError(
                    f"tensors[{name!r}] is a masked array with masked values, which "
                    f"safetensors cannot store; save .filled(value) (and the mask as "
                    f"its own tensor if it is needed)"
                )
            put(name, value)
        elif is_quantized(value):
            text, arrays = _entry(name, value)
            meta[ENTRY_PREFIX + name] = text
            for key, arr in arrays.items():
                put(key, arr)
        else:
            raise TypeError(
                f"tensors[{name!r}] must be a numpy array or a ferroquant quantized value, "
                f"got {type(value).__name__}"
            )
    return flat, meta


def dump_bytes(tensors: Mapping[str, Any], metadata: Optional[Mapping[str, str]]) -> bytes:
    """The safetensors bytes of ``tensors``."""
    flat, meta = flatten(tensors, metadata)
    try:
        raw = bytes(serialize(specs(flat), metadata=meta or None))
        return _sorted_metadata(raw) if len(meta) > 1 else raw
    except Exception as e:
        raise _writer_error(e, None) from None
    except BaseException as e:
        # The writer panics (pyo3's PanicException, a BaseException) when the
        # bytes object it returns cannot be allocated ("PyObject pointer is null").
        if type(e).__name__ == "PanicException":
            raise MemoryError(
                f"out of memory: safetensors could not allocate the serialized bytes ({e})"
            ) from None
        raise


def _writer_error(e: BaseException, dest: Optional[str]) -> BaseException:
    """An error of safetensors' writer in our terms. Its ``SafetensorError``
    is neither an ``OSError`` nor a ``ValueError``: an I/O failure (its text
    ends in "(os error N)") becomes the ``OSError`` N naming ``dest``, any
    other (a header over its limit) a ``FormatError``."""
    if type(e).__name__ != "SafetensorError":
        return e
    code = re.search(r"\(os error (\d+)\)", str(e))
    if code and dest is not None:
        n = int(code.group(1))
        return OSError(n, os.strerror(n), dest)
    what = "the safetensors data" if dest is None else repr(dest)
    return FormatError(f"cannot write {what}: {e}")


def _umask() -> int:
    """The process umask, read without changing it where the OS allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _os_error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


#: Symbolic links ``open`` follows before giving up with ELOOP (Linux's limit).
_MAX_LINKS = 40


def _check_as_open_would(path: str, shown: str, links: int = 0) -> None:
    """Raise what ``open(path, "w")`` would for what ``realpath`` flattens.

    ``realpath`` reads ``x/.``, ``x/..`` and a trailing slash as text, without
    asking whether ``x`` is a directory, so ``file/.`` would become ``file``.
    ``open`` resolves step by step: the parent as written must be a directory
    (ENOENT / ENOTDIR otherwise), a last part ``.`` or ``..`` or a trailing
    slash names a directory (EISDIR), and a last part that is a symbolic link
    is followed and its target checked the same way.
    """
    if not path:
        raise _os_error(errno.ENOENT, shown)
    if path.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise _os_error(errno.EISDIR, shown)
    parent = os.path.dirname(path)
    if parent:
        try:
            st = os.stat(parent)
        except OSError as e:
            raise _os_error(e.errno or errno.ENOENT, shown) from None
        if not stat.S_ISDIR(st.st_mode):
            raise _os_error(errno.ENOTDIR, shown)
    if os.path.basename(path) in (".", ".."):
        raise _os_error(errno.EISDIR, shown)
    if os.path.islink(path):
        if links >= _MAX_LINKS:
            raise _os_error(errno.ELOOP, shown)
        try:
            target = os.readlink(path)
        except OSError as e:
            raise _os_error(e.errno or errno.EIO, shown) from None
        _check_as_open_would(os.path.join(parent, target), shown, links + 1)


def prepare_destination(path: PathLike) -> Tuple[str, str]:
    """Check that ``path`` can be written as a file; returns (the user's path, the real one).

    Raises the ``OSError`` subclass ``open`` would, naming the user's path:
    a missing directory, a directory in place of the file, a file or
    directory without write permission.
    """
    dest = os.fspath(path)
    if not isinstance(dest, str):
        dest = os.fsdecode(dest)
    _check_as_open_would(dest, dest)
    real = os.path.realpath(dest)
    parent = os.path.dirname(real) or "."
    if os.path.isdir(real):
        raise _os_error(errno.EISDIR, dest)
    if os.path.exists(real) and not os.path.isfile(real):
        # A device, FIFO or socket: replacing it with a regular file (the write
        # is a rename into place) would destroy it, e.g. /dev/null as root.
        raise OSError(
            errno.EINVAL, "not a regular file (ferroquant writes files, atomically)", dest
        )
    if not os.path.isdir(parent):
        raise _os_error(errno.ENOENT, dest)
    if os.path.exists(real) and not os.access(real, os.W_OK):
        raise _os_error(_denied(parent), dest)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _os_error(_denied(parent), dest)
    return dest, real


def _denied(directory: str) -> int:
    """Why a write in ``directory`` is refused, as ``open`` would say: EROFS on a
    read-only file system (``access`` says only no), else EACCES."""
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return errno.EROFS
    except (OSError, AttributeError):  # no statvfs here
        pass
    return errno.EACCES


def _create(name: str) -> None:
    """Create the empty file ``name`` (mode 0o600 less the umask); FileExistsError
    if anything has that name. Without a descriptor where the system allows
    (``mknod``): an exception raised by a signal handler right after the call then
    has nothing to leak."""
    try:
        os.mknod(name, 0o600 | stat.S_IFREG)
        return
    except FileExistsError:
        raise
    except (AttributeError, OSError):  # no mknod, or not for regular files here
        pass
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    os.close(fd)


def write_file(
    path: PathLike,
    write: Callable[[str], None],
    replace: bool = True,
    on_done: Optional[Callable[[], None]] = None,
) -> None:
    """Run ``write(tmp)`` to make the file, then rename it over ``path``; then
    ``on_done()``, at once (a command line names the file when a signal stops it
    after that point).

    A failed write leaves ``path`` as it was. The new file gets the mode of
    the file it replaces, or ``0o666`` less the umask. Every failure is an
    ``OSError`` naming the user's path (never an internal temporary name).
    With ``replace=False`` an existing ``path`` is never replaced, however late
    it appeared: the file is linked into place (``FileExistsError`` if taken).
    """
    dest, real = prepare_destination(path)
    parent = os.path.dirname(real) or "."
    try:
        mode = stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    except OSError as e:
        raise _os_error(e.errno or errno.EIO, dest) from None
    tmp: Optional[str] = None
    try:
        # The name is known before the file exists, so an exception raised by a
        # signal handler (a CLI's SIGTERM unwinds) at any point removes it. The
        # name is random (48 bits): one that exists is someone else's, skipped.
        for _ in range(100):
            tmp = os.path.join(parent, f".ferroquant-{secrets.token_hex(6)}.tmp")
            try:
                _create(tmp)
                break
            except FileExistsError:
                tmp = None
        else:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dest)
        write(tmp)
        os.chmod(tmp, mode)
        # Signals wait until the file has its name and on_done knows it: one that
        # landed between the two would stop a run whose output is in place unsaid.
        with signals_held():
            if replace:
                os.replace(tmp, real)
            else:
                # At the path as given: a name that appeared meanwhile, a dangling
                # symbolic link included, is never followed or replaced.
                _link_new(tmp, dest)
            if on_done is not None:
                on_done()
    except BaseException as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if isinstance(e, OSError):
            raise _os_error(e.errno or errno.EIO, dest) from None
        if type(e).__name__ == "SafetensorError":
            raise _writer_error(e, dest) from None
        raise


class _Held:
    """What :func:`signals_held` holds: how deep, and what a signal handler deferred."""

    depth: ClassVar[int] = 0
    deferred: ClassVar[List[Callable[[], None]]] = []


def holding_signals() -> bool:
    """Whether the main thread is inside :class:`signals_held`: a signal handler that
    would raise should :func:`defer` instead (Python runs handlers in the main thread)."""
    return _Held.depth > 0


def defer(action: Callable[[], None]) -> None:
    """Run ``action`` (raising, typically) when the outermost hold ends; the first one
    deferred wins."""
    _Held.deferred.append(action)


class signals_held:
    """In the main thread, a block that signal handlers cooperating through
    :func:`holding_signals` do not interrupt: what they defer runs when it ends.
    (Blocking the signals with ``pthread_sigmask`` is not enough: another thread of
    the process takes the signal, and Python still runs the handler in the main
    thread at once.) Elsewhere, nothing."""

    def __enter__(self) -> None:
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            _Held.depth += 1

    def __exit__(self, *exc: Any) -> None:
        if not self._main:
            return
        _Held.depth -= 1
        if _Held.depth == 0 and _Held.deferred:
            first = _Held.deferred[0]
            _Held.deferred.clear()
            # Also when the block failed: the signal came first, and takes over (as
            # it would have, raised where it landed).
            first()


def _link_new(tmp: str, dest: str) -> None:
    """Give the finished ``tmp`` the name ``dest`` only if nothing has it, then drop
    ``tmp``'s name: a hard link fails with EEXIST atomically (and never follows a
    symbolic link at ``dest``)."""
    try:
        os.link(tmp, dest)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        # A file system without hard links: claim the name with an exclusive create
        # (EEXIST if anything has it), then rename the file over that placeholder.
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0)
        os.close(fd)
        try:
            os.replace(tmp, dest)
        except BaseException:
            os.unlink(dest)
            raise
        return
    os.unlink(tmp)


def write_tensors(path: PathLike, spec_map: Mapping[str, TensorSpec], meta: Dict[str, str]) -> None:
    """Write a safetensors file from TensorSpecs (see :func:`write_file`)."""

    def write(tmp: str) -> None:
        serialize_file(dict(spec_map), tmp, metadata=meta or None)
        if len(meta) > 1:
            _native.sort_safetensors_metadata_file(tmp)

    write_file(path, write)


def _sorted_metadata(data: bytes) -> bytes:
    """``data`` (safetensors bytes) with its metadata in key order: the writer puts it
    in a hash map's order, which changes from one call to the next."""
    (n,) = struct.unpack_from("<Q", data)
    new = _native.sort_safetensors_metadata(data[8 : 8 + n])
    if new is None:
        return data
    return b"".join((data[:8], new, memoryview(data)[8 + n :]))


# -- reading -------------------------------------------------------------------------


class ArrayHeader(NamedTuple):
    """What the header says of a plain array, its bytes unread."""

    dtype: np.dtype
    shape: Tuple[int, ...]
    nbytes: int


class OpaqueTensor:
    """A tensor whose elements NumPy cannot hold (safetensors' sub-byte ``F4``,
    ``F6_E2M3``, ``F6_E3M2``): its dtype tag, shape and raw bytes (``data``, None
    when only the header was read), which the command line copies unchanged."""

    __slots__ = ("data", "dtype_tag", "nbytes", "shape")

    def __init__(
        self, dtype_tag: str, shape: Tuple[int, ...], nbytes: int, data: Optional[np.ndarray]
    ) -> None:
        self.dtype_tag = dtype_tag
        self.shape = shape
        self.nbytes = nbytes
        self.data = data


class Tensor:
    """Where one tensor's bytes are: dtype, shape and absolute byte offset."""

    __slots__ = ("dtype_tag", "nbytes", "offset", "shape")

    def __init__(self, dtype_tag: str, shape: List[int], offset: int, nbytes: int) -> None:
        self.dtype_tag = dtype_tag
        self.shape = shape
        self.offset = offset
        self.nbytes = nbytes


def parse_header(
    read: Callable[[int, int], bytes], size: int, origin: str
) -> Tuple[Dict[str, str], Dict[str, Tensor]]:
    """Parse a safetensors header once. ``read(offset, n)`` reads the source.

    Returns the metadata and name -> :class:`Tensor` in file order. Raises
    FormatError (prefixed with ``origin``) for anything the safetensors
    parser refuses, or a shape NumPy cannot represent.
    """
    bad = f"{origin}: not a valid safetensors file"
    if size < 8:
        raise FormatError(f"{bad}: {size} bytes is too short for a header")
    (n,) = struct.unpack("<Q", read(0, 8))
    if n > MAX_HEADER:
        raise FormatError(f"{bad}: header length {n} exceeds the limit of {MAX_HEADER} bytes")
    if 8 + n > size:
        raise FormatError(f"{bad}: header length {n} exceeds the {size - 8} bytes that follow")
    header = read(8, n)
    if len(header) != n:
        raise FormatError(f"{bad}: truncated header")
    try:
        meta_pairs, entries = _native.parse_safetensors_header(header, size, MAX_NDIM)
    except FormatError as e:
        raise FormatError(f"{bad}: {e}") from None
    tensors: Dict[str, Tensor] = {}
    base = 8 + n
    for name, tag, shape, start, end in entries:  # shapes checked by the parser
        tensors[name] = Tensor(tag, shape, base + start, end - start)
    return dict(meta_pairs), tensors


#: safetensors stores every element little-endian: the native dtypes on a little-endian
#: host (the canonical objects, which fast paths compare by identity), "<" on others.
_LITTLE_HOST = sys.byteorder == "little"


def _numpy_dtype(t: Tensor, name: str, origin: str) -> np.dtype:
    """The NumPy dtype of tensor ``t``, little-endian as safetensors stores every
    element (see ``_LITTLE_HOST``), or FormatError for one NumPy cannot hold."""
    dt = _TAGS.get(t.dtype_tag)
    if dt is None:
        raise FormatError(
            f"{origin}: tensor {name!r} has dtype {t.dtype_tag}, which NumPy cannot hold "
            "(elements narrower than a byte)"
        )
    return dt if _LITTLE_HOST else dt.newbyteorder("<")


def array_at(buf: Any, t: Tensor, name: str, origin: str) -> np.ndarray:
    """The read-only array ``t`` describes inside ``buf`` (a copy only if unaligned)."""
    dt = _numpy_dtype(t, name, origin)
    count = t.nbytes // dt.itemsize
    if count == 0:
        arr = np.empty(t.shape, dt)
    else:
        arr = np.frombuffer(buf, dtype=dt, count=count, offset=t.offset).reshape(t.shape)
        if not arr.flags.aligned:
            arr = arr.copy()
    arr.flags.writeable = False
    return arr


def unique_keys(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """A JSON object's members, refusing a key given twice (``json`` keeps the last)."""
    out: Dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _check_entry(name: str, raw: str, present: Mapping[str, Any]) -> Tuple[type, Dict[str, Any]]:
    try:
        entry = json.loads(raw, object_pairs_hook=unique_keys)
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
    cls = _SCHEMES.get(scheme) if isinstance(scheme, str) else None
    if cls is None:
        raise FormatError(f"entry {name!r} has unknown scheme {scheme!r}; known: {schemes()}")
    want_keys = set(_ENTRY_KEYS) | set(cls._params)  # type: ignore[attr-defined]
    # Keys added after files were first written may be absent (their default applies).
    later = set(getattr(cls, "_later_params", ()))
    if not set(entry) <= want_keys or not want_keys - later <= set(entry):
        missing = sorted(want_keys - later - set(entry))
        extra = sorted(set(entry) - want_keys)
        raise FormatError(
            f"entry {name!r} ({scheme}) must have exactly the keys {sorted(want_keys)}"
            f"{'; missing ' + str(missing) if missing else ''}"
            f"{'; unknown ' + str(extra) if extra else ''}"
        )
    refs = entry["arrays"]
    roles = set(record_roles(cls))
    optional = set(cls._optional)  # type: ignore[attr-defined]
    if not isinstance(refs, dict) or not (roles - optional <= set(refs) <= roles):
        got = sorted(refs) if isinstance(refs, dict) else type(refs).__name__
        want = f"exactly {sorted(roles - optional)}" + (
            f" (and optionally {sorted(optional)})" if optional else ""
        )
        raise FormatError(f"entry {name!r}: 'arrays' must map {want}, got {got}")
    for arr_name in refs.values():
        if not isinstance(arr_name, str) or arr_name not in present:
            raise FormatError(f"entry {name!r} refers to missing tensor {arr_name!r}")
    return cls, entry


def record_roles(cls: type) -> Tuple[str, ...]:
    """The array roles a class's record holds: its ``_roles`` if it declares them
    (a value whose arrays are not its fields), else its array fields."""
    return getattr(cls, "_roles", None) or cls._arrays  # type: ignore[attr-defined]


def plan(names: Mapping[str, Any], meta: Mapping[str, str]) -> Dict[str, Any]:
    """Validate every ferroquant entry against the tensors present.

    Returns name -> (class, entry) for quantized values and name -> None for
    plain arrays, in name order. Reads no tensor data. Every tensor ends up
    either plain or claimed by exactly one entry: none is dropped.
    """
    out: Dict[str, Any] = {}
    claimed: Dict[str, str] = {}
    for key in sorted(meta):
        if not key.startswith(ENTRY_PREFIX):
            continue
        name = key[len(ENTRY_PREFIX) :]
        cls, entry = _check_entry(name, meta[key], names)
        for arr_name in entry["arrays"].values():
            if arr_name in claimed:
                raise FormatError(
                    f"tensor {arr_name!r} is claimed by entries {claimed[arr_name]!r} and {name!r}"
                )
            claimed[arr_name] = name
        out[name] = (cls, entry)
    for name in names:
        if name in claimed:
            continue
        if name in out:
            raise FormatError(f"{name!r} is both a plain tensor and a quantized entry")
        out[name] = None
    return dict(sorted(out.items()))


def decode(
    names: Mapping[str, Any],
    meta: Mapping[str, str],
    get: Callable[[str], np.ndarray],
    plain: Optional[Callable[[str], Any]] = None,
) -> Iterator[Tuple[str, Any]]:
    """Yield (name, value) in name order, reading each tensor only when its value is due;
    a plain tensor's value is ``plain(name)`` when given (else the array ``get`` reads)."""
    for name, how in plan(names, meta).items():
        if how is None:
            yield name, (plain or get)(name)
        else:
            cls, entry = how
            # Arrays read for a value are the reader's own: the value holds them as
            # they are (`held` copies read-only memory a caller could make writable).
            parts = {role: _reader_owned(get(a)) for role, a in entry["arrays"].items()}
            params = {k: v for k, v in entry.items() if k not in _ENTRY_KEYS}
            try:
                value = cls._from_record(parts, params)
            except FormatError as e:
                raise FormatError(f"entry {name!r}: {e}") from None
            yield name, value


def _reader_owned(arr: np.ndarray) -> np.ndarray:
    """A read-only view of ``arr`` marked as the reader's own when ``arr`` owns its
    memory (bytes it allocated and filled): the view, not the owner, goes into the
    value, so its holder cannot set it writable again (NumPy refuses for a view of
    a read-only owner). A view of immutable ``bytes``, or of a larger buffer the
    reader marked (``FileReader._part``), is private already."""
    return owned(arr) if arr.base is None else arr


def parse_bytes(data: Any) -> Dict[str, Any]:
    """Decode safetensors bytes into name -> value (arrays view ``data`` where aligned)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    if not isinstance(data, bytes):
        data = bytes(data)  # a private, immutable copy the arrays may view
    buf = data
    meta, tensors = parse_header(lambda off, n: buf[off : off + n], len(buf), "bytes")
    return dict(decode(tensors, meta, lambda name: array_at(buf, tensors[name], name, "bytes")))


R = TypeVar("R", bound="FileReader")


def _check_regular(mode: int, path: str) -> None:
    """Raise the error :func:`open_regular` gives for a file of ``mode`` that is not
    a regular file."""
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
        )
        raise OSError(errno.EINVAL, f"not a regular file ({kind} cannot be read)", path)


def open_regular(path: str) -> BinaryIO:
    """``path`` opened for binary reads, if it is a regular file.

    Checked before it is opened (opening a FIFO, even to refuse it, would release a
    writer blocked opening it into a pipe nobody reads), then opened without blocking
    and checked again (it may have been replaced meanwhile): opening a FIFO that has
    no writer would otherwise wait forever. The usual ``OSError`` for a missing path,
    ``IsADirectoryError`` for a directory, ``OSError(EINVAL)`` for anything else
    that is not a regular file (a FIFO, a device, a socket).
    """
    _check_regular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _check_regular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    # Outside the try: once the file object owns the descriptor, it closes it.
    return os.fdopen(fd, "rb")


#: The transparent huge page size on x86-64.
HUGE_PAGE = 2 << 20


def empty_on_huge_pages(shape: Sequence[int], dtype: np.dtype) -> Tuple[np.ndarray, np.ndarray]:
    """``(array, owner)``: an array of ``shape`` and ``dtype`` to be filled whole, and
    the array owning its memory.

    An array of 2 MiB or more starts on a 2 MiB boundary inside a zeroed byte buffer
    (its owner) of whole 2 MiB pages and one more. NumPy asks for transparent huge
    pages on arrays of 4 MiB or more, but its allocation starts just past a 4 KiB
    page, so only the 2 MiB blocks wholly inside get them: a quarter of an 8 MiB
    weight would stay on 4 KiB pages, and the GEMV streaming it is slower for that
    (the output cache aligns the arrays the kernels return the same way). The slack
    stays zero (``calloc``: fresh pages are not even touched), so ``.base`` shows
    nothing of earlier allocations."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE:
        arr = np.empty(shape, dtype)
        return arr, arr
    padded = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    try:
        owner = np.zeros(padded, np.uint8)
    except MemoryError:  # without room for the padding the array itself may fit
        arr = np.empty(shape, dtype)
        return arr, arr
    start = -int(owner.ctypes.data) % HUGE_PAGE
    return owner[start : start + nbytes].view(dtype).reshape(shape), owner


class FileReader:
    """A safetensors file opened for lazy reads: the header parsed once, each tensor
    read into a fresh array when asked for.

    Tensors are read with ``readinto`` rather than through a memory map: a file
    truncated or rewritten while it is read then gives a FormatError instead of
    killing the process with SIGBUS. With ``opaque`` (the command line's reader), a
    plain tensor NumPy cannot hold comes from :meth:`entries` as an
    :class:`OpaqueTensor` instead of a FormatError.
    """

    opaque = False

    def __init__(self, path: PathLike) -> None:
        self.path = os.fspath(path)
        self._f: BinaryIO = open_regular(self.path)
        try:
            self._size = os.fstat(self._f.fileno()).st_size

            def read(off: int, n: int) -> bytes:
                self._f.seek(off)
                return self._f.read(n)

            self.metadata, self.tensors = parse_header(read, self._size, str(self.path))
        except BaseException:
            self._f.close()
            raise

    @property
    def names(self) -> List[str]:
        """Tensor names in file order."""
        return list(self.tensors)

    def get(self, name: str) -> np.ndarray:
        """A read-only array holding tensor ``name`` (the caller may make it writable:
        its memory, or the buffer it views, is the caller's)."""
        return self._read(name)[0]

    def _part(self, name: str) -> np.ndarray:
        """Tensor ``name`` as part of a quantized value: read-only, and, when read into
        a larger buffer, that buffer marked as the reader's (read-only and private,
        see ``_reader_owned``) so that the value holds it without a copy."""
        arr, owner = self._read(name)
        if owner is not arr:
            owned(owner)
        return arr

    def _read(self, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """Tensor ``name`` read into a fresh read-only array, and that array's owner
        (see :func:`empty_on_huge_pages`)."""
        t = self.tensors[name]
        arr, owner = empty_on_huge_pages(t.shape, _numpy_dtype(t, name, self.path))
        self._read_into(name, arr.reshape(-1).view(np.uint8))
        arr.flags.writeable = False
        return arr, owner

    def _read_into(self, name: str, raw: np.ndarray) -> None:
        """Fill ``raw`` (uint8, the tensor's byte count) with tensor ``name``'s bytes."""
        t = self.tensors[name]
        if t.nbytes:
            self._f.seek(t.offset)
            got = self._f.readinto(raw)  # type: ignore[attr-defined]
            if got != t.nbytes:
                raise FormatError(
                    f"{self.path}: tensor {name!r} is cut short ({got} of {t.nbytes} bytes): "
                    "the file changed while it was read"
                )

    def is_opaque(self, name: str) -> bool:
        """Whether tensor ``name`` has a dtype NumPy cannot hold."""
        return self.tensors[name].dtype_tag not in _TAGS

    def opaque_tensor(self, name: str, read: bool = True) -> OpaqueTensor:
        """Tensor ``name`` (one :meth:`is_opaque`) as its dtype tag, shape and bytes
        (read only with ``read``)."""
        t = self.tensors[name]
        data = None
        if read:
            data = np.empty(t.nbytes, np.uint8)
            self._read_into(name, data)
            data.flags.writeable = False
        return OpaqueTensor(t.dtype_tag, tuple(t.shape), t.nbytes, data)

    def entries(self, read_plain: bool = True) -> Iterator[Tuple[str, Any]]:
        """Yield (name, value) one at a time (quantized values are rebuilt). With
        ``read_plain=False`` a plain array comes as its :class:`ArrayHeader`, unread;
        with :attr:`opaque`, a plain tensor NumPy cannot hold as an :class:`OpaqueTensor`
        (a quantized value's arrays must still be NumPy's)."""
        strict = self.get if read_plain else self.header
        if not self.opaque:
            return decode(self.tensors, self.metadata, self._part, strict)

        def plain(name: str) -> Any:
            if self.is_opaque(name):
                return self.opaque_tensor(name, read_plain)
            return strict(name)

        return decode(self.tensors, self.metadata, self._part, plain)

    def header(self, name: str) -> ArrayHeader:
        """Tensor ``name`` as the header describes it (FormatError for a dtype NumPy
        cannot hold, as :meth:`get` would raise)."""
        t = self.tensors[name]
        return ArrayHeader(_numpy_dtype(t, name, self.path), tuple(t.shape), t.nbytes)

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self: R) -> R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def as_format_error(scheme: str, e: Exception) -> FormatError:
    """A FormatError for an entry whose contents its class refused."""
    if isinstance(e, FormatError):
        return e
    kind = "inconsistent" if isinstance(e, (QuantizationError, ValueError)) else "malformed"
    return FormatError(f"{kind} {scheme} entry: {e}")
