"""Threads and instruction set: the process-wide settings of the kernels."""

from __future__ import annotations

import warnings
from typing import List

from . import _ferroquant as _native
from ._checks import exact_int, positive_int
from .errors import InvalidConfigError

__all__ = [
    "get_num_threads",
    "get_output_cache",
    "set_num_threads",
    "set_output_cache",
    "simd_isa",
    "supported_isas",
]

#: The largest thread count :func:`set_num_threads` accepts.
MAX_THREADS = 1024


def set_num_threads(n: int) -> None:
    """Set how many threads the kernels use, 1 to 1024. Results do not depend on it.

    Raises:
        TypeError: ``n`` is not an integer.
        InvalidConfigError: ``n`` is outside 1..1024.
    """
    n = positive_int(n, "n")
    if n > MAX_THREADS:
        raise InvalidConfigError(f"n must be at most {MAX_THREADS} threads, got {n}")
    _native.set_num_threads(n)


def get_num_threads() -> int:
    """How many threads the kernels run on (``set_num_threads``, else
    ``FERROQUANT_NUM_THREADS`` as read at import, else the CPU count)."""
    return int(_native.get_num_threads())


def set_output_cache(max_bytes: int) -> None:
    """Set how many bytes of output buffers the kernels keep for reuse (0: none).

    Writing a large result into fresh memory costs a page fault and a zeroed
    page per 4 KiB (for a 64 MiB float32 result, more than the kernel itself),
    so outputs of 1 MiB or more are views of buffers that ferroquant keeps and
    hands out again once nothing references them: not the result, any view of
    it, a memoryview, nor a dataclass holding it. The default keeps at most
    256 MiB in at most 16 buffers; free buffers are given back first when a
    new size needs room. Lowering the limit lets go of buffers beyond it at
    once (results still in use stay valid); ``set_output_cache(0)`` turns reuse
    off and every result owns fresh memory.

    Raises:
        TypeError: ``max_bytes`` is not an integer.
        InvalidConfigError: ``max_bytes`` is negative or above 2**63 - 1.
    """
    n = exact_int(max_bytes, "max_bytes")
    if n < 0 or n > 2**63 - 1:
        raise InvalidConfigError(f"max_bytes must be in 0..2**63 - 1, got {n}")
    _native.set_output_cache(n)


def get_output_cache() -> int:
    """How many bytes of output buffers the kernels may keep for reuse
    (see :func:`set_output_cache`; 256 MiB unless changed)."""
    return int(_native.get_output_cache())


def simd_isa() -> str:
    """The instruction set the kernels run on: ``"avx512vnni"``, ``"avx512"``, ``"avx2"``
    or ``"scalar"``.

    Chosen once at import from what the CPU supports; ``FERROQUANT_SIMD=scalar``
    (or ``avx2``) set before import caps it.
    """
    return str(_native.simd_isa())


def supported_isas() -> List[str]:
    """Every instruction set this CPU can run the kernels on, scalar first."""
    return [str(s) for s in _native.supported_isas()]


def warn_about_environment() -> None:
    """One RuntimeWarning for each ferroquant environment variable that is ignored."""
    for message in _native.env_warnings():
        warnings.warn(message, RuntimeWarning, stacklevel=3)
