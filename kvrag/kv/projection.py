"""How much KV a corpus will take in a store, before a long ingest computes any of it.

The files are chunked as `kvrag ingest` chunks them and tokenised with the model's own tokenizer;
the model's configuration (no weights) gives the bytes a token takes at each storage precision
(`cache_backends.format.stored_bytes_per_token`), so the figure is the corpus's tokens times that.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvrag.cache_backends.format import STORAGE, stored_bytes_per_token
from kvrag.ingest.documents import load_documents
from kvrag.kv.layout import PromptLayout


@dataclass(frozen=True)
class Projection:
    model: str
    dtype: str
    layers: int
    kv_heads: int
    head_dim: int
    chunks: int
    tokens: int
    bytes_per_token: dict[str, float] = field(default_factory=dict)  # per storage precision

    def total(self, precision: str) -> float:
        return self.tokens * self.bytes_per_token[precision] + self.chunks * 4096  # + a header a chunk

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "layers": self.layers, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "chunks": self.chunks, "tokens": self.tokens,
                "bytes_per_token": self.bytes_per_token, "bytes": {p: self.total(p) for p in self.bytes_per_token}}


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head size) of a transformers config (a multimodal one's text part)."""
    cfg = getattr(config, "text_config", None) or config
    heads = cfg.num_attention_heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads, \
        getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def project(paths: Sequence[str | os.PathLike[str]], model: str | None = None, device: str = "cpu") -> Projection:
    """The KV a corpus takes with `model` (None: the bundled one) computed on `device`'s default dtype."""
    from kvrag.model.loading import load_config, load_tokenizer, resolve_dtype

    tokenizer = load_tokenizer(model)
    layers, heads, head_dim = kv_shape(load_config(model))
    dtype = resolve_dtype("auto", device)
    chunks = load_documents(paths, tokenizer=tokenizer)
    layout = PromptLayout(tokenizer)
    tokens = sum(len(layout.chunk_ids(c, memo=False)) for c in chunks)  # as stored: the chunk's template included
    element = dtype.itemsize
    return Projection(model=model or "bundled SmolLM2-135M-Instruct", dtype=str(dtype).replace("torch.", ""),
                      layers=layers, kv_heads=heads, head_dim=head_dim, chunks=len(chunks), tokens=tokens,
                      bytes_per_token={p: stored_bytes_per_token(layers, heads, head_dim, element, p) for p in STORAGE})


def format_projection(p: Projection, store_precision: str | None = None) -> str:
    from kvrag.cache_backends.admin.operations import _size

    lines = [f"projected KV for {p.chunks} chunks ({p.tokens:,} tokens) with {p.model} "
             f"({p.layers} layers, {p.kv_heads} KV heads of {p.head_dim}, computed in {p.dtype}):"]
    for precision, per_token in p.bytes_per_token.items():
        label = f"{precision} (as computed)" if precision == "none" else precision
        mark = "  <- this store" if precision == store_precision else ""
        lines.append(f"  {label:<20} {per_token:>9,.0f} B a token  {_size(p.total(precision)):>10} in all, "
                     f"{_size(p.total(precision) / max(1, p.chunks))} a chunk{mark}")
    return "\n".join(lines)
