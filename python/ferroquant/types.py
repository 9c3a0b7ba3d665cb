"""Frozen dataclasses for quantized results.

Every result type holds plain NumPy arrays (read-only when ferroquant made
them), compares by value, reports the bytes it holds as ``nbytes``, and prints
a one-line ``repr`` without the arrays. ``to_bytes`` / ``from_bytes`` use the
safetensors-based format of :mod:`ferroquant.serialization`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Tuple

import numpy as np

from ._checks import positive_int
from .errors import FormatError, ShapeMismatchError

__all__ = ["BlockwiseQuantized"]


def _shape_tuple(shape: Any, arg: str = "shape") -> Tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(f"{arg} must be a sequence of ints, got {type(shape).__name__}") from None
    if any(d < 0 for d in dims):
        raise ShapeMismatchError(f"{arg} must hold non-negative sizes, got {dims}")
    return dims


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _f32_ratio(original: int, compressed: int) -> float:
    """The seeds' ``original as f32 / compressed as f32`` (1.0 when nothing is held)."""
    if compressed == 0:
        return 1.0
    return float(np.float32(original) / np.float32(compressed))


@dataclass(frozen=True, eq=False, repr=False)
class BlockwiseQuantized:
    """Blockwise 8-bit codes with one scale per block (SPEC §1, seed 000).

    Attributes:
        data: int8 codes of the flattened input, length ``n``.
        scales: float16 (default) or float32 scales, one per block of ``block_size``.
        shape: the original shape.
        block_size: elements per block (the last block may be shorter).
    """

    data: np.ndarray
    scales: np.ndarray
    shape: Tuple[int, ...]
    block_size: int

    scheme: ClassVar[str] = "blockwise8"

    def __post_init__(self) -> None:
        shape = _shape_tuple(self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "block_size", positive_int(self.block_size, "block_size"))
        n = math.prod(shape)
        if not isinstance(self.data, np.ndarray) or self.data.dtype != np.int8:
            raise TypeError(f"data must be an int8 array, got {_describe(self.data)}")
        if not isinstance(self.scales, np.ndarray) or self.scales.dtype not in (
            np.float16,
            np.float32,
        ):
            raise TypeError(
                f"scales must be a float16 or float32 array, got {_describe(self.scales)}"
            )
        if self.data.shape != (n,):
            raise ShapeMismatchError(
                f"data: expected shape ({n},) for shape {shape}, got {self.data.shape}"
            )
        nb = -(-n // self.block_size)
        if self.scales.shape != (nb,):
            raise ShapeMismatchError(
                f"scales: expected shape ({nb},) for {n} elements in blocks of "
                f"{self.block_size}, got {self.scales.shape}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes actually held: codes plus scales."""
        return int(self.data.nbytes + self.scales.nbytes)

    @property
    def scale_dtype(self) -> np.dtype:
        """The dtype of the stored scales (float16 or float32)."""
        return self.scales.dtype

    def size_bytes(self) -> int:
        """Compressed size: ``n`` code bytes + 2 (or 4) bytes a scale."""
        return int(self.data.size + self.scales.size * self.scales.itemsize)

    def original_size_bytes(self) -> int:
        """Size of the input as float32: ``4 n``."""
        return int(self.data.size * 4)

    def compression_ratio(self) -> float:
        """``original_size_bytes() / size_bytes()``, computed in f32 as the seed does."""
        return _f32_ratio(self.original_size_bytes(), self.size_bytes())

    def dequantize(self) -> np.ndarray:
        """The float32 reconstruction in the original shape (see ``dequantize_blockwise``)."""
        from .functional import dequantize_blockwise

        return dequantize_blockwise(self)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, BlockwiseQuantized)
        return (
            self.shape == other.shape
            and self.block_size == other.block_size
            and _arrays_equal(self.data, other.data)
            and _arrays_equal(self.scales, other.scales)
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal by value, not hashable

    def __repr__(self) -> str:
        return (
            f"BlockwiseQuantized(shape={self.shape}, scheme={self.scheme!r}, "
            f"block_size={self.block_size}, scale_dtype={self.scales.dtype.name}, "
            f"ratio={self.compression_ratio():.2f}x)"
        )

    # -- serialization hooks (see ferroquant.serialization) -------------------------

    def _record(self) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
        """Arrays and JSON-able parameters that describe this value completely."""
        return (
            {"data": self.data, "scales": self.scales},
            {"shape": list(self.shape), "dtype": "float32", "block_size": self.block_size},
        )

    @classmethod
    def _from_record(
        cls, arrays: Mapping[str, np.ndarray], params: Mapping[str, Any]
    ) -> BlockwiseQuantized:
        """Rebuild from ``_record`` output read from untrusted bytes (raises FormatError)."""
        try:
            shape = params["shape"]
            block_size = params["block_size"]
            if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) for d in shape
            ):
                raise FormatError(f"shape must be a list of integers, got {shape!r}")
            if not isinstance(block_size, int) or isinstance(block_size, bool):
                raise FormatError(f"block_size must be an integer, got {block_size!r}")
            q = cls(
                data=arrays["data"],
                scales=arrays["scales"],
                shape=tuple(shape),
                block_size=block_size,
            )
        except KeyError as e:
            raise FormatError(f"blockwise8 entry lacks {e}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise FormatError(f"inconsistent blockwise8 entry: {e}") from None
        s = q.scales
        if s.size and not (np.isfinite(s).all() and (s >= 0).all()):
            raise FormatError("blockwise8 scales must be finite and non-negative")
        return q

    def to_bytes(self) -> bytes:
        """Serialize to safetensors bytes (see :func:`ferroquant.save`)."""
        from .serialization import to_bytes

        return to_bytes(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockwiseQuantized:
        """Inverse of :meth:`to_bytes`; raises FormatError on bad bytes."""
        from .serialization import from_bytes

        value = from_bytes(data)
        if not isinstance(value, cls):
            raise FormatError(f"bytes hold a {type(value).__name__}, not a {cls.__name__}")
        return value


def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"array of dtype {x.dtype}"
    return type(x).__name__
