"""KV deviation from Full Attention (FusionRAG eq. 7) of the stitched, reused cache.

Per layer: the squared difference of keys and values, summed over heads and head dims, averaged
over chunk tokens. It measures how much cross-chunk attention a reuse path has lost.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvrag.model.cache import cache_kv
from kvrag.engine import KVRag
from kvrag.options import KIND_CHUNK, KIND_SIMILARITY
from kvrag.kv.similarity import neighbours_by_embedding


def kv_deviation(rag: KVRag, question: str, chunk_ids: Sequence[str], kv_kind: str = KIND_CHUNK) -> torch.Tensor:
    """[layers] deviation of the reused KV (`kv_kind` entries, nothing recomputed) from Full Attention."""
    full = rag.prefill(question, chunk_ids, method="full")
    reuse = rag.prefill(question, chunk_ids, method="reuse", kv_kind=kv_kind)
    s, e = len(reuse.segments.prefix), reuse.segments.context_len
    full_kv = cache_kv(full.output.cache)
    fk = torch.stack([k[0, :, s:e] for k, _ in full_kv])
    fv = torch.stack([v[0, :, s:e] for _, v in full_kv])
    dk = (fk.float() - reuse.stitched.keys[:, :, s:e].float()).pow(2).sum(dim=(1, 3))
    dv = (fv.float() - reuse.stitched.values[:, :, s:e].float()).pow(2).sum(dim=(1, 3))
    return (dk + dv).mean(dim=1)


def deviation_study(rag: KVRag, examples, top_n: int = 2) -> dict:
    """Mean KV deviation of plain vs similarity-guided entries over `examples` (neighbours: the
    top-n most similar chunks among each example's retrieved chunks)."""
    plain, sim = [], []
    for ex in examples:
        ids = [c.id for c in ex.chunks]
        rag.precompute(ex.chunks, progress=False)
        rag.precompute(ex.chunks, kind=KIND_SIMILARITY, neighbours=neighbours_by_embedding(ex.chunks, top_n), progress=False)
        plain.append(kv_deviation(rag, ex.question, ids))
        sim.append(kv_deviation(rag, ex.question, ids, kv_kind=KIND_SIMILARITY))
    p, q = torch.stack(plain).mean(0), torch.stack(sim).mean(0)
    return {
        "n": len(plain),
        "top_n": top_n,
        "layer1_plain": float(p[1]),
        "layer1_similarity": float(q[1]),
        "all_layers_plain": float(p.mean()),
        "all_layers_similarity": float(q.mean()),
        "per_layer_plain": p.tolist(),
        "per_layer_similarity": q.tolist(),
    }
