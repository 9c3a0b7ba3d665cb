"""W8A8 integer products (SPEC §3): seed 002's ``w8a8_matvec`` and its batched form.

The activation is quantized to int8 with the dynamic MaxAbs kernel (one scale for a
vector, one per row of a batch); each output is the exact integer dot product with an
int8 weight row, rescaled as ``acc · w_scale · a_scale`` in float32, left to right.
The integer sum is exact for any length (the seed's i32 wraps past ~133,000
products); AVX-512 VNNI's ``vpdpbusd`` computes it where the CPU has it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _ferroquant as _native
from ._checks import beyond_f32, describe, float_input, to_float32
from .errors import EmptyInputError, NonFiniteError, ShapeMismatchError

__all__ = ["w8a8_matmul", "w8a8_matvec"]


def _int8(weight_i8: Any) -> None:
    """TypeError naming ``weight_i8`` unless it is an int8 array."""
    if not isinstance(weight_i8, np.ndarray) or weight_i8.dtype != np.int8:
        raise TypeError(f"weight_i8 must be an int8 array, got {describe(weight_i8)}")


def _weight(weight_i8: np.ndarray) -> np.ndarray:
    """The int8 weight as a C-order 2-D array, or ShapeMismatchError naming
    ``weight_i8``. A weight already in C order is used in place."""
    if weight_i8.ndim != 2:
        raise ShapeMismatchError(
            f"weight_i8: expected a 2-D array (out_features, in_features), got shape "
            f"{weight_i8.shape}"
        )
    return weight_i8 if weight_i8.flags.c_contiguous else np.ascontiguousarray(weight_i8)


def _scales(s: np.ndarray, out_f: int) -> np.ndarray:
    """The scales (``float_input``'s array) as float32, one per output row, or
    ShapeMismatchError. Any float dtype, byte order or layout is read through one
    float32 copy (values rounded to float32, as the kernel multiplies in float32);
    float32 in C order is used in place."""
    if s.shape != (out_f,):
        raise ShapeMismatchError(
            f"weight_scales: expected shape ({out_f},) (one scale per output row), got {s.shape}"
        )
    return to_float32(s)


def _non_finite(e: NonFiniteError, x_arg: str, x: np.ndarray, s: np.ndarray) -> NonFiniteError:
    """``e``, saying "beyond float32's range" when the float64 value it names (of the
    activation or of the scales, whichever ``e`` is about) is finite."""
    return beyond_f32(beyond_f32(e, x, only=x_arg), s, only="weight_scales")


def w8a8_matvec(weight_i8: Any, weight_scales: Any, activation: Any) -> np.ndarray:
    """``float32[out]``: ``weight_i8 [out, in]`` (int8) times ``activation [in]``
    quantized per tensor, each output ``acc · weight_scales[o] · a_scale``.

    Raises:
        EmptyInputError: ``activation`` is empty.
        ShapeMismatchError: ``activation`` is not 1-D of length ``in``, ``weight_i8`` is
            not 2-D, or ``weight_scales`` is not ``(out,)``.
        TypeError: ``weight_i8`` is not int8, or ``weight_scales`` or ``activation``
            is not a floating array (float32, float64, float16 or bfloat16: any is
            read as float32).
        NonFiniteError: ``activation`` or ``weight_scales`` holds NaN or an infinity.
    """
    # Every argument's type is checked before the empty activation is named, and
    # that before any shape, as in the seed.
    x = float_input(activation, "activation")
    _int8(weight_i8)
    given = float_input(weight_scales, "weight_scales")
    if x.size == 0:
        raise EmptyInputError("activation is empty: expected at least one element")
    w = _weight(weight_i8)
    out_f, in_f = w.shape
    if x.ndim != 1 or x.shape[0] != in_f:
        raise ShapeMismatchError(
            f"activation: expected shape ({in_f},) (in_features), got {x.shape}"
        )
    s = _scales(given, out_f)
    try:
        return _native.w8a8_product(w, out_f, in_f, s, x, None)
    except NonFiniteError as e:
        raise _non_finite(e, "activation", x, given) from None


def w8a8_matmul(weight_i8: Any, weight_scales: Any, activations: Any) -> np.ndarray:
    """``float32[tokens, out]``: ``weight_i8 [out, in]`` (int8) times each row of
    ``activations [tokens, in]`` quantized with its own scale,
    ``acc · weight_scales[o] · a_scale[t]``. Zero tokens give a ``(0, out)`` result.

    Each panel of weight rows is read from memory once for a block of tokens.

    Raises:
        EmptyInputError: ``in_features`` is 0.
        ShapeMismatchError: ``activations`` is not 2-D with ``in`` columns, or as
            :func:`w8a8_matvec` for the weight.
        TypeError / NonFiniteError: as :func:`w8a8_matvec`.
    """
    x = float_input(activations, "activations")
    _int8(weight_i8)
    given = float_input(weight_scales, "weight_scales")
    w = _weight(weight_i8)
    out_f, in_f = w.shape
    if in_f == 0:
        raise EmptyInputError("activations are empty: in_features is 0")
    if x.ndim != 2 or x.shape[1] != in_f:
        raise ShapeMismatchError(f"activations: expected shape (tokens, {in_f}), got {x.shape}")
    s = _scales(given, out_f)
    tokens = x.shape[0]
    try:
        flat = _native.w8a8_product(w, out_f, in_f, s, x, tokens)
    except NonFiniteError as e:
        raise _non_finite(e, "activations", x, given) from None
    return flat.reshape(tokens, out_f)
