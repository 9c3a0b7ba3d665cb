"""Threads and instruction set: the process-wide settings of the kernels."""

from __future__ import annotations

import warnings
from typing import List

from . import _ferroquant as _native
from ._checks import positive_int
from .errors import InvalidConfigError

__all__ = ["get_num_threads", "set_num_threads", "simd_isa", "supported_isas"]

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


def simd_isa() -> str:
    """The instruction set the kernels run on: ``"avx512"``, ``"avx2"`` or ``"scalar"``.

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
