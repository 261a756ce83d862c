"""CacheBlend: recompute the tokens whose KV deviates most from a real recompute at an early layer.

All chunk tokens are recomputed (probed) through `layer` (default 1, the paper's second layer);
the deviation of the reused values (CacheBlend's reference) or keys (LMCache's variant) from
the recomputed ones ranks the tokens.
"""

from __future__ import annotations

import torch

from kvrag.methods.base import ScoredMethod, SelectContext
from kvrag.probe import probe, resolve_layer


class CacheBlend(ScoredMethod):
    """CacheBlend: largest KV deviation at layer 1 between the reused cache and a real recompute."""

    name = "cacheblend"

    def __init__(self, layer: int = 1, deviation: str = "value") -> None:
        if deviation not in ("value", "key"):
            raise ValueError("deviation must be 'value' (CacheBlend reference) or 'key' (LMCache)")
        self.layer = layer
        self.deviation = deviation

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        layer = resolve_layer(ctx.lm, self.layer)
        positions = ctx.candidates()
        result = probe(ctx.lm, ctx.rotary, ctx.stitched, [layer], recompute=positions)
        fresh = result.values[layer] if self.deviation == "value" else result.keys[layer]
        reused = ctx.stitched.values[layer] if self.deviation == "value" else ctx.stitched.keys[layer]
        idx = ctx.stitched.slots_of(positions).to(fresh.device)
        diff = fresh[:, idx].float() - reused[:, idx].to(fresh.device).float()
        return diff.pow(2).sum(dim=(0, 2))
