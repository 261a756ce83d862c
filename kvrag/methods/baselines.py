"""The two ends every figure is measured between: Full Attention and Full Reuse."""

from __future__ import annotations

import torch

from kvrag.methods.base import Method, SelectContext


class FullAttention(Method):
    """No reuse: every chunk token is prefilled (only the fixed system prefix comes from cache)."""

    name = "full"
    full_attention = True

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        return ctx.stitched.chunk_positions()


class FullReuse(Method):
    """TurboRAG / PIE / KVLink-0: stored KV re-rotated to global positions, nothing recomputed."""

    name = "reuse"

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)
