"""Method registry: name -> selection rule."""

from __future__ import annotations

from typing import Any

from kvrag.methods.base import Method, SelectContext, token_budget
from kvrag.methods.baselines import FullAttention, FullReuse

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


for _cls in (FullAttention, FullReuse):
    register(_cls)


def get_method(name: str | Method, **params: Any) -> Method:
    if isinstance(name, Method):
        return name
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}") from None
    return cls(**params)


__all__ = ["METHODS", "Method", "SelectContext", "get_method", "register", "token_budget"]
