"""KVRag: the engine users hold. Model preparation (link adapters, the correctness gate) on top of
`KVRagCore`, whose two rooms hold the rest: the KV repository and the request pipeline.

Full Attention is always the base model: a link adapter that changes weights (LoRA) is served on
kvlink's fast path only, by a second core over a merged copy (its own fingerprint, so its own chunk
KV) that shares every untouched parameter with the base model."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence


from kvrag.cache_backends import KVStore
from kvrag.check.default import default_for
from kvrag.check.gate import gate
from kvrag.chat import Conversation
from kvrag.core import ADAPTER_DEFAULT as _ADAPTER_DEFAULT, AdapterPath, KVRagCore
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.decode.lean import use_decode_weights
from kvrag.kv.layout import PromptLayout, make_layout
from kvrag.kv.layout_options import LayoutOptions  # noqa: F401 (the layout parameter's type)
from kvrag.defaults import SHIPPED_SPECS, DefaultSetting, names_no_adapter
from kvrag.errors import AdapterMismatchError
from kvrag.link_adapter import LinkAdapter, apply_adapter, check_adapter, load_adapter, shipped_adapter_paths
from kvrag.model.loading import LoadedModel, load_model
from kvrag.kv.kinds import CHUNK_KINDS, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY
from kvrag.options import TUNED_METHOD, AnswerOptions
from kvrag.pipeline import AnswerStream, Prefill
from kvrag.kv.repository import Resolved
from kvrag.kv.repository import PrecomputeReport
from kvrag.types import Chunk

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
        layout: "PromptLayout | LayoutOptions | dict | str | None" = None,
        batch_size: int = 8,
        check: bool = True,
        link_adapter: str | Path | LinkAdapter | None = "auto",
        decode_weights: str | None = None,
        prefix_cache: PrefixCache | None = None,
        calibrate: bool | None = None,
        **layout_kwargs: Any,
    ) -> None:
        """`check=True` runs the per-model correctness gate (`kvrag.check.checks.gate`) once per model
        fingerprint and device type (its verdict is cached under $KVRAG_HOME/checks) and raises
        UnsupportedModelError, naming the failing check, for a model kvrag cannot serve exactly.

        `link_adapter`: the KVLink adapter `method="kvlink"` uses.
        - "auto" (default): the links-only adapter shipped for this model, if one fits it and the
          layout (the base weights; the default stays the calibrated training-free setting);
        - "links": the same, and nothing else;
        - "tuned": the shipped reuse-tuned adapter (LoRA, K = 5) on kvlink's fast path, else none;
        - None (or "none", as on the command line): no adapter;
        - a path or a `LinkAdapter`: that adapter, checked against this model and layout
          (AdapterMismatchError otherwise).
        An adapter with LoRA or full weights never changes what the other methods read: kvlink
        answers over a merged copy of the weights (its own fingerprint and chunk KV, `stats.weights
        == "adapter"`), every other method, Full Attention included, over the base weights; kvlink
        is then the default method, since the caller asked for the adapter.

        `decode_weights`: what the decode steps read after the first token, for every engine over this
        model: "model" (its own weights: answers are the model's) or "int8" (on the CPU, ~1.4x the
        tokens/s of the bundled model; the answers may part from the model's own after some tokens:
        kvrag.decode.int8, `kvrag bench-decode`); None (default): as chosen before, else "model".
        Prefill always reads the model's own weights. `stats.decode_weights` says what an answer used.

        `prefix_cache`: the exact prefix cache finished turns are kept in (see `KVRagCore`).

        `layout`: how the prompt is laid out, one object (`kvrag.LayoutOptions`: place of the documents,
        instruction, chunk template, question template), or a dict, a preset name ("default", "v1"), JSON
        text or a JSON file; validated here (a chunk template without `{text}` raises ValueError naming
        it). The keywords `system_prompt`, `chunk_template`, `untitled_chunk_template` and
        `question_template` change one field of it. Chunk KV is keyed by the layout's prefix and the
        chunk's own tokens under it, so two layouts never share KV that differs.

        `calibrate`: what a request that names no method gets. None (default): $KVRAG_CALIBRATE, else on:
        the setting this model's calibration chose (`default_setting`; kvrag.check.calibrate: run on the
        first such request, once per model and device type, kept for every later process); False: the
        fixed DEFAULT_METHOD at DEFAULT_RATIO. A named method always wins."""
        layout = make_layout(lm.tokenizer, layout, **layout_kwargs)
        adapter = _choose_adapter(link_adapter, lm, layout)
        self._link_adapter = adapter
        self._calibrate = calibrate
        self.check_report = gate(lm) if check else None
        super().__init__(lm, store=store, layout=layout, batch_size=batch_size, prefix_cache=prefix_cache)
        self._fast: AdapterPath | None = None
        if adapter is not None and adapter.changes_model:
            self._fast = AdapterPath(apply_adapter(lm, adapter), self, adapter)
        if decode_weights is not None:
            for model in [lm.model] + ([self._fast.lm.model] if self._fast is not None else []):
                use_decode_weights(model, decode_weights)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        store: KVStore | str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        check: bool = True,
        link_adapter: str | Path | LinkAdapter | None = "auto",
        decode_weights: str | None = None,
        calibrate: bool | None = None,
        **kwargs: Any,
    ) -> "KVRag":
        """Load a model (default: the bundled SmolLM2-135M-Instruct) and open a store (default: disk under $KVRAG_HOME).

        `device`: "auto" (CUDA when a GPU is there, else CPU), "cuda", "cuda:N" or "cpu". `dtype`:
        "auto" (bfloat16 on CUDA, float32 on CPU), "bfloat16", "float16" or "float32". Stored
        entries record their dtype and are cast to the engine's on load. `check=False` skips the
        per-model correctness gate (see `KVRag.__init__`). `link_adapter`, `decode_weights`, `layout`, `calibrate`
        (in `kwargs`): see `KVRag.__init__`.
        """
        lm = load_model(model, device=device, dtype=dtype)
        return cls(lm, store=store, check=check, link_adapter=link_adapter, decode_weights=decode_weights, calibrate=calibrate, **kwargs)

    @property
    def link_adapter(self) -> LinkAdapter | None:
        """The KVLink adapter in use (None: none)."""
        return self._link_adapter

    @property
    def adapter_lm(self) -> LoadedModel | None:
        """The merged weights kvlink answers with, when the adapter changes weights (else None)."""
        return self._fast.lm if self._fast is not None else None

    def with_store(self, store: KVStore | str | None) -> "KVRag":
        """Another engine over this one's prepared model (gate passed, adapter merged) and another
        store: no second copy of the weights, no second merge."""
        other = KVRag.__new__(KVRag)
        other._link_adapter, other.check_report, other._calibrate = self._link_adapter, self.check_report, self._calibrate
        KVRagCore.__init__(other, self.lm, store=store, layout=self.layout, batch_size=self.batch_size, prefix_cache=self.prefix_cache)
        other._fast = None if self._fast is None else AdapterPath(self._fast.lm, other, self._link_adapter)
        return other

    @property
    def default_setting(self) -> DefaultSetting:
        """What a request that names no method gets: kvlink when the caller chose a link adapter that
        encodes the chunks itself (LoRA or full weights everywhere), else this model's calibrated setting
        (calibrating it now if no process has; see `calibrate` in `__init__`; kvlink with this engine's
        adapter is among its candidates), or the fixed one with calibration off."""
        if self._asked_for_adapter:
            return _ADAPTER_DEFAULT
        setting = default_for(self.lm, self._calibrate, adapter=self.calibration_adapter)
        assert setting is not None  # waiting, it always answers
        return setting

    def peek_default(self) -> DefaultSetting | None:
        """`default_setting` where it is known without calibrating or waiting for one (None: not yet)."""
        if self._asked_for_adapter:
            return _ADAPTER_DEFAULT
        return default_for(self.lm, self._calibrate, wait=False, adapter=self.calibration_adapter)

    @property
    def _asked_for_adapter(self) -> bool:
        """An adapter that encodes the chunks itself was asked for: kvlink is then the default, uncalibrated."""
        return self._fast is not None and not self._fast.shares_chunks

    @property
    def calibration_adapter(self) -> LinkAdapter | None:
        """The link adapter a calibration measures kvlink with: this engine's, where it reads the base chunk KV."""
        adapter = self._link_adapter
        return adapter if adapter is not None and adapter.reads_base_chunks else None

    def calibrate_default(self, progress: Callable[[str], None] | None = None) -> tuple[DefaultSetting, dict[str, Any]]:
        """Measure this model's default afresh (kvlink with this engine's adapter among the candidates), keep it
        for every process, and return it with the calibration's result."""
        from kvrag.check.default import calibrate_model

        return calibrate_model(self.lm, progress=progress, adapter=self.calibration_adapter)

    # -- the adapter's fast path ---------------------------------------------------------------------
    def _prefill_resolved(self, question: str | Conversation, resolved: Resolved, opts: AnswerOptions, documents: bool = True) -> Prefill:
        """kvlink over the adapter's weights when there are such weights and the context is long
        enough to reuse; everything else (Full Attention above all) over the base weights."""
        fast = self._fast
        if fast is None or opts.resolved_method().name != TUNED_METHOD or opts.kv_kind != KIND_CHUNK or not documents:
            return super()._prefill_resolved(question, resolved, opts, documents)
        if sum(len(ids) for ids in resolved.token_ids) == 0 or opts.whole_reason_for(resolved):
            return super()._prefill_resolved(question, resolved, opts, documents)  # read whole, over the base weights
        pre = fast._prefill_resolved(question, fast.rekey(resolved), opts)
        pre.stats.weights = "adapter"
        return pre

    def decode(self, pre: Prefill, *, options: AnswerOptions | None = None, **kwargs: Any) -> AnswerStream:
        if pre.stats.weights == "adapter" and self._fast is not None:
            return self._fast.decode(pre, options=options, **kwargs)
        return super().decode(pre, options=options, **kwargs)

    def precompute(
        self,
        chunks: Iterable[Chunk],
        batch_size: int | None = None,
        progress: bool = True,
        kind: str = KIND_CHUNK,
        neighbours: Mapping[str, Sequence[str]] | None = None,
        top_n: int = 2,
        index: Any = None,
    ) -> PrecomputeReport:
        """`KVRagCore.precompute`; with a weight-changing adapter, the adapter's chunk KV too (kvlink reads it)."""
        chunks = list(chunks)
        report = super().precompute(chunks, batch_size, progress, kind, neighbours, top_n, index)
        if self._fast is not None and kind == KIND_CHUNK and not self._fast.shares_chunks:
            with self._fast.lm.lock:
                self._fast.repo.precompute(chunks, batch_size, progress, kind, None, top_n, None)
        return report

    def forget(self, chunks: Sequence[Chunk]) -> int:
        texts = [c for c in chunks if c.text.strip()]
        self.check_links_readable([c.id for c in texts])  # before the fast path forgets anything: whole or not at all
        deleted = 0
        if self._fast is not None and not self._fast.shares_chunks:  # before the base forgets them: the registry is shared
            deleted += self._fast.repo.forget(self._fast.repo.resolve(texts))
        return deleted + super().forget(chunks)


def _choose_adapter(spec: str | Path | LinkAdapter | None, lm: LoadedModel, layout: PromptLayout) -> LinkAdapter | None:
    """The adapter `link_adapter=spec` names (see `KVRag.__init__`), checked against the model and layout."""
    if names_no_adapter(spec):
        return None
    if isinstance(spec, str) and spec in SHIPPED_SPECS:
        return _shipped_adapter(lm, layout, ("tuned",) if spec == "tuned" else ("links",), quiet=spec == "auto")
    adapter = spec if isinstance(spec, LinkAdapter) else load_adapter(spec)
    check_adapter(adapter, lm, layout.adapter_identities, where="link adapter" if isinstance(spec, LinkAdapter) else str(spec))
    return adapter


def shipped_calibration_adapter(lm: LoadedModel) -> LinkAdapter | None:
    """The adapter an engine with the default `link_adapter="auto"` and the default layout calibrates with (the
    shipped links-kind adapter, where it reads the base chunk KV), for a calibration run without an engine."""
    adapter = _shipped_adapter(lm, make_layout(lm.tokenizer, None), ("links",), quiet=True)
    return adapter if adapter is not None and adapter.reads_base_chunks else None


def _shipped_adapter(lm: LoadedModel, layout: PromptLayout, kinds: tuple[str, ...], quiet: bool = False) -> LinkAdapter | None:
    """The first shipped adapter of these kinds that fits (another layout or model: none). The shipped adapters
    were trained with one layout (kvrag.kv.layout_options.V1_LAYOUT): under any other, kvlink has no adapter;
    `quiet` ("auto": the default method never needs one) says so at info level, an adapter asked for by name
    as a warning."""
    for path in shipped_adapter_paths(lm, kinds):
        try:
            return load_adapter(path, lm, layout.adapter_identities)
        except AdapterMismatchError as exc:  # trained for another layout: expected under every layout but its own
            (log.info if quiet else log.warning)("not using the shipped link adapter %s: %s", path.name, exc)
        except Exception as exc:  # a damaged file...: try the next, else none
            log.warning("not using the shipped link adapter %s: %s", path.name, exc)
    return None
