"""KVLink link tokens: the attention picture, the link embeddings and the adapter artifact.

KVLink (Yang et al., 2025, §2.3, Fig. 2) appends K trainable link tokens after every separately
cached chunk. One picture says who attends to whom, in training and at inference alike:

- prefix tokens: causal among themselves;
- chunk-n tokens: the system prefix and the earlier tokens of chunk n (what precompute computed);
- link tokens of chunk n, the question and everything after it: every earlier position (earlier
  chunks, earlier link tokens, their own chunk), i.e. causal by position;
- except trailers (`Segments.link_scope == "chunk"`, KV Packet's trailer vectors without its header): chunk
  n's link tokens see the system prefix, chunk n and their own earlier link tokens, nothing of the other
  chunks, so what they hold depends on their chunk alone.

`link_picture` draws it for any query and key positions. Training (`kvrag.train`) uses it for the
whole sequence; inference uses it for the rows of the one recompute pass (`kvrag.fuse.stitch.recompute`):
those rows are the link tokens, the question and any chunk token a selection rule chose to
recompute (a recomputed chunk token is a global row: recomputation means attending causally to
everything before it), so at inference the rows it draws are causal by position, and the cached
chunk tokens keep the "prefix + own chunk" KV that precompute gave them, which is the picture's
local rows.

Link embeddings follow the paper's App. A.2: the n-th chunk's link tokens are link(n, 1..K), a
separate row per (chunk index, slot), `max_chunks` chunk indices (the reference code uses 10);
chunks past the last trained index reuse its rows. They are new rows beside the frozen vocabulary,
never added to it, so the model, its fingerprint and every cache key stay as they are. Without an
adapter the rows start as the mean of the vocabulary's input embeddings (what transformers'
`resize_token_embeddings` centres new rows on).

The adapter file (link rows, LoRA factors, header) and merging its weights: `kvrag.link_adapter`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvrag.defaults import DEFAULT_MAX_CHUNKS
from kvrag.kv.layout import Segments
from kvrag.model.masks import additive

log = logging.getLogger(__name__)

PREFIX_OWNER = -1  # the system prefix
GLOBAL_OWNER = -2  # link tokens, the question, the answer: causal over everything


# -- the picture --------------------------------------------------------------------------------
def owners(segments: Segments, positions: torch.Tensor) -> torch.Tensor:
    """Who each position belongs to: chunk index n >= 0 (its tokens, and its trailers' slots), PREFIX_OWNER, or
    GLOBAL_OWNER (links, question, later)."""
    table = torch.full((segments.context_len,), GLOBAL_OWNER, dtype=torch.long)
    table[: len(segments.prefix)] = PREFIX_OWNER
    scoped = segments.links if segments.link_scope == "chunk" else 0  # trailers belong to their chunk
    for n, (start, chunk) in enumerate(zip(segments.chunk_starts, segments.chunks)):
        table[start : start + len(chunk) + scoped] = n
    pos = positions.to(torch.long)
    inside = (pos >= 0) & (pos < segments.context_len)
    table = table.to(pos.device)
    return torch.where(inside, table[pos.clamp(0, max(0, segments.context_len - 1))], torch.full_like(pos, GLOBAL_OWNER))


def link_picture(
    segments: Segments, query_pos: torch.Tensor, key_pos: torch.Tensor, global_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean [q, kv]: may the token at query_pos[i] attend to the key at key_pos[j] (KVLink Fig. 2)?

    Chunk tokens see the prefix and their own chunk up to themselves; everything else is causal by
    position. `global_rows`: chunk positions that are recomputed, hence causal too.
    """
    query_pos = query_pos.to(torch.long)
    key_pos = key_pos.to(device=query_pos.device, dtype=torch.long)
    causal = key_pos[None, :] <= query_pos[:, None]
    oq, ok = owners(segments, query_pos), owners(segments, key_pos)
    if global_rows is not None and global_rows.numel():
        oq = torch.where(torch.isin(query_pos, global_rows.to(query_pos.device)), GLOBAL_OWNER, oq)
    local = (oq >= 0)[:, None]
    same = (ok[None, :] == oq[:, None]) | (ok[None, :] == PREFIX_OWNER)
    return causal & (~local | same)


def link_mask(
    segments: Segments, query_pos: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype, global_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """`link_picture` as the additive [1, 1, q, kv] mask the model takes."""
    return additive(link_picture(segments, query_pos, key_pos, global_rows), dtype)[None, None]


# -- link embeddings -----------------------------------------------------------------------------
def default_link_embeds(model: Any, link_tokens: int, max_chunks: int = DEFAULT_MAX_CHUNKS) -> torch.Tensor:
    """Untrained link rows: the mean input embedding, for every (chunk index, slot): [max_chunks, K, hidden] fp32."""
    emb = model.get_input_embeddings().weight.detach()
    mean = emb.float().mean(dim=0).cpu()
    return mean.expand(max(1, max_chunks), link_tokens, -1).clone()


def link_row_index(n_chunks: int, link_tokens: int, max_chunks: int) -> torch.Tensor:
    """Row of the flattened [max_chunks * K, hidden] table for each link slot, in position order."""
    n = torch.arange(n_chunks).clamp(max=max_chunks - 1)
    return (n[:, None] * link_tokens + torch.arange(link_tokens)[None, :]).reshape(-1)


def link_rows(table: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """The link embeddings of a prompt with `n_chunks` chunks: [n_chunks * K, hidden], link(n, i) in position order."""
    max_chunks, k, hidden = table.shape
    return table.reshape(max_chunks * k, hidden)[link_row_index(n_chunks, k, max_chunks).to(table.device)]


def embed_with_links(model: Any, input_ids: torch.Tensor, is_link: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Input embeddings of `input_ids` [b, t], with the link slots (`is_link`, in order) taking `rows`."""
    embeds = model.get_input_embeddings()(input_ids)
    n = int(is_link.sum())
    if n != rows.shape[0]:
        raise ValueError(f"{n} link slots but {rows.shape[0]} link embeddings")
    if n:
        embeds = embeds.masked_scatter(is_link[..., None], rows.to(embeds.dtype))
    return embeds


