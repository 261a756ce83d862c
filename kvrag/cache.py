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
        self.mode = "overwrite"
        self.exact: torch.Tensor | None = None  # bool per overwritten slot: always overwrite, never blend

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> KV:
        idx = self.overwrite_at
        if idx is not None and idx.numel():
            n = idx.numel()
            new_k, new_v = key_states[:, :, :n].to(self.keys.dtype), value_states[:, :, :n].to(self.values.dtype)
            if self.mode == "fusion":
                fused_k = fuse_by_cosine(new_k, self.keys.index_select(2, idx))
                fused_v = fuse_by_cosine(new_v, self.values.index_select(2, idx))
                if self.exact is not None and bool(self.exact.any()):
                    keep_new = self.exact.to(new_k.device)[None, None, :, None]
                    fused_k, fused_v = torch.where(keep_new, new_k, fused_k), torch.where(keep_new, new_v, fused_v)
                new_k, new_v = fused_k, fused_v
            self.keys.index_copy_(2, idx, new_k)
            self.values.index_copy_(2, idx, new_v)
            key_states, value_states = key_states[:, :, n:], value_states[:, :, n:]
        if key_states.shape[-2]:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


class SpliceCache(Cache):
    """A cache over stitched per-layer KV; see the module docstring."""

    def __init__(self, kv: Sequence[KV]) -> None:
        super().__init__(layers=[SpliceLayer(k, v) for k, v in kv])

    def overwrite(self, slots: torch.Tensor | None, mode: str = "overwrite", exact: torch.Tensor | None = None) -> None:
        """The next forward's first len(slots) tokens write into these slots (None: append only).

        mode "overwrite" replaces the old KV; "fusion" blends new and old by their cosine (SamKV eq. 4),
        except where `exact` (bool per slot) is set: those slots (KVLink link slots, empty before
        the pass) are overwritten in either mode.
        """
        if mode not in ("overwrite", "fusion"):
            raise ValueError(f"update mode must be 'overwrite' or 'fusion', got {mode!r}")
        for layer in self.layers:
            layer.overwrite_at = slots
            layer.mode = mode
            layer.exact = exact


def fuse_by_cosine(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """theta * new + (1 - theta) * old with theta = cos(new, old) per head and token (SamKV eq. 4)."""
    theta = torch.nn.functional.cosine_similarity(new.float(), old.float(), dim=-1).unsqueeze(-1)
    return (theta * new.float() + (1 - theta) * old.float()).to(new.dtype)


def prefix_cache(kv: Sequence[KV]) -> DynamicCache:
    """A plain DynamicCache holding copies of `kv` (the stored tensors are never written through)."""
    return DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in kv])


def cache_from_kv(kv: Sequence[KV]) -> DynamicCache:
    """A DynamicCache over these tensors as they are (no copy)."""
    return DynamicCache(ddp_cache_data=list(kv))


def cache_nbytes(cache: Cache) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in cache_kv(cache))


def empty_cache() -> DynamicCache:
    return DynamicCache()


def cache_kv(cache: Cache) -> list[KV]:
    """Per-layer (keys, values) of any attention cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())
