"""Attention masks and question attention, built in one place for every pass and probe.

Every pass over stitched KV compares positions, not slot indices (a sparse or stitched cache keeps
each slot's global position), so one rule builds the additive masks the model takes and one
function computes the question's attention that selection rules and eviction read.
"""

from __future__ import annotations

import torch


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [..., q, kv] -> additive float mask (0 where allowed, the dtype's min elsewhere)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def causal_allowed(query_pos: torch.Tensor, key_pos: torch.Tensor | int) -> torch.Tensor:
    """Boolean [q, kv]: a query at position p sees keys at positions <= p.

    `key_pos` is each key slot's position, or an int n for slots holding positions 0..n-1.
    """
    if isinstance(key_pos, int):
        key_pos = torch.arange(key_pos, device=query_pos.device)
    return key_pos.to(query_pos.device)[None, :] <= query_pos[:, None]


def causal_mask_by_position(query_pos: torch.Tensor, key_pos: torch.Tensor | int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, q, kv] causal-by-position mask."""
    return additive(causal_allowed(query_pos, key_pos), dtype)[None, None]


def question_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    query_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
    softmax: bool = True,
) -> torch.Tensor:
    """Attention of `queries` [heads, n, d] to `keys` [kv_heads, slots, d]: [heads, n, slots] in fp32.

    Grouped-query heads share their KV head. With positions, the causal rule by position applies;
    `softmax=False` returns the scaled dot products (SamKV scores pooled queries this way).
    """
    q = queries.float()
    k = keys.to(q.device).float()
    groups = q.shape[0] // k.shape[0]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=0)
    scores = torch.einsum("hnd,htd->hnt", q, k) * scaling
    if query_pos is not None and key_pos is not None:
        scores = scores + additive(causal_allowed(query_pos.to(q.device), key_pos.to(q.device)), torch.float32)
    return torch.softmax(scores, dim=-1) if softmax else scores
