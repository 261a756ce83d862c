"""Neighbours for FusionRAG's similarity-guided preprocessing (§3.1).

Chunks retrieved together tend to be similar to each other, so a chunk's KV computed with its
top-n most similar chunks as context carries part of the cross-attention that Full Reuse loses.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from kvrag.types import Chunk


def neighbours_by_embedding(chunks: Sequence[Chunk], top_n: int, embed: Any = None) -> dict[str, list[str]]:
    """Top-n most similar other chunks (cosine of sentence embeddings) among `chunks`, best first."""
    if top_n <= 0 or len(chunks) < 2:
        return {c.id: [] for c in chunks}
    if embed is None:
        from kvrag.ingest.retrieval import embedding_function

        embed = embedding_function()
    vecs = torch.tensor([list(map(float, v)) for v in embed([c.text for c in chunks])])
    vecs = torch.nn.functional.normalize(vecs, dim=-1)
    sim = vecs @ vecs.T
    sim.fill_diagonal_(-2.0)
    top = torch.topk(sim, min(top_n, len(chunks) - 1), dim=-1).indices
    return {c.id: [chunks[j].id for j in row.tolist()] for c, row in zip(chunks, top)}


def neighbours_from_index(index: Any, chunks: Sequence[Chunk], top_n: int) -> dict[str, list[str]]:
    """Top-n neighbours of each chunk found by querying a ChunkIndex with the chunk's text."""
    out: dict[str, list[str]] = {}
    for c in chunks:
        hits = [h for h in index.query(c.text, k=top_n + 1) if h.id != c.id]
        out[c.id] = [h.id for h in hits[:top_n]]
    return out


def check_neighbours(neighbours: Mapping[str, Sequence[str]], known: Mapping[str, Chunk]) -> None:
    missing = sorted({n for ns in neighbours.values() for n in ns if n not in known})
    if missing:
        raise KeyError(f"neighbour chunk ids not known to the engine: {missing[:5]}")
