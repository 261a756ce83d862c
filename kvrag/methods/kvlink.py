"""KVLink: K link tokens after every cached chunk, computed in the shared recompute pass.

The method itself is a selection rule like the others (by default none: `select="reuse"`) plus a
number of link tokens; `prepare` adds the link slots to the layout, and the one recompute pass
computes them with KVLink's attention picture (`kvrag.fuse.links`). Composing: `select="a3"` (or
`method="kvlink+a3"`) recomputes the a3-chosen chunk tokens in the same pass (those tokens attend
causally to everything before them, as recomputation does), and `select="samkv"` keeps SamKV's
sparse cache, in which link slots are always kept. The budget counts chunk tokens only.
"""

from __future__ import annotations

from typing import Any

from kvrag.defaults import link_scope
from kvrag.link_adapter import resolve_link_rows
from kvrag.methods.base import LinkSlots, Method, PrepareContext, SelectContext, Selection
from kvrag.methods.registry import get_method


class KVLink(Method):
    """KVLink: trainable link tokens joining separately cached chunks (+ an optional selection rule)."""

    name = "kvlink"

    def __init__(self, link_tokens: int | None = None, select: str | Method = "reuse", **select_params: Any) -> None:
        if link_tokens is not None and int(link_tokens) < 0:
            raise ValueError(f"link_tokens must be >= 0, got {link_tokens}")
        self.link_tokens = None if link_tokens is None else int(link_tokens)
        self.inner = get_method(select, **select_params)
        if self.inner.full_attention or isinstance(self.inner, KVLink):
            raise ValueError(f"kvlink composes with a selection rule, not with {self.inner.name!r}")
        self.update = self.inner.update
        self.probed_layers_only = self.inner.probed_layers_only  # type: ignore[misc]  # as its rule reads

    def prepare(self, ctx: PrepareContext) -> LinkSlots:
        adapter = ctx.link_adapter()
        k, embeds = resolve_link_rows(ctx.lm, adapter, self.link_tokens, ctx.n_chunks, ctx.default_links)
        return LinkSlots(k, embeds, link_scope(adapter.mode if adapter is not None else None))

    def keep(self, ctx: SelectContext) -> Selection | None:
        return self.inner.keep(ctx)

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        return self.inner.select(ctx, budget)
