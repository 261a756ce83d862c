"""APE's attention over reused chunk KV, for the question's pass and every decode step.

APE (Yang, Chen, Chen, ICLR 2025) splits a query's attention into two parts: over the context (the chunk
tokens, encoded separately after the shared prefix) with scores divided by a temperature T, and over the
rest (the prefix, the question, the answer so far) as usual; the parts are merged with weights
softmax([S*T*L_C, L_N]), L being each part's log-sum-exp of its scores and S a scale. Written as one
softmax over every key, that is the context's scores replaced by

    s / T + (S*T - 1) * L_C,        L_C = logsumexp over the context of s / T

(the context's mass is then exp(S*T*L_C), its distribution softmax(s / T)), so it fits any kernel that
takes scores: the stitched pass's query blocks (kvrag.model.attention), the lean decode step's
`attend_rows` (kvrag.decode.attend, a CUDA graph captures it: elementwise ops and a reduction, no host
sync), and the stock attention of a model forward while decoding (`decoding_with`). T = S = 1 never
reaches this module: `Ape.active` is False and the stock path runs, bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from kvrag.defaults import Ape


def ape_logits(scores: torch.Tensor, context: torch.Tensor, ape: Ape) -> torch.Tensor:
    """`scores` [..., keys] (already scaled by 1/sqrt(d)) with the context's entries replaced as APE merges
    them; `context` (bool, broadcastable to `scores`) marks the chunk keys this query may see. Float32."""
    scores = scores.float()
    ctx = scores / ape.temperature
    lse = torch.logsumexp(ctx.masked_fill(~context, float("-inf")), dim=-1, keepdim=True)
    # a row with no context key: lse = -inf there, and where() keeps its plain scores
    coef = ape.scale * ape.temperature - 1.0
    return torch.where(context, ctx + coef * torch.nan_to_num(lse, neginf=0.0), scores)


def ape_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                  context: torch.Tensor, ape: Ape, scaling: float) -> torch.Tensor:
    """Attention of `query` [b, heads, q, d] over `key`/`value` [b, kv_heads, kv, d] with APE on the
    `context` keys (bool [kv] or [q, kv]); `allowed` (bool, broadcastable to [b, heads, q, kv]) hides what
    a query must not see. Scores and softmax in float32, as transformers' eager attention takes its
    softmax. Returns [b, heads, q, d] (SDPA's layout)."""
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # the query heads sharing a K/V head as rows of one matrix: K/V read as stored, never repeated per head
    grouped = query.reshape(b, kv_heads, groups * n, d)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling  # [b, kv_heads, groups * n, kv]
    ctx, ok = _rows(context, groups, n), _rows(allowed, groups, n)
    logits = ape_logits(scores, ctx if ok is None else ctx & ok, ape)
    if ok is not None:
        logits = logits.masked_fill(~ok, float("-inf"))
    probs = torch.softmax(logits, dim=-1).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, heads, n, d)


def _rows(mask: torch.Tensor | None, groups: int, n: int) -> torch.Tensor | None:
    """A bool mask broadcastable to [b, heads, n, kv] as the grouped rows' [..., groups * n, kv] (None stays None)."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    while mask.dim() < 4:
        mask = mask[None]
    if mask.shape[1] != 1:
        raise ValueError("APE takes a mask shared by every head")
    return mask.repeat(1, 1, groups, 1)


@dataclass(frozen=True)
class DecodeApe:
    """APE while decoding one sequence: the context is the cache slots [start, stop) (its chunk tokens,
    after the prefix; the question and the answer's slots follow them)."""

    ape: Ape
    start: int
    stop: int

    def context(self, slots: int, device: torch.device) -> torch.Tensor:
        """Bool [slots]: which of the first `slots` cache slots are context."""
        at = torch.arange(slots, device=device)
        return (at >= self.start) & (at < self.stop)


_DECODE: ContextVar[DecodeApe | None] = ContextVar("kvrag_decode_ape", default=None)


@contextmanager
def decoding_with(dape: DecodeApe | None) -> Iterator[None]:
    """Model forwards inside attend with APE over `dape`'s context (kvrag.model.attention reads it)."""
    token = _DECODE.set(dape if dape is not None and dape.ape.active else None)
    try:
        yield
    finally:
        _DECODE.reset(token)


def decode_ape() -> DecodeApe | None:
    return _DECODE.get()


def allowed_from_mask(mask: Any, q: int, kv: int, device: torch.device | None = None) -> torch.Tensor | None:
    """A transformers attention mask (None, bool, or additive float [b, 1, q, >= kv]) as bool 'may attend';
    None with several queries is causal, the queries being the last `q` keys (what SDPA's is_causal means
    over a cache)."""
    if mask is None:
        if q == 1:
            return None
        return torch.ones(q, kv, dtype=torch.bool, device=device).tril(kv - q)
    m = mask[..., :q, :kv] if mask.dim() == 4 else mask
    if m.dtype == torch.bool:
        return m
    return m > torch.finfo(m.dtype).min / 2
