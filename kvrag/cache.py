"""The only module that touches transformers' Cache API (written against transformers 5.x).

`SpliceCache` holds a stitched KV sequence. During the recompute pass the first `n` new entries
of every layer overwrite given positions (the recomputed chunk tokens) and the rest are appended
(the question); afterwards it behaves like a DynamicCache and grows by appending while decoding.
The stock decoder layers then do the recompute work for any Llama/Qwen/Mistral-style model.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

KV = tuple[torch.Tensor, torch.Tensor]


class SpliceLayer(DynamicLayer):
    """A DynamicLayer that can overwrite positions in place before appending."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.overwrite_at: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        idx = self.overwrite_at
        if idx is not None and idx.numel():
            n = idx.numel()
            self.keys.index_copy_(2, idx, key_states[:, :, :n].to(self.keys.dtype))
            self.values.index_copy_(2, idx, value_states[:, :, :n].to(self.values.dtype))
            key_states, value_states = key_states[:, :, n:], value_states[:, :, n:]
        if key_states.shape[-2]:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


class SpliceCache(Cache):
    """A cache over stitched per-layer KV; see the module docstring."""

    def __init__(self, kv: Sequence[KV]) -> None:
        super().__init__(layers=[SpliceLayer(k, v) for k, v in kv])

    def overwrite(self, positions: torch.Tensor | None) -> None:
        """The next forward's first len(positions) tokens overwrite these positions (None: append only)."""
        for layer in self.layers:
            layer.overwrite_at = positions

    def __len__(self) -> int:
        return len(self.layers)


def prefix_cache(kv: Sequence[KV]) -> DynamicCache:
    """A plain DynamicCache holding copies of `kv` (the stored tensors are never written through)."""
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])


def empty_cache() -> DynamicCache:
    return DynamicCache()


def cache_kv(cache: Cache) -> list[KV]:
    """Per-layer (keys, values) of any attention cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())
