"""The two ends every figure is measured between: Full Attention and Full Reuse."""

from __future__ import annotations

import torch

from kvrag.methods.base import Method, SelectContext


class FullAttention(Method):
    """Full Attention: no reuse; every chunk token is prefilled (the baseline)."""

    name = "full"
    full_attention = True

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        return ctx.stitched.chunk_positions()


class FullReuse(Method):
    """Full Reuse (TurboRAG / PIE / KVLink-0): stored KV re-rotated, nothing recomputed."""

    name = "reuse"

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long)
