"""KVRag: the engine users hold. Model preparation (link adapters, the correctness gate) on top of
`KVRagCore`, whose two rooms hold the rest: the KV repository and the request pipeline."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any


from kvrag.cache_backends import KVStore
from kvrag.check import gate
from kvrag.core import KVRagCore
from kvrag.layout import PromptLayout
from kvrag.links import LinkAdapter, apply_adapter, check_adapter, load_adapter, shipped_adapter_path
from kvrag.model import LoadedModel, load_model
from kvrag.options import CHUNK_KINDS, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY, AnswerOptions
from kvrag.pipeline import AnswerStream, Prefill
from kvrag.repository import PrecomputeReport

log = logging.getLogger(__name__)

__all__ = [
    "CHUNK_KINDS",
    "KIND_CHUNK",
    "KIND_PREFIX",
    "KIND_SIMILARITY",
    "AnswerOptions",
    "AnswerStream",
    "KVRag",
    "Prefill",
    "PrecomputeReport",
]


class KVRag(KVRagCore):
    """RAG over a local causal LM that reuses each chunk's precomputed KV cache."""

    def __init__(
        self,
        lm: LoadedModel,
        store: KVStore | str | None = None,
        layout: PromptLayout | None = None,
        batch_size: int = 8,
        check: bool = True,
        link_adapter: str | Path | LinkAdapter | None = "auto",
        *,
        _adapter_in_place: bool = False,
        **layout_kwargs: Any,
    ) -> None:
        """`check=True` runs the per-model correctness gate (`kvrag.check.gate`) once per model
        fingerprint and device type (its verdict is cached under $KVRAG_HOME/checks) and raises
        UnsupportedModelError, naming the failing check, for a model kvrag cannot serve exactly.

        `link_adapter`: the KVLink adapter `method="kvlink"` uses. "auto" (default) is the adapter
        shipped for the bundled model (links-only), none for other models; None: no adapter; a
        path or a `LinkAdapter`: that adapter, checked against this model and layout
        (AdapterMismatchError otherwise). An adapter with LoRA or full weights changes the model:
        the engine then serves a merged copy (every method, with its own fingerprint and caches)."""
        layout = layout or PromptLayout(lm.tokenizer, **layout_kwargs)
        self._link_adapter: LinkAdapter | None = None
        self._link_adapter_auto = link_adapter == "auto"
        if not self._link_adapter_auto and link_adapter is not None:
            adapter = link_adapter if isinstance(link_adapter, LinkAdapter) else load_adapter(link_adapter)
            where = "link adapter" if isinstance(link_adapter, LinkAdapter) else str(link_adapter)
            check_adapter(adapter, lm, layout.identity, where=where)
            lm = apply_adapter(lm, adapter, inplace=_adapter_in_place)
            self._link_adapter = adapter
        self.check_report = gate(lm) if check else None
        super().__init__(lm, store=store, layout=layout, batch_size=batch_size)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        store: KVStore | str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        check: bool = True,
        link_adapter: str | Path | LinkAdapter | None = "auto",
        **kwargs: Any,
    ) -> "KVRag":
        """Load a model (default: the bundled SmolLM2-135M-Instruct) and open a store (default: disk under $KVRAG_HOME).

        `device`: "auto" (CUDA when a GPU is there, else CPU), "cuda", "cuda:N" or "cpu". `dtype`:
        "auto" (bfloat16 on CUDA, float32 on CPU), "bfloat16", "float16" or "float32". Stored
        entries record their dtype and are cast to the engine's on load. `check=False` skips the
        per-model correctness gate (see `KVRag.__init__`). `link_adapter`: the KVLink adapter (see
        `KVRag.__init__`); one with LoRA/full weights is merged into the freshly loaded model.
        """
        lm = load_model(model, device=device, dtype=dtype)
        return cls(lm, store=store, check=check, link_adapter=link_adapter, _adapter_in_place=True, **kwargs)

    @property
    def link_adapter(self) -> LinkAdapter | None:
        """The KVLink adapter in use (resolving "auto" on first use: the shipped one, if it fits)."""
        if self._link_adapter is None and self._link_adapter_auto:
            self._link_adapter_auto = False
            self._link_adapter = self._shipped_adapter()
        return self._link_adapter

    def _shipped_adapter(self) -> LinkAdapter | None:
        path = shipped_adapter_path(self.lm)
        if path is None:
            return None
        try:
            adapter = load_adapter(path, self.lm, self.layout.identity)
        except Exception as exc:  # a custom system prompt, another dtype...: untrained links
            log.warning("not using the shipped link adapter %s: %s", path.name, exc)
            return None
        if adapter.changes_model:
            log.warning("the shipped link adapter %s changes the model's weights; pass link_adapter=PATH to use it", path.name)
            return None
        return adapter
