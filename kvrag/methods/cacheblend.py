"""CacheBlend: recompute the tokens whose KV deviates most from a real recompute at an early layer.

All candidate chunk tokens are recomputed (probed) through `layer` (default 1, the paper's second
layer); the deviation of the reused values (CacheBlend's reference) or keys (LMCache's variant)
from the recomputed ones ranks the tokens.

Gradual filtering (`gradual=True`, CacheBlend §4.3): the first probe keeps `start` times the
budget, and each next layer's probe recomputes only those, ranks them by that layer's deviation,
and keeps fewer, down to the budget at the last filtering layer. Deviation at a deeper layer, measured
with the other high-deviation tokens already corrected, separates the tokens that matter better
than one shallow look.
"""

from __future__ import annotations

import math

import torch

from kvrag.methods.base import ScoredMethod, SelectContext, Selection
from kvrag.model.loading import decoder_of
from kvrag.fuse.probe import probe, resolve_layer


class CacheBlend(ScoredMethod):
    """CacheBlend: largest KV deviation at layer 1 between the reused cache and a real recompute."""

    name = "cacheblend"
    probed_layers_only = True  # the layers it just probed

    def __init__(self, layer: int = 1, deviation: str = "value", gradual: bool = False, start: float = 3.0, steps: int = 2) -> None:
        if deviation not in ("value", "key"):
            raise ValueError("deviation must be 'value' (CacheBlend reference) or 'key' (LMCache)")
        if start < 1 or steps < 1:
            raise ValueError("gradual filtering needs start >= 1 and steps >= 1")
        self.layer = layer
        self.deviation = deviation
        self.gradual = bool(gradual) if not isinstance(gradual, str) else gradual.lower() in ("1", "true", "yes")
        self.start = float(start)
        self.steps = int(steps)

    def deviations(self, ctx: SelectContext, positions: torch.Tensor, layer: int) -> torch.Tensor:
        """Squared deviation at `layer` of each of `positions`, with all of them recomputed."""
        result = probe(ctx.lm, ctx.rotary, ctx.stitched, [layer], recompute=positions, queries=False)
        fresh = result.values[layer] if self.deviation == "value" else result.keys[layer]
        reused = ctx.stitched.values[layer] if self.deviation == "value" else ctx.stitched.keys[layer]
        idx = ctx.stitched.slots_of(positions).to(fresh.device)
        diff = fresh[:, idx].float() - reused[:, idx].to(fresh.device).float()
        return diff.pow(2).sum(dim=(0, 2))

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        return self.deviations(ctx, ctx.candidates(), resolve_layer(ctx.lm, self.layer))

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        candidates = ctx.candidates()
        if not self.gradual or budget <= 0 or budget >= candidates.numel():
            return super().select(ctx, budget)
        first = resolve_layer(ctx.lm, self.layer)
        last_layer = len(decoder_of(ctx.lm.model).layers) - 1
        layers = [min(first + i, last_layer) for i in range(self.steps)]
        n = candidates.numel()
        top_size = min(n, max(budget, int(math.ceil(self.start * budget))))
        # sizes shrink geometrically from start x budget at the first layer to the budget at the last
        sizes = [int(round(top_size * (budget / top_size) ** (i / max(1, self.steps - 1)))) for i in range(self.steps)]
        sizes[-1] = budget
        keep = candidates
        scores = torch.zeros(0)
        for layer, size in zip(layers, sizes):
            scores = self.deviations(ctx, keep, layer).float().cpu()
            top = torch.topk(scores, min(size, keep.numel())).indices
            keep, scores = keep[top], scores[top]
            order = keep.argsort()
            keep, scores = keep[order], scores[order]
        dense = torch.full((ctx.stitched.segments.context_len,), float("-inf"))
        dense[keep] = scores
        return Selection(keep, dense)
