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
from kvrag.links import SHIPPED_SPECS, LinkAdapter, apply_adapter, check_adapter, load_adapter, names_no_adapter, shipped_adapter_paths
from kvrag.model import LoadedModel, load_model
from kvrag.options import CHUNK_KINDS, DEFAULT_METHOD, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY, TUNED_METHOD, AnswerOptions
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

        `link_adapter`: the KVLink adapter, and with it the weights served.
        - "auto" (default): the adapter shipped for this model, if one fits it and the layout: for the
          bundled SmolLM2 the tuned one (LoRA, K = 5), whose weights are merged in and whose
          `method="kvlink"` becomes the default method; else the shipped links-only one; else none.
        - "links": only the shipped links-only adapter (the base weights; kvlink uses its links).
        - None (or "none", as on the command line): no adapter, the base weights (default method cacheblend).
        - a path or a `LinkAdapter`: that adapter, checked against this model and layout
          (AdapterMismatchError otherwise).
        An adapter with LoRA or full weights changes the model: the engine serves a merged copy (every
        method, Full Attention included, with its own fingerprint and caches), and kvlink is its default."""
        layout = layout or PromptLayout(lm.tokenizer, **layout_kwargs)
        adapter = _choose_adapter(link_adapter, lm, layout)
        if adapter is not None:
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
        """The KVLink adapter in use (None: none)."""
        return self._link_adapter

    def with_store(self, store: KVStore | str | None) -> "KVRag":
        """Another engine over this one's prepared model (adapter merged, gate passed) and another store:
        no second copy of the weights, no second merge."""
        other = KVRag.__new__(KVRag)
        other._link_adapter, other.check_report = self._link_adapter, self.check_report
        KVRagCore.__init__(other, self.lm, store=store, layout=self.layout, batch_size=self.batch_size)
        return other

    @property
    def default_method(self) -> str:
        """kvlink over a model whose weights a link adapter tuned, else DEFAULT_METHOD."""
        adapter = self._link_adapter
        return TUNED_METHOD if adapter is not None and adapter.changes_model else DEFAULT_METHOD


def _choose_adapter(spec: str | Path | LinkAdapter | None, lm: LoadedModel, layout: PromptLayout) -> LinkAdapter | None:
    """The adapter `link_adapter=spec` names (see `KVRag.__init__`), checked against the model and layout."""
    if names_no_adapter(spec):
        return None
    if isinstance(spec, str) and spec in SHIPPED_SPECS:
        return _shipped_adapter(lm, layout, ("tuned", "links") if spec == "auto" else ("links",))
    adapter = spec if isinstance(spec, LinkAdapter) else load_adapter(spec)
    check_adapter(adapter, lm, layout.identity, where="link adapter" if isinstance(spec, LinkAdapter) else str(spec))
    return adapter


def _shipped_adapter(lm: LoadedModel, layout: PromptLayout, kinds: tuple[str, ...]) -> LinkAdapter | None:
    """The first shipped adapter of these kinds that fits (a custom system prompt or another model: none)."""
    for path in shipped_adapter_paths(lm, kinds):
        try:
            return load_adapter(path, lm, layout.identity)
        except Exception as exc:  # a custom system prompt, another layout version...: try the next, else none
            log.warning("not using the shipped link adapter %s: %s", path.name, exc)
    return None
