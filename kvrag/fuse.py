"""Stitching stored KV and the one recompute pass that every method shares.

Recompute pass: the selected chunk tokens plus the question run in a single forward at their
true positions over the stitched cache, with a causal mask by position; each layer overwrites the
selected positions before attending, so later layers see the corrected KV. With every chunk token
selected this is exactly Full Attention; with none it is Full Reuse (question prefill only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvrag.cache import SpliceCache, prefix_cache
from kvrag.layout import Segments
from kvrag.model import LoadedModel
from kvrag.precompute import LayerStack, unstack_layers
from kvrag.rope import Rotary


@dataclass
class Stitched:
    """The reused context: per-layer stacked KV over prefix + chunks, keys at global positions."""

    keys: torch.Tensor  # [layers, kv_heads, context_len, head_dim]
    values: torch.Tensor
    segments: Segments

    @property
    def chunk_spans(self) -> list[tuple[int, int]]:
        return [(s, s + len(c)) for s, c in zip(self.segments.chunk_starts, self.segments.chunks)]

    def chunk_positions(self) -> torch.Tensor:
        """All positions that belong to chunks (the only ones a method may select)."""
        s = len(self.segments.prefix)
        return torch.arange(s, self.segments.context_len)


def stitch(prefix: LayerStack, chunks: Sequence[LayerStack], segments: Segments, rotary: Rotary) -> Stitched:
    """Concatenate RoPE-free chunk KV after the prefix and rotate keys to their global positions.

    All chunks and all layers are rotated in one batched op (positions broadcast over layers/heads).
    """
    pk, pv = prefix
    if not chunks:
        return Stitched(pk.clone(), pv.clone(), segments)
    ck = torch.cat([k for k, _ in chunks], dim=2)
    cv = torch.cat([v for _, v in chunks], dim=2)
    positions = torch.arange(len(segments.prefix), segments.context_len)
    ck = rotary.rotate(ck.to(pk.device), positions)
    keys = torch.cat([pk, ck.to(pk.dtype)], dim=2)
    values = torch.cat([pv, cv.to(pv.device, pv.dtype)], dim=2)
    return Stitched(keys, values, segments)


def causal_mask_by_position(query_pos: torch.Tensor, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive [1, 1, q, kv] mask: query at position p sees keys at positions <= p."""
    keys = torch.arange(kv_len, device=query_pos.device)
    allowed = keys[None, :] <= query_pos[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=query_pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@dataclass
class PrefillOutput:
    logits: torch.Tensor  # [vocab] logits at the last prompt position
    cache: object  # a transformers Cache ready for decoding
    next_position: int


@torch.no_grad()
def recompute(lm: LoadedModel, stitched: Stitched, selected: torch.Tensor) -> PrefillOutput:
    """The shared recompute pass over `selected` chunk positions plus the question."""
    seg = stitched.segments
    device = lm.device
    selected = selected.to(device=device, dtype=torch.long).sort().values
    ctx_len = seg.context_len
    all_ids = torch.tensor(seg.all_ids(), device=device)
    q_pos = torch.arange(ctx_len, seg.total_len, device=device)
    positions = torch.cat([selected, q_pos])
    input_ids = all_ids[positions][None]
    cache = SpliceCache(unstack_layers(stitched.keys, stitched.values))
    cache.overwrite(selected if selected.numel() else None)
    mask = causal_mask_by_position(positions, seg.total_len, lm.dtype)
    out = lm.model(
        input_ids=input_ids,
        position_ids=positions[None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache.overwrite(None)
    return PrefillOutput(out.logits[0, -1].float(), cache, seg.total_len)


@torch.no_grad()
def full_prefill(lm: LoadedModel, prefix: LayerStack, segments: Segments) -> PrefillOutput:
    """Full Attention: the prefix from cache (it never changes), every other token prefilled."""
    device = lm.device
    cache = prefix_cache(unstack_layers(*prefix))
    s = len(segments.prefix)
    ids = torch.tensor(segments.all_ids()[s:], device=device)[None]
    positions = torch.arange(s, segments.total_len, device=device)[None]
    out = lm.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return PrefillOutput(out.logits[0, -1].float(), cache, segments.total_len)
