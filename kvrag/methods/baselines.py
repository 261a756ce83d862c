"""The two ends every figure is measured between: Full Attention and Full Reuse."""

from __future__ import annotations

from kvrag.methods.base import Method, SelectContext, Selection

class FullAttention(Method):
    """Full Attention: no reuse; every chunk token is prefilled (the baseline)."""

    name = "full"
    full_attention = True

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        return Selection(ctx.candidates())

class FullReuse(Method):
    """Full Reuse (TurboRAG / PIE / KVLink-0): stored KV re-rotated, nothing recomputed."""

    name = "reuse"
    probed_layers_only = True  # reads no KV

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        return Selection.empty()
