"""The name -> method registry, apart from the methods themselves so a composing method can look
others up without importing the package that registers it."""

from __future__ import annotations

import inspect
from typing import Any

from kvrag.methods.base import Method

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Add a method under its `name` (third-party rules can register too)."""
    METHODS[cls.name] = cls
    return cls


def get_method(name: str | Method, **params: Any) -> Method:
    """A method instance from a name (`"a3"`, or `"kvlink+a3"`: a composing method over a rule) and its parameters."""
    if isinstance(name, Method):
        if params:
            raise TypeError("method parameters go to the method's constructor when passing an instance")
        return name
    if not isinstance(name, str):
        raise TypeError(f"method must be a name or a Method, got {type(name).__name__}")
    head, plus, inner = name.partition("+")
    if plus and head in METHODS:  # "kvlink+a3": a composing method over a selection rule
        return _build(head, select=inner, **params)
    return _build(name, **params)


def _build(name: str, **params: Any) -> Method:
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}") from None
    try:
        return cls(**params)
    except TypeError as exc:  # diagnosed here, off the per-request path
        unknown = _unknown_params(cls, params)
        if unknown:
            own = _own_params(cls)
            raise TypeError(
                f"method {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                + (f"its parameters: {', '.join(own)}" if own else "it takes none")
            ) from None
        raise TypeError(f"method {name!r}: {exc}") from None


def _own_params(cls: type[Method]) -> list[str]:
    """The named keyword parameters of a method's constructor."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(cls).parameters.values() if p.kind in kinds]


def _unknown_params(cls: type[Method], params: dict[str, Any]) -> list[str]:
    """Parameters the constructor cannot take (none where it passes extra ones on, as kvlink does to
    its selection rule, which then names them itself)."""
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(cls).parameters.values()):
        return []
    return sorted(set(params) - set(_own_params(cls)))
