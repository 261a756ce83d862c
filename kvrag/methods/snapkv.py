"""SnapKV eviction after the first token (A3's acceleration extension): decode on a bounded cache.

The system prompt and the question are kept whole (lossless and small, as A3 argues); of the
chunk tokens, each layer and KV head keeps the `budget` whose pooled attention from the
observation window (the last `window` prompt tokens, by default the question) is highest.
Keys keep their rotation, so decoding over the gathered cache needs nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag.model.cache import cache_kv, decoding_cache
from kvrag.model.masks import question_attention


@dataclass
class SnapKV:
    budget: int  # chunk tokens kept per layer and KV head
    window: int | None = None  # observation window; None = the question tokens
    kernel: int = 7  # pooling width (SnapKV's default)
    pooling: str = "avg"
    reserve: int = 64  # room kept for the answer's tokens in the evicted cache

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError("SnapKV budget must be >= 0")
        if self.pooling not in ("avg", "max"):
            raise ValueError("pooling must be 'avg' or 'max'")

    @torch.no_grad()
    def apply(
        self,
        cache,
        queries: dict[int, torch.Tensor],
        scaling: dict[int, float],
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        protected: torch.Tensor,
    ) -> object:
        """A new cache holding, per layer and head, the protected slots plus the top-budget others.

        queries[l]: [heads, window, d] of the window tokens at layer l; key_positions: the position
        of each slot of `cache`; protected: bool per slot (prefix and question) always kept.
        """
        out = []
        free_host = (~protected).nonzero().flatten()  # once, on the host: which slots compete
        always_host = protected.nonzero().flatten()
        pool = torch.nn.functional.avg_pool1d if self.pooling == "avg" else torch.nn.functional.max_pool1d
        free = always = None
        for layer_idx, (keys, values) in enumerate(cache_kv(cache)):  # [1, kv_heads, slots, d]
            if free_host.numel() <= self.budget:
                out.append((keys, values))
                continue
            if free is None:
                free, always = free_host.to(keys.device), always_host.to(keys.device)
            q = queries[layer_idx]
            kv_heads = keys.shape[1]
            group = q.shape[0] // kv_heads
            attn = question_attention(q, keys[0], scaling[layer_idx], query_positions, key_positions).sum(dim=1)  # [heads, slots]
            attn = attn.view(kv_heads, group, -1).sum(dim=1)  # per KV head
            pad = self.kernel // 2
            pooled = pool(attn[:, None], self.kernel, stride=1, padding=pad)[:, 0] if self.kernel > 1 else attn
            top = torch.topk(pooled[:, free], self.budget, dim=-1).indices  # [kv_heads, budget]
            keep_free = free[top]
            idx = torch.cat([always[None].expand(kv_heads, -1), keep_free], dim=1).sort(dim=1).values  # [kv_heads, kept]
            gather = idx[None, :, :, None].expand(1, kv_heads, idx.shape[1], keys.shape[-1])
            out.append((keys.gather(2, gather), values.gather(2, gather)))
        return decoding_cache(out, self.reserve)
