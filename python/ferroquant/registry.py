"""The Quantizer protocol and the registry of named quantizers (SPEC §6)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Protocol, Set, runtime_checkable

import numpy as np

__all__ = ["Quantizer", "get_quantizer", "list_quantizers", "register_quantizer"]


@runtime_checkable
class Quantizer(Protocol):
    """Anything with a ``name`` that quantizes an array and dequantizes the result."""

    @property
    def name(self) -> str:
        """The registry name of the scheme (read-only; a plain attribute satisfies it)."""
        ...

    def quantize(self, x: np.ndarray) -> Any:
        """Quantize ``x`` into a frozen result dataclass."""
        ...

    def dequantize(self, q: Any) -> np.ndarray:
        """Reconstruct an array from a result of :meth:`quantize`."""
        ...


_REGISTRY: Dict[str, Callable[..., Quantizer]] = {}


def register_quantizer(
    name: str, factory: Callable[..., Quantizer], *, replace: bool = False
) -> None:
    """Register ``factory`` (called with the parameters of :func:`get_quantizer`) as ``name``.

    Raises:
        TypeError: ``name`` is not a non-empty str, ``factory`` is not callable or
            ``replace`` is not a bool.
        ValueError: ``name`` is taken and ``replace`` is false.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(replace, (bool, np.bool_)):
        # Not read by truthiness: replace="no" must not overwrite a built-in.
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"a quantizer named {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = factory


def registry_factory(name: str) -> Callable[..., Quantizer]:
    """The factory registered as ``name`` (KeyError listing the known names)."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(
            f"unknown quantizer {name!r}; known: {', '.join(list_quantizers())}"
        ) from None


def get_quantizer(name: str, /, **params: Any) -> Quantizer:
    """Build the quantizer registered as ``name``: ``factory(**params)``.

    Raises:
        KeyError: no quantizer has that name (the message lists the known ones).
        TypeError: the factory refused the parameters (one it does not take is
            named), or built something that is not a :class:`Quantizer` (no
            ``name``, ``quantize`` or ``dequantize``).
    """
    factory = registry_factory(name)
    try:
        q = factory(**params)
    except TypeError:
        # The factory refused the call: if its signature shows a parameter it does
        # not take, say so naming the scheme (its own message names an inner
        # function, `_affine_factory.<locals>.factory()`); else its error as it is.
        accepted = factory_parameters(factory)
        unknown = sorted(set(params) - accepted) if accepted is not None else []
        if not unknown:
            raise
        takes = ", ".join(sorted(accepted or ())) or "none"
        raise TypeError(
            f"quantizer {name!r} takes no parameter {unknown[0]!r} (its parameters: {takes})"
        ) from None
    if not isinstance(q, Quantizer):
        raise TypeError(
            f"quantizer {name!r}: its factory returned a {type(q).__name__}, not a "
            "Quantizer (name, quantize(x), dequantize(q))"
        )
    return q


def factory_parameters(factory: Any) -> Optional[Set[str]]:
    """The keyword parameters ``factory`` takes, or None if it takes ``**kwargs`` or
    its signature cannot be read. The signature is the callable's own, not that of
    a function it wraps (a decorator's wrapper may take keywords of its own)."""
    try:
        sig = inspect.signature(factory, follow_wrapped=False)
    except Exception:  # a broken __signature__ of a user's factory: unknown
        return None
    names = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names


def list_quantizers() -> List[str]:
    """Names of all registered quantizers, in registration order."""
    return list(_REGISTRY)
