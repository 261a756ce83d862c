"""KV deviation from Full Attention (FusionRAG eq. 7) of the stitched, reused cache.

Per layer: the squared difference of keys and values, summed over heads and head dims, averaged
over chunk tokens. It measures how much cross-chunk attention a reuse path has lost.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvrag.engine import KIND_CHUNK, KVRag


def kv_deviation(rag: KVRag, question: str, chunk_ids: Sequence[str], kv_kind: str = KIND_CHUNK) -> torch.Tensor:
    """[layers] deviation of the reused KV (`kv_kind` entries, nothing recomputed) from Full Attention."""
    full = rag.prefill(question, chunk_ids, method="full")
    reuse = rag.prefill(question, chunk_ids, method="reuse", kv_kind=kv_kind)
    s, e = len(reuse.segments.prefix), reuse.segments.context_len
    fk = torch.stack([layer.keys[0, :, s:e] for layer in full.output.cache.layers])
    fv = torch.stack([layer.values[0, :, s:e] for layer in full.output.cache.layers])
    dk = (fk.float() - reuse.stitched.keys[:, :, s:e].float()).pow(2).sum(dim=(1, 3))
    dv = (fv.float() - reuse.stitched.values[:, :, s:e].float()).pow(2).sum(dim=(1, 3))
    return (dk + dv).mean(dim=1)
