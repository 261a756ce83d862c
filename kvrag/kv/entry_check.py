"""What a stored entry must prove before its KV is used: whose it is, which tokens, which shape, finite.

A checksum only says the bytes are the ones written. An entry copied over another key, written by
a model with other heads, or holding NaNs passes it, so every read is checked against what the
request expects, and any mismatch is a miss that gets recomputed and replaced.
"""

from __future__ import annotations

import functools
import weakref
from typing import Sequence

import torch

from kvrag.cache_backends import KVEntry
from kvrag.model.loading import LoadedModel, text_config


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
        # compared on the host as Python ints: the ids live on the host, and no per-chunk tensor op
        if stored.numel() != len(token_ids) or stored.tolist() != [int(t) for t in token_ids]:
            return "its token ids are another chunk's"
    if entry.meta.get(FINITE_META) != "1" and (not all_finite(entry.keys) or not all_finite(entry.values)):
        return "non-finite values"
    return None


# An entry's writer found every value finite before writing it (`mark_finite`). The mark sits in the
# entry's metadata, which the stores' checksum (or MAC) covers with the data, so a reader skips the
# scan: a whole-context read on the host per request, for the disk tier more than its own read costs.
# Entries without the mark (another writer's) are scanned as before.
FINITE_META = "finite"


def mark_finite(meta: dict[str, str], keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Scan a new entry's KV once, at write time; mark `meta` and return True when all finite."""
    ok = all_finite(keys) and all_finite(values)
    if ok:
        meta[FINITE_META] = "1"
    return ok


# tensor id -> (a weak reference to it, its version counter when found finite). Memory tiers hand
# back the same tensors on every hit, so each is scanned once while it lives and stays unmodified.
# No lock: a weak reference's callback runs wherever the tensor dies, inside any allocation that
# starts a garbage collection, so a callback that took a lock the dying thread holds would wait on
# itself forever. Each step below is one atomic dict operation; a race can at worst drop an entry
# (a rescan), never keep a stale one, since a hit also checks the object and its version.
_FINITE: dict[int, tuple[weakref.ref, int]] = {}


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of `t` is finite; a tensor already found finite and not modified since
    (same object, same in-place version) is not scanned again."""
    key = id(t)
    seen = _FINITE.get(key)
    if seen is not None and seen[0]() is t and seen[1] == t._version:
        return True
    # one reduction pass: a NaN or an infinity anywhere makes the sum non-finite; only then (or when
    # huge finite values overflow it) is every value looked at
    if not bool(torch.isfinite(t.sum(dtype=torch.float32))) and not bool(torch.isfinite(t).all()):
        return False
    _FINITE[key] = (weakref.ref(t, functools.partial(_forget, key)), t._version)
    return True


def _forget(key: int, ref: weakref.ref) -> None:
    """A scanned tensor died: drop its entry unless its id already names a newer tensor's."""
    seen = _FINITE.get(key)
    if seen is not None and seen[0] is ref:
        _FINITE.pop(key, None)
