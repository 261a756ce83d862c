"""Question-guided rules: recompute the chunk tokens the question attends to most.

A3 looks at a shallow layer (eq. 3: attention of the question's tokens to each document token at
layer 1, summed); FusionRAG's query-guided selection looks at the last layer (column sums of the
question's attention weights, top-k across all chunks). Both probe only the question tokens over
the reused cache, so their cost is one partial question prefill.
"""

from __future__ import annotations

import torch

from kvrag.methods.base import ScoredMethod, SelectContext
from kvrag.fuse.probe import attention_probs, probe, resolve_layer


class QuestionAttention(ScoredMethod):
    """Score = the question's softmax attention to each chunk token at `layer`, summed over heads and question tokens."""

    default_layer = 1

    def __init__(self, layer: int | None = None) -> None:
        self.layer = self.default_layer if layer is None else layer

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        layer = resolve_layer(ctx.lm, self.layer)
        result = probe(ctx.lm, ctx.rotary, ctx.stitched, [layer])
        probs = attention_probs(result, layer)  # [heads, question tokens, total]
        per_token = probs.sum(dim=(0, 1))
        slots = ctx.stitched.slots_of(ctx.candidates())
        return per_token[slots.to(per_token.device)]


class A3(QuestionAttention):
    """A3: tokens the question attends to most at a shallow layer (layer 1)."""

    name = "a3"
    probed_layers_only = True  # probes only
    default_layer = 1


class FusionRAG(QuestionAttention):
    """FusionRAG query-guided selection: question attention at the last layer, top-k across chunks."""

    name = "fusionrag"
    probed_layers_only = True  # probes only
    default_layer = -1
