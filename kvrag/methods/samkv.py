"""SamKV: sparsify the multi-context KV, then recompute a subset of what is kept.

1. Personalised query vectors (eq. 1): the question is prefilled over only the initial and local
   blocks of every chunk (the local blocks' own tokens recomputed alongside, for their queries);
   the mean-pooled question query Q_que, plus the |cos|-weighted local queries of the *other*
   chunks, gives each chunk its own query Q̂_i, per stable layer.
2. Block selection (eq. 2-3): block-level keys (mean over a block's tokens); initial and local
   blocks always kept; per stable layer, the anchor (initial+local) score against the best and
   worst middle block gives P_i^(n); P_i is their mean; each chunk proposes its top P_i middle
   blocks; scores are min-max normalised per chunk and the best (total middle blocks / chunks)
   are kept across chunks.
3. Recompute (eq. 4): the top kept chunk tokens by Q̂ score are recomputed over the sparse cache,
   with `overwrite` or cosine `fusion` updates; the question is prefilled afresh over the result
   in the same pass. Positions stay global, so the sparse cache decodes as is.

Stable layers: the paper profiles the last 4-5 layers of Llama-3.1-8B, Mistral-7B and
Qwen2.5-3B; for other models the default is the last max(1, layers // 8) layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvrag.model.masks import question_attention
from kvrag.methods.base import ScoredMethod, SelectContext, Selection
from kvrag.model.loading import decoder_of
from kvrag.fuse.probe import probe, resolve_layer


def dynamic_top_p_tensor(s_anchor: torch.Tensor, s_max: torch.Tensor, s_min: torch.Tensor) -> torch.Tensor:
    """`dynamic_top_p` on device scalars, without bringing them to the host."""
    ok = (s_min < s_anchor) & (s_anchor <= s_max) & (s_max > s_min)
    return torch.where(ok, (s_max - s_anchor) / (s_max - s_min).clamp_min(1e-30), torch.zeros_like(s_anchor))


def dynamic_top_p(s_anchor: float, s_max: float, s_min: float) -> float:
    """SamKV eq. 2: the share of middle blocks above the anchor; 0 unless s_min < s_anchor <= s_max."""
    if not (s_min < s_anchor <= s_max) or s_max <= s_min:
        return 0.0
    return (s_max - s_anchor) / (s_max - s_min)


@dataclass
class Blocks:
    """Block layout of one chunk: global position ranges, which are anchors (initial/local)."""

    ranges: list[tuple[int, int]]
    anchor: list[bool]

    @property
    def middle(self) -> list[int]:
        return [b for b, a in enumerate(self.anchor) if not a]

    def positions(self, blocks: list[int]) -> list[int]:
        return [p for b in blocks for p in range(*self.ranges[b])]


def chunk_blocks(start: int, end: int, size: int, initial: int, local: int) -> Blocks:
    ranges = [(s, min(s + size, end)) for s in range(start, end, size)]
    n = len(ranges)
    anchor = [b < initial or b >= n - local for b in range(n)]
    return Blocks(ranges, anchor)


class SamKV(ScoredMethod):
    """SamKV: keep ~15% of the chunk KV (anchor blocks + dynamic top-P blocks), recompute a subset."""

    name = "samkv"

    def __init__(
        self,
        block_size: int | str = "auto",
        initial_blocks: int = 1,
        local_blocks: int = 2,
        stable_layers: list[int] | None = None,
        update: str = "overwrite",
        sparsify: bool = True,
    ) -> None:
        if update not in ("overwrite", "fusion"):
            raise ValueError("update must be 'overwrite' or 'fusion'")
        self.block_size = block_size
        self.initial_blocks = initial_blocks
        self.local_blocks = local_blocks
        self.stable_layers = stable_layers
        self.update = update
        self.sparsify = sparsify

    # -- configuration ----------------------------------------------------------------------------
    def resolved_block_size(self, chunk_lengths: list[int]) -> int:
        """Paper default 64 for long contexts; for short chunks a size that leaves room for a middle."""
        if self.block_size != "auto":
            return max(1, int(self.block_size))
        mean = sum(chunk_lengths) / max(1, len(chunk_lengths))
        return 64 if mean >= 32 * 64 else max(2, int(mean // 32))

    def resolved_layers(self, ctx: SelectContext) -> list[int]:
        n = len(decoder_of(ctx.lm.model).layers)
        if self.stable_layers is not None:
            return sorted({resolve_layer(ctx.lm, l) for l in self.stable_layers})
        return list(range(n - max(1, n // 8), n))

    # -- the method -------------------------------------------------------------------------------
    def keep(self, ctx: SelectContext) -> Selection | None:
        """The kept chunk positions and every chunk token's personalised-query score (the recompute step reads them)."""
        st = ctx.stitched
        spans = st.chunk_spans
        size = self.resolved_block_size([e - s for s, e in spans])
        blocks = [chunk_blocks(s, e, size, self.initial_blocks, self.local_blocks) for s, e in spans]
        anchors = torch.tensor([p for b in blocks for p in b.positions([i for i, a in enumerate(b.anchor) if a])], dtype=torch.long)
        local = torch.tensor(
            [p for b in blocks for p in b.positions([i for i, a in enumerate(b.anchor) if a and i >= self.initial_blocks])],
            dtype=torch.long,
        )
        layers = self.resolved_layers(ctx)
        # 1. personalised queries from a question prefill over the anchor blocks only
        compressed = st.keep(anchors)
        res = probe(ctx.lm, ctx.rotary, compressed, layers, recompute=local)
        n_local = local.numel()
        device = res.queries[layers[0]].device
        # host-side layout, once: which local queries are each chunk's, where its anchors sit
        mine = [torch.isin(local, torch.tensor(b.positions(list(range(len(b.ranges)))))) for b in blocks]
        has_local = [bool(m.any()) for m in mine]
        mine = [m.to(device) for m in mine]
        q_hat = {n: self._personal_queries(res.queries[n].float(), n_local, mine, has_local) for n in layers}
        # 2. block scores, eq. 2-3, and token scores for the recompute step; all on the device,
        # brought to the host once at the end (no sync inside the per-layer loop)
        token_scores = torch.full((st.segments.context_len,), float("-inf"), device=device)
        block_scores = [torch.zeros(len(b.ranges), device=device) for b in blocks]
        p_chunks = []
        for i, b in enumerate(blocks):
            mid = b.middle
            base, end = b.ranges[0][0], b.ranges[-1][1]
            slots = st.slots_of(torch.arange(base, end)).to(st.keys.device)
            anchor_idx = torch.tensor([p - base for p in b.positions([k for k, a in enumerate(b.anchor) if a])], device=device)
            mid_idx = torch.tensor(mid, dtype=torch.long, device=device)
            sizes = torch.tensor([e - s for s, e in b.ranges], device=device)
            owner = torch.repeat_interleave(torch.arange(len(b.ranges), device=device), sizes)
            p_layers = []
            for n in layers:
                qh = q_hat[n][i]  # [heads, d]
                tok = question_attention(qh[:, None], st.keys[n][:, slots], 1 / math.sqrt(qh.shape[-1]), softmax=False)
                tok = tok[:, 0].sum(dim=0) / qh.shape[0]  # [tokens]: the pooled query's score, mean over heads
                scores = torch.zeros(len(b.ranges), device=device).index_add_(0, owner, tok) / sizes  # score of the mean key
                block_scores[i] += scores / len(layers)
                span = token_scores[base:end]
                token_scores[base:end] = torch.where(span.isinf(), 0.0, span) + tok / len(layers)
                if mid:
                    p_layers.append(dynamic_top_p_tensor(tok[anchor_idx].mean(), scores[mid_idx].max(), scores[mid_idx].min()))
            p_chunks.append(torch.stack(p_layers).mean() if p_layers else torch.zeros((), device=device))
        p_host = torch.stack(p_chunks).tolist()
        scores_host = [bs.tolist() for bs in block_scores]
        proposals: list[tuple[float, int, int]] = []  # (normalised score, chunk, block)
        total_middle = 0
        for i, b in enumerate(blocks):
            mid = b.middle
            total_middle += len(mid)
            if not mid:
                continue
            k = math.ceil(p_host[i] * len(mid))
            ms = [scores_host[i][blk] for blk in mid]
            lo, hi = min(ms), max(ms)
            for blk in sorted(mid, key=lambda blk: -scores_host[i][blk])[:k]:
                norm = (scores_host[i][blk] - lo) / (hi - lo) if hi > lo else 1.0
                proposals.append((norm, i, blk))
        token_scores = token_scores.cpu()
        if not self.sparsify:
            return Selection(st.chunk_positions(), token_scores)
        # cross-chunk filtering: the best (total middle blocks / chunks) of all proposals
        limit = total_middle // max(1, len(blocks))
        chosen = sorted(proposals, key=lambda x: -x[0])[:limit]
        kept = anchors.tolist() + [p for _, i, blk in chosen for p in blocks[i].positions([blk])]
        return Selection(torch.tensor(sorted(set(kept)), dtype=torch.long), token_scores)

    @staticmethod
    def _personal_queries(q: torch.Tensor, n_local: int, mine: list[torch.Tensor], has_local: list[bool]) -> list[torch.Tensor]:
        """Eq. 1: each chunk's query Q̂_i = Q_que + the |cos|-weighted local queries of the other chunks."""
        q_que = q[:, n_local:].mean(dim=1)  # [heads, d]
        q_loc = [q[:, :n_local][:, m].mean(dim=1) if has else torch.zeros_like(q_que) for m, has in zip(mine, has_local)]
        locs = torch.stack(q_loc)  # [chunks, heads, d]
        weights = torch.nn.functional.cosine_similarity(q_que.reshape(1, -1), locs.reshape(len(q_loc), -1), dim=1).abs()
        weighted = weights[:, None, None] * locs
        total = weighted.sum(dim=0)
        d = len(q_loc)
        return [q_que + (total - weighted[i]) / max(1, d - 1) for i in range(d)]

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        """Recompute the kept chunk tokens with the highest personalised-query scores (from `keep`, in `ctx.prior`)."""
        candidates = ctx.candidates()
        return ctx.prior[candidates] if ctx.prior is not None else torch.zeros(candidates.numel())
