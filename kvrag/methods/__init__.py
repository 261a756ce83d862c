"""Method registry: name -> selection rule."""

from __future__ import annotations

from typing import Any

from kvrag.methods.attention import A3, FusionRAG
from kvrag.methods.base import Method, ScoredMethod, SelectContext, token_budget
from kvrag.methods.baselines import FullAttention, FullReuse
from kvrag.methods.cacheblend import CacheBlend
from kvrag.methods.epic import Epic
from kvrag.methods.kvlink import KVLink
from kvrag.methods.samkv import SamKV

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Add a method under its `name` (third-party rules can register too)."""
    METHODS[cls.name] = cls
    return cls


for _cls in (FullAttention, FullReuse, CacheBlend, Epic, A3, FusionRAG, SamKV, KVLink):
    register(_cls)


def get_method(name: str | Method, **params: Any) -> Method:
    if isinstance(name, Method):
        if params:
            raise TypeError("method parameters go to the method's constructor when passing an instance")
        return name
    if isinstance(name, str) and name.startswith(KVLink.name + "+"):  # "kvlink+a3": KVLink over a selection rule
        return KVLink(select=name[len(KVLink.name) + 1 :], **params)
    try:
        cls = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(sorted(METHODS))}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise TypeError(f"method {name!r}: {exc}") from None


__all__ = ["METHODS", "Method", "ScoredMethod", "SelectContext", "get_method", "register", "token_budget"]
