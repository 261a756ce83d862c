"""What a stored entry must prove before its KV is used: whose it is, which tokens, which shape, finite.

A checksum only says the bytes are the ones written. An entry copied over another key, written by
a model with other heads, or holding NaNs passes it, so every read is checked against what the
request expects, and any mismatch is a miss that gets recomputed and replaced.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvrag.cache_backends import KVEntry
from kvrag.model import LoadedModel, text_config


def kv_shape(lm: LoadedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of this model's KV."""
    cfg = text_config(lm.model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def entry_problem(
    entry: KVEntry,
    lm: LoadedModel,
    layout_identity: str,
    kind: str,
    token_ids: Sequence[int] | None,
    n_tokens: int,
) -> str | None:
    """Why this entry must not be used for (kind, token_ids), or None when it may."""
    m = entry.meta
    if m.get("model") != lm.fingerprint or m.get("layout") != layout_identity or m.get("kind") != kind:
        return "written by another model, prompt layout or kind"
    layers, kv_heads, head_dim = kv_shape(lm)
    want = (layers, kv_heads, n_tokens, head_dim)
    for name, t in (("keys", entry.keys), ("values", entry.values)):
        if tuple(t.shape) != want:
            return f"{name} shape {tuple(t.shape)}, expected {want}"
        if not t.dtype.is_floating_point:
            return f"{name} dtype {t.dtype} is not a float type"
    if token_ids is not None:
        if entry.token_ids is None:
            return "no token ids stored"
        stored = entry.token_ids.reshape(-1)
        if stored.numel() != len(token_ids) or not torch.equal(stored.cpu().to(torch.int64), torch.as_tensor(list(token_ids), dtype=torch.int64)):
            return "its token ids are another chunk's"
    if not bool(torch.isfinite(entry.keys).all()) or not bool(torch.isfinite(entry.values).all()):
        return "non-finite values"
    return None
