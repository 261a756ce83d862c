"""Question-guided rules: recompute the chunk tokens the question attends to most.

A3 looks at a shallow layer (eq. 3: attention of the question's tokens to each document token at
layer 1, summed); FusionRAG's query-guided selection looks at the last layer (column sums of the
question's attention weights, top-k across all chunks). Both probe only the question tokens over
the reused cache, so their cost is one partial question prefill.
"""

from __future__ import annotations

import torch

from kvrag.methods.alike import named_by
from kvrag.methods.base import ScoredMethod, SelectContext, Selection
from kvrag.fuse.probe import attention_probs, probe, resolve_layer


class QuestionAttention(ScoredMethod):
    """Score = the question's softmax attention to each chunk token at `layer`, summed over heads and question tokens.

    `whole_chunks=N` (opt-in) also makes exact, by recomputing them whole, the N chunks the question
    names (the rarest of its words they hold, kvrag.methods.alike.named_by), then those it attends to
    most (the first chunk is exact already and is not recomputed). Why: where the documents are
    records of one kind ("the weight of the X lamp is ..." six times over), reused chunks cannot tell
    the records apart and the answer comes from another record. Those the default policy reads whole
    (AnswerOptions.records_whole); this is the faster middle way for who turns that off. On 120
    answers over fresh six- and eight-record questions (docs/bench/records): one named record contained
    the answer in 27 against Full's 33 and the plain rule's 22; two in 23 (the second competes);
    ranked by summed attention alone the two chosen were the two nearest the question for 30
    questions of 30, whichever was asked about. `stats.whole_chunks` says how many were recomputed.
    """

    default_layer = 1

    def __init__(self, layer: int | None = None, whole_chunks: int = 0) -> None:
        if isinstance(whole_chunks, bool) or not isinstance(whole_chunks, int) or whole_chunks < 0:
            raise ValueError(f"whole_chunks must be a whole number >= 0, got {whole_chunks!r}")
        self.layer = self.default_layer if layer is None else layer
        self.whole_chunks = whole_chunks

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        picked = super().select(ctx, budget)
        scores = picked.scores  # dense by global position, -inf off the candidates; None: every candidate picked
        if scores is None or budget <= 0 or self.whole_chunks == 0:
            return picked
        decode = ctx.lm.tokenizer.decode
        texts = [decode(list(ids)) for ids in ctx.stitched.segments.chunks]
        # ranked by the question's words that single a chunk out (the record it names), then by attention
        # (summed attention alone favours the chunks nearest the question, whichever record is asked
        # about); the exact first chunk takes its place in the ranking but needs no recompute
        named = named_by(decode(list(ctx.stitched.segments.question)), texts)
        ranked = []
        for i, (start, end) in enumerate(ctx.stitched.chunk_spans):
            inside = scores[start:end]
            inside = inside[torch.isfinite(inside)]
            attended = float(inside.sum()) if inside.numel() else float("-inf")
            ranked.append((named[i], attended, i >= ctx.exact_chunks and inside.numel() > 0, start, end))
        keep = torch.zeros(scores.shape[0], dtype=torch.bool)
        keep[picked.positions] = True
        top = [(start, end) for _, _, recompute, start, end in sorted(ranked, reverse=True)[: self.whole_chunks] if recompute]
        for start, end in top:
            keep[start:end] = True
        keep &= torch.isfinite(scores)  # candidates only (never an exact chunk, a link slot or the prefix)
        return Selection(keep.nonzero().flatten(), scores, whole_chunks=len(top))

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
