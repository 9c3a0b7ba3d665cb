"""The exception and warning classes of ferroquant.

Every error a kernel reports derives from :class:`QuantizationError`, itself a
``ValueError``, so ``except ValueError`` keeps working for callers who do not
care which check failed. Wrong *types* (an int8 array where floats belong)
raise the built-in ``TypeError`` instead.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "EmptyInputError",
    "FormatError",
    "InvalidConfigError",
    "NonFiniteError",
    "PrecisionWarning",
    "QuantizationError",
    "ShapeMismatchError",
]


class QuantizationError(ValueError):
    """Base class of every ferroquant error."""


class ShapeMismatchError(QuantizationError):
    """Two arguments' shapes or lengths do not agree."""


class EmptyInputError(QuantizationError):
    """An argument that needs at least one element is empty."""


class InvalidConfigError(QuantizationError):
    """A configuration parameter is out of its domain."""


class NonFiniteError(QuantizationError):
    """The input holds NaN or an infinity.

    Attributes:
        index: flat (C-order) index of the first non-finite element, if known.
    """

    def __init__(self, message: str, index: Optional[int] = None) -> None:
        super().__init__(message)
        self.index = index

    def __reduce__(self):  # keep `index` across pickling (multiprocessing)
        return (type(self), (str(self), self.index))


class FormatError(QuantizationError):
    """Serialized data (a file or bytes) is malformed, corrupt or inconsistent."""


class PrecisionWarning(UserWarning):
    """A result was computed, but some of its precision was lost (e.g. f16 scales)."""
