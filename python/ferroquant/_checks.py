"""Argument checks shared by the public API: one place, one wording."""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from .errors import InvalidConfigError

_MAX_INT = 2**63 - 1

#: dtypes the kernels read natively (bfloat16 comes from ml_dtypes).
FLOAT_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


def positive_int(value: Any, arg: str) -> int:
    """Return ``value`` as an int >= 1, or raise TypeError / InvalidConfigError naming ``arg``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{arg} must be an integer, got bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{arg} must be an integer, got {type(value).__name__}") from None
    if n < 1 or n > _MAX_INT:
        raise InvalidConfigError(f"{arg} must be an integer >= 1, got {n}")
    return n


def is_float_dtype(dt: np.dtype) -> bool:
    """Whether ``dt`` is one of the floating dtypes the kernels read natively."""
    return dt.name in FLOAT_DTYPE_NAMES or (dt.kind == "f" and dt.itemsize in (2, 4, 8))


def float_input(x: Any, arg: str) -> np.ndarray:
    """Prepare a floating input for the kernels without changing the caller's array.

    float32/float64/float16/bfloat16 arrays that are C-contiguous and in native
    byte order pass through untouched (the kernel reads them in place); other
    layouts cost one copy. Other dtypes raise ``TypeError`` naming ``arg``.
    """
    arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    dt = arr.dtype
    if not is_float_dtype(dt):
        raise TypeError(
            f"{arg} must be a floating array (float32, float64, float16 or bfloat16), "
            f"got dtype {dt}"
        )
    if not dt.isnative:
        return np.ascontiguousarray(arr, dtype=dt.newbyteorder("="))
    if not arr.flags.c_contiguous:
        return np.ascontiguousarray(arr)
    return arr


def scale_dtype(value: Any) -> np.dtype:
    """Normalize a ``scale_dtype`` argument to float16 or float32."""
    try:
        dt = np.dtype(value)
    except TypeError:
        raise InvalidConfigError(
            f"scale_dtype must be numpy.float16 or numpy.float32, got {value!r}"
        ) from None
    if dt not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise InvalidConfigError(f"scale_dtype must be numpy.float16 or numpy.float32, got {dt}")
    return dt


def readonly(arr: np.ndarray) -> np.ndarray:
    """Mark an array this library created as read-only (results are frozen) and return it."""
    arr.flags.writeable = False
    return arr
