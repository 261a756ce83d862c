"""Question-guided rules: recompute the chunk tokens the question attends to most.

A3 looks at a shallow layer (eq. 3: attention of the question's tokens to each document token at
layer 1, summed); FusionRAG's query-guided selection looks at the last layer (column sums of the
question's attention weights, top-k across all chunks). Both probe only the question tokens over
the reused cache, so their cost is one partial question prefill.
"""

from __future__ import annotations

import torch

from kvrag.methods.base import ScoredMethod, SelectContext, Selection
from kvrag.fuse.probe import attention_probs, probe, resolve_layer


class QuestionAttention(ScoredMethod):
    """Score = the question's softmax attention to each chunk token at `layer`, summed over heads and question tokens.

    `whole_chunks=N` (opt-in) also recomputes, whole, the N chunks the question attends to most (their
    scores summed). Why: where the documents are records of one kind ("the weight of the X lamp is
    ..." six times over), reused chunks cannot tell the records apart and the answer comes from the
    wrong one; recomputing the two most-attended records whole (plus the top tokens) contained the
    answer in 9 and 11 of 30 such questions against Full Attention's 10 and 11, where fusionrag at
    r = 0.5 (more tokens) got 8 and 10 (README, Results). Costs those chunks' tokens on every request.
    """

    default_layer = 1

    def __init__(self, layer: int | None = None, whole_chunks: int = 0) -> None:
        if not isinstance(whole_chunks, int) or whole_chunks < 0:
            raise ValueError(f"whole_chunks must be a whole number >= 0, got {whole_chunks!r}")
        self.layer = self.default_layer if layer is None else layer
        self.whole_chunks = whole_chunks

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        picked = super().select(ctx, budget)
        if self.whole_chunks == 0 or budget <= 0:
            return picked
        scores = picked.scores  # dense by global position, -inf off the candidates; None: every candidate picked
        if scores is None:
            return picked
        per_chunk = []
        for start, end in ctx.spans:
            inside = scores[start:end]
            inside = inside[torch.isfinite(inside)]
            if inside.numel():
                per_chunk.append((float(inside.sum()), start, end))
        keep = torch.zeros(scores.shape[0], dtype=torch.bool)
        keep[picked.positions] = True
        for _, start, end in sorted(per_chunk, reverse=True)[: self.whole_chunks]:
            keep[start:end] = True
        keep &= torch.isfinite(scores)  # candidates only (never an exact chunk, a link slot or the prefix)
        return Selection(keep.nonzero().flatten(), scores)

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
