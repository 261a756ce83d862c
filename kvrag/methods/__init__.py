"""Method registry: name -> selection rule."""

from __future__ import annotations

from kvrag.methods.attention import A3, FusionRAG
from kvrag.methods.base import LinkSlots, Method, PrepareContext, ScoredMethod, SelectContext, Selection, token_budget
from kvrag.methods.baselines import FullAttention, FullReuse
from kvrag.methods.cacheblend import CacheBlend
from kvrag.methods.epic import Epic
from kvrag.methods.kvlink import KVLink
from kvrag.methods.registry import METHODS, get_method, register
from kvrag.methods.samkv import SamKV

for _cls in (FullAttention, FullReuse, CacheBlend, Epic, A3, FusionRAG, SamKV, KVLink):
    register(_cls)


__all__ = [
    "METHODS",
    "LinkSlots",
    "Method",
    "PrepareContext",
    "ScoredMethod",
    "SelectContext",
    "Selection",
    "get_method",
    "register",
    "token_budget",
]
