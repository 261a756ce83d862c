"""KVRag: store -> stitch -> method -> decode, and the stats of every answer."""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch

from kvrag.cache_backends import KVEntry, KVStore, content_key, open_store
from kvrag.cache import cache_kv, cache_nbytes
from kvrag.decode import DecodeConfig, DecodeState, stream_tokens
from kvrag.errors import ChunkNotFoundError, ContextTooLongError, EmptyRetrievalError
from kvrag.fuse import PrefillOutput, Stitched, full_prefill, recompute, stitch
from kvrag.layout import PromptLayout, Segments
from kvrag.links import LinkAdapter, apply_adapter, check_adapter, load_adapter, resolve_link_rows, shipped_adapter_path
from kvrag.methods import Method, SelectContext, get_method, token_budget
from kvrag.methods.kvlink import KVLink
from kvrag.evict import SnapKV
from kvrag.model import LoadedModel, decoder_of, kvrag_home, load_model
from kvrag.probe import ProbeResult, capture_queries
from kvrag.precompute import KVComputer, LayerStack
from kvrag.rope import Rotary
from kvrag.similarity import neighbours_by_embedding, neighbours_from_index
from kvrag.types import Answer, AnswerStats, Chunk

log = logging.getLogger(__name__)
T = TypeVar("T")

KIND_CHUNK = "chunk"  # a chunk's KV computed after the system prefix alone
KIND_SIMILARITY = "similarity"  # ... after the prefix and its most similar chunks (FusionRAG §3.1)
KIND_PREFIX = "prefix"
CHUNK_KINDS = (KIND_CHUNK, KIND_SIMILARITY)


@dataclass
class PrecomputeReport:
    chunks: int = 0
    computed: int = 0
    already_cached: int = 0
    tokens: int = 0
    seconds: float = 0.0


@dataclass
class Prefill:
    """A prefilled prompt, ready to decode; tests and the benchmark read its logits and selection."""

    output: PrefillOutput
    segments: Segments
    selected: torch.Tensor
    stats: AnswerStats
    chunks: list[Chunk] = field(default_factory=list)
    stitched: Stitched | None = None
    window: ProbeResult | None = None  # the question's queries, captured when eviction is asked for

    @property
    def logits(self) -> torch.Tensor:
        return self.output.logits


class AnswerStream:
    """An iterator of text pieces; `.stats` and `.text` are complete once it is exhausted."""

    def __init__(self, pieces: Iterator[str], stats: AnswerStats, chunk_ids: list[str]) -> None:
        self._pieces = pieces
        self.stats = stats
        self.chunk_ids = chunk_ids
        self.text = ""

    def __iter__(self) -> Iterator[str]:
        for piece in self._pieces:
            self.text += piece
            yield piece

    def answer(self) -> Answer:
        for _ in self:
            pass
        return Answer(text=self.text.strip(), stats=self.stats, chunk_ids=self.chunk_ids)


@dataclass
class _Resolved:
    """The chunks of one request: their token ids, plain-entry keys, and entries already loaded."""

    chunks: list[Chunk]
    token_ids: list[list[int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    loaded: dict[int, KVEntry] = field(default_factory=dict)


def _serialized(fn: Callable[..., T]) -> Callable[..., T]:
    """Run an engine method under the engine's lock (batch/async callers use threads)."""

    @functools.wraps(fn)
    def wrapper(self: "KVRag", *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return fn(self, *args, **kwargs)

    return wrapper


class KVRag:
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
        self._default_links: dict[int, torch.Tensor] = {}
        if not self._link_adapter_auto and link_adapter is not None:
            adapter = link_adapter if isinstance(link_adapter, LinkAdapter) else load_adapter(link_adapter)
            check_adapter(adapter, lm, layout.identity, where=str(link_adapter) if not isinstance(link_adapter, LinkAdapter) else "link adapter")
            lm = apply_adapter(lm, adapter, inplace=_adapter_in_place)
            self._link_adapter = adapter
        if check:
            from kvrag.check import gate

            self.check_report = gate(lm)
        else:
            self.check_report = None
        self.lm = lm
        self.store: KVStore = store if store is not None and not isinstance(store, str) else open_store(store, default_root=kvrag_home() / "kv")
        self.layout = layout
        self.rotary = Rotary(lm.model)
        self.computer = KVComputer(lm, self.rotary)
        self.batch_size = batch_size
        self._chunks: dict[str, Chunk] = {}
        self._prefix: LayerStack | None = None
        # One request at a time touches the model, the registry and the caches; decoding takes the
        # lock per token, so concurrent streams interleave and an abandoned stream holds nothing.
        self._lock = threading.RLock()

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
            path = shipped_adapter_path(self.lm)
            if path is not None:
                try:
                    adapter = load_adapter(path, self.lm, self.layout.identity)
                except Exception as exc:  # a custom system prompt, another dtype...: untrained links
                    log.warning("not using the shipped link adapter %s: %s", path.name, exc)
                else:
                    if adapter.changes_model:
                        log.warning("the shipped link adapter %s changes the model's weights; pass link_adapter=PATH to use it", path.name)
                    else:
                        self._link_adapter = adapter
        return self._link_adapter

    # -- keys and the prefix ------------------------------------------------------------------
    def _key(self, kind: str, token_ids: Sequence[int]) -> str:
        return content_key(self.lm.fingerprint, self.layout.identity, kind, token_ids)

    def _entry_meta(self, kind: str, n: int) -> dict[str, str]:
        return {"model": self.lm.fingerprint, "layout": self.layout.identity, "kind": kind, "tokens": str(n)}

    def _valid(self, entry: KVEntry | None, kind: str, n: int) -> bool:
        """Defence in depth: even under a matching key, an entry from another model/layout is a miss."""
        if entry is None:
            return False
        m = entry.meta
        cfg = self.lm.model.config
        ok = (
            m.get("model") == self.lm.fingerprint
            and m.get("layout") == self.layout.identity
            and m.get("kind") == kind
            and entry.num_tokens == n
            and entry.keys.shape[0] == cfg.num_hidden_layers
        )
        if not ok:
            log.warning("ignoring a cache entry that does not match this model/layout")
        return ok

    def prefix_kv(self) -> LayerStack:
        """The system prefix's KV, computed once per (model, system prompt) and kept in the store."""
        if self._prefix is None:
            ids = self.layout.prefix_ids
            key = self._key(KIND_PREFIX, ids)
            entry = self._store_call("get", key, default=None)
            if self._valid(entry, KIND_PREFIX, len(ids)):
                self._prefix = (entry.keys.to(self.lm.device, self.lm.dtype), entry.values.to(self.lm.device, self.lm.dtype))
            else:
                self._prefix = self.computer.prefix_kv(ids)
                self._store_call("put", key, KVEntry(*self._prefix, meta=self._entry_meta(KIND_PREFIX, len(ids))), default=None)
        return self._prefix

    # -- precompute ---------------------------------------------------------------------------
    def register(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """Remember chunks by id (here and in the store's node-id index) so `answer(chunk_ids=...)` finds them.

        The index maps a user id to the content key of its current text, so a chunk whose text
        changed under the same id resolves to a new key: a miss, never stale KV.
        """
        out = list(chunks)
        with self._lock:
            changed = [c for c in out if self._chunks.get(c.id) != c]
            for c in out:
                self._chunks[c.id] = c
        if changed:
            self._store_call("link", [c.id for c in changed], self._resolve(changed).keys, default=None)
        return out

    def prefetch(self, chunk_ids: Sequence[str] | None = None, chunks: Sequence[Chunk] | None = None) -> None:
        """Start loading these chunks' KV (a tiered store loads in the background; others ignore it)."""
        known = list(chunks or ()) + [self._chunks[i] for i in (chunk_ids or ()) if i in self._chunks]
        keys = self._resolve(known).keys
        unknown = [i for i in (chunk_ids or ()) if i not in self._chunks]
        if unknown:
            keys += [k for k in self._store_call("resolve", unknown, default=[]) if k]
        self._store_call("prefetch", keys, default=None)

    def _store_call(self, name: str, *args: Any, default: Any) -> Any:
        try:
            return getattr(self.store, name)(*args)
        except Exception as exc:  # a store fault never fails a request
            log.warning("store %s failed (%s)", name, exc)
            return default

    @_serialized
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
        """Compute and store the KV of every chunk not cached yet (batched, with a progress bar).

        `kind="similarity"` stores FusionRAG's similarity-guided variant: each chunk's KV computed
        with its `top_n` most similar chunks before it (from `neighbours`, else `index`, else the
        embedding similarity among all chunks this engine knows). Answer with it via `kv_kind="similarity"`.
        """
        t0 = time.perf_counter()
        if kind not in CHUNK_KINDS:
            raise ValueError(f"kind must be one of {CHUNK_KINDS}, got {kind!r}")
        resolved = self._resolve(self.register(chunks), kind)
        report = PrecomputeReport(chunks=len(resolved.chunks))
        missing = [i for i, k in enumerate(resolved.keys) if not self._store_call("contains", k, default=False)]
        report.already_cached = len(resolved.chunks) - len(missing)
        if missing:
            context = None
            if kind == KIND_SIMILARITY:
                context = self._neighbour_context([resolved.chunks[i] for i in missing], neighbours, top_n, index)
            self._compute_and_store(resolved, missing, batch_size, progress, kind, context)
            report.computed = len(missing)
            report.tokens = sum(len(resolved.token_ids[i]) for i in missing)
        report.seconds = time.perf_counter() - t0
        return report

    def _neighbour_context(
        self, chunks: list[Chunk], neighbours: Mapping[str, Sequence[str]] | None, top_n: int, index: Any
    ) -> list[list[int]]:
        if neighbours is None:
            if index is not None:
                neighbours = neighbours_from_index(index, chunks, top_n)
                self.register(index.get(sorted({n for ns in neighbours.values() for n in ns})))
            else:
                neighbours = neighbours_by_embedding(list(self._chunks.values()), top_n)
        unknown = sorted({n for c in chunks for n in neighbours.get(c.id, ()) if n not in self._chunks})
        if unknown:
            raise ChunkNotFoundError(f"neighbour chunk ids not known to the engine: {unknown[:5]}; register() or precompute() them")
        context = []
        for c in chunks:
            ids: list[int] = []
            for n in neighbours.get(c.id, ()):
                ids.extend(self.layout.chunk_ids(self._chunks[n]))
            context.append(ids)
        return context

    def _compute_and_store(
        self,
        resolved: _Resolved,
        idx: list[int],
        batch_size: int | None,
        progress: bool,
        kind: str = KIND_CHUNK,
        context: list[list[int]] | None = None,
    ) -> list[LayerStack]:
        stacks = self.computer.chunk_kv(
            self.prefix_kv(),
            [resolved.token_ids[i] for i in idx],
            batch_size=batch_size or self.batch_size,
            progress=progress,
            context=context,
        )
        for i, (k, v) in zip(idx, stacks):
            ids = resolved.token_ids[i]
            entry = KVEntry(k, v, meta=self._entry_meta(kind, len(ids)), token_ids=torch.tensor(ids, dtype=torch.int64))
            self._store_call("put", self._key(kind, ids), entry, default=None)
        return stacks

    def _resolve(self, chunks: Sequence[Chunk], kind: str = KIND_CHUNK) -> _Resolved:
        res = _Resolved(chunks=list(chunks))
        for c in res.chunks:
            ids = self.layout.chunk_ids(c)
            res.token_ids.append(ids)
            res.keys.append(self._key(kind, ids))
        return res

    def _lookup(self, chunk_ids: Sequence[str] | None, chunks: Sequence[Chunk] | None, allow_empty: bool = False) -> _Resolved:
        """Chunks given with text, or ids known here, or ids the store's node index can resolve."""
        if chunks:
            return self._resolve(self.register(chunks))
        if not chunk_ids and allow_empty:
            return _Resolved(chunks=[])
        if not chunk_ids:
            raise EmptyRetrievalError("no chunks to answer from: pass chunk_ids=[...] or chunks=[...] (retrieval returned nothing?)")
        unknown = [i for i in dict.fromkeys(chunk_ids) if i not in self._chunks]
        from_store: dict[str, KVEntry] = {}
        if unknown:
            keys = self._store_call("resolve", unknown, default=[None] * len(unknown))
            found = [(u, k) for u, k in zip(unknown, keys) if k]
            entries = self._store_call("get_many", [k for _, k in found], default=[None] * len(found)) if found else []
            for (uid, _), entry in zip(found, entries):
                if entry is not None and entry.token_ids is not None and self._valid(entry, KIND_CHUNK, entry.num_tokens):
                    from_store[uid] = entry
            missing = [u for u in unknown if u not in from_store]
            if missing:
                raise ChunkNotFoundError(
                    f"unknown chunk id(s) {missing[:5]}: precompute() them first or pass chunks=[Chunk(...)] with their text"
                )
        res = _Resolved(chunks=[])
        for i, cid in enumerate(chunk_ids):
            if cid in self._chunks:
                chunk = self._chunks[cid]
                ids = self.layout.chunk_ids(chunk)
            else:  # known only to the store: the entry carries the token ids
                entry = from_store[cid]
                ids = entry.token_ids.tolist()
                chunk = Chunk(cid, self.lm.tokenizer.decode(ids), metadata={"source": "store"})
                res.loaded[i] = entry
            res.chunks.append(chunk)
            res.token_ids.append(ids)
            res.keys.append(self._key(KIND_CHUNK, ids))
        return res

    # -- answering ----------------------------------------------------------------------------
    @_serialized
    def prefill(
        self,
        question: str,
        chunk_ids: Sequence[str] | None = None,
        *,
        chunks: Sequence[Chunk] | None = None,
        method: str | Method = "reuse",
        recompute_ratio: float = 0.15,
        kv_kind: str = KIND_CHUNK,
        evict: SnapKV | None = None,
        allow_empty: bool = False,
        **method_params: Any,
    ) -> Prefill:
        """Everything up to the first token's logits: load, stitch, select, recompute.

        With `evict`, the question's queries are captured during the pass so the cache can be
        evicted after the first token (in `decode`).
        """
        t0 = time.perf_counter()
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        meth = get_method(method, **method_params)
        stats = AnswerStats(method=meth.name)
        resolved = self._lookup(chunk_ids, chunks, allow_empty)
        links, link_embeds = 0, None
        if isinstance(meth, KVLink):
            adapter = self.link_adapter
            links, link_embeds = resolve_link_rows(self.lm, adapter, meth.link_tokens, len(resolved.token_ids), self._default_links)
        segments = self.layout.segments(resolved.token_ids, question, links=links)
        self._check_length(segments)
        stats.prompt_tokens = segments.total_len
        stats.context_tokens = segments.chunk_tokens
        stats.question_tokens = len(segments.question)
        prefix = self.prefix_kv()

        if meth.full_attention:
            with self._window(evict, segments) as window:
                out = full_prefill(self.lm, prefix, segments)
            if window is not None:
                window.key_positions = torch.arange(segments.total_len)
            stats.recomputed_tokens = stats.context_tokens
            stats.chunk_prefill_tokens = stats.context_tokens
            stats.prefill_s = time.perf_counter() - t0
            stats.ttft_s = stats.prefill_s
            return Prefill(out, segments, torch.arange(len(segments.prefix), segments.context_len), stats, resolved.chunks, window=window)

        stacks = self._load_chunks(resolved, stats, kv_kind)
        t1 = time.perf_counter()
        stitched = stitch(prefix, stacks, segments, self.rotary)
        t2 = time.perf_counter()
        ctx = SelectContext(self.lm, self.rotary, stitched)
        kept = meth.keep(ctx)
        if kept is not None:  # a sparsifying method: the cache handed to decoding holds only these
            stitched = stitched.keep(kept)
            ctx = SelectContext(self.lm, self.rotary, stitched)
        n_chunk = int(stitched.chunk_positions().numel())
        stats.kept_kv_ratio = n_chunk / max(1, stats.context_tokens)
        selected = meth.select(ctx, token_budget(recompute_ratio, n_chunk))
        t3 = time.perf_counter()
        with self._window(evict, segments) as window:
            out = recompute(self.lm, stitched, selected, update=meth.update, link_embeds=link_embeds)
        if window is not None:
            window.key_positions = torch.cat([stitched.positions, torch.arange(segments.context_len, segments.total_len)])
        t4 = time.perf_counter()
        stats.stitch_s, stats.select_s, stats.recompute_s = t2 - t1, t3 - t2, t4 - t3
        stats.recomputed_tokens = int(selected.numel())
        stats.ttft_s = t4 - t0
        return Prefill(out, segments, selected, stats, resolved.chunks, stitched, window)

    @_serialized
    def stitched(self, chunks: Sequence[Chunk], segments: Segments) -> Stitched:
        """The stitched context of `chunks` laid out as `segments` (store hits; misses computed and
        kept), as `prefill` builds it; KVLink training reads its context KV this way."""
        resolved = self._resolve(chunks)
        if [list(c) for c in segments.chunks] != resolved.token_ids:
            raise ValueError("segments do not hold these chunks' token ids")
        return stitch(self.prefix_kv(), self._load_chunks(resolved, AnswerStats()), segments, self.rotary)

    def _load_chunks(self, resolved: _Resolved, stats: AnswerStats, kind: str = KIND_CHUNK) -> list[LayerStack]:
        """Stored KV of each chunk: `kind` entries first, then plain ones, then computed (and kept)."""
        if kind not in CHUNK_KINDS:
            raise ValueError(f"kv_kind must be one of {CHUNK_KINDS}, got {kind!r}")
        t = time.perf_counter()
        stacks: list[LayerStack | None] = [None] * len(resolved.chunks)
        kinds = [kind] if kind == KIND_CHUNK else [kind, KIND_CHUNK]
        for k in kinds:
            todo = [i for i, st in enumerate(stacks) if st is None]
            if not todo:
                break
            if k == KIND_CHUNK and resolved.loaded:
                entries = {i: resolved.loaded[i] for i in todo if i in resolved.loaded}
                todo = [i for i in todo if i not in entries]
            else:
                entries = {}
            keys = [self._key(k, resolved.token_ids[i]) for i in todo]
            entries.update(zip(todo, self._store_call("get_many", keys, default=[None] * len(keys)) if keys else []))
            for i, e in entries.items():
                if self._valid(e, k, len(resolved.token_ids[i])):
                    stats.cache_hits += 1
                    stats.bytes_loaded += e.nbytes
                    stacks[i] = (e.keys.to(self.lm.device, self.lm.dtype), e.values.to(self.lm.device, self.lm.dtype))
        stats.path = kind
        stats.load_s = time.perf_counter() - t
        misses = [i for i, st in enumerate(stacks) if st is None]
        if misses:
            stats.cache_misses = len(misses)
            computed = self._compute_and_store(resolved, misses, None, progress=False)
            for i, st in zip(misses, computed):
                stacks[i] = st
            stats.chunk_prefill_tokens = sum(len(resolved.token_ids[i]) for i in misses)
        return stacks  # type: ignore[return-value]

    @contextmanager
    def _window(self, evict: SnapKV | None, segments: Segments) -> Iterator[ProbeResult | None]:
        """Capture the observation window's queries at every layer during a prefill pass."""
        if evict is None:
            yield None
            return
        n_q = len(segments.question)
        w = min(n_q, evict.window or n_q)
        positions = torch.arange(segments.total_len - w, segments.total_len)
        result = ProbeResult(positions=positions, key_positions=torch.empty(0, dtype=torch.long))
        layers = range(len(decoder_of(self.lm.model).layers))
        with capture_queries(self.lm, self.rotary, layers, result, rows=slice(-w, None)):
            yield result

    def _check_length(self, segments: Segments, reserve: int = 0) -> None:
        limit = self.lm.max_context
        if segments.total_len + reserve > limit:
            raise ContextTooLongError(
                f"prompt is {segments.total_len} tokens (+{reserve} to generate) but the model's context is {limit}: "
                "retrieve fewer or shorter chunks"
            )

    def stream(
        self,
        question: str,
        chunk_ids: Sequence[str] | None = None,
        *,
        chunks: Sequence[Chunk] | None = None,
        method: str | Method = "reuse",
        recompute_ratio: float = 0.15,
        kv_kind: str = KIND_CHUNK,
        evict: SnapKV | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | str | None = None,
        seed: int | None = None,
        **method_params: Any,
    ) -> AnswerStream:
        """Like `answer`, but returns an iterator of text pieces (stats complete at the end)."""
        pre = self.prefill(
            question,
            chunk_ids,
            chunks=chunks,
            method=method,
            recompute_ratio=recompute_ratio,
            kv_kind=kv_kind,
            evict=evict,
            **method_params,
        )
        return self.decode(pre, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed, evict=evict)

    def decode(
        self,
        pre: Prefill,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | str | None = None,
        seed: int | None = None,
        evict: SnapKV | None = None,
    ) -> AnswerStream:
        """Decode from a prefill (what `stream` does after `prefill`); the benchmark calls the two apart.

        `evict` (SnapKV) bounds the cache after the first token: the first token comes from the
        prefill's logits, every later one attends to the evicted cache.
        """
        cfg = DecodeConfig(max_new_tokens, temperature, top_p, [stop] if isinstance(stop, str) else list(stop or ()), seed)
        if evict is not None:
            if pre.window is None:
                raise ValueError("pass the same evict= to prefill() so the question's queries are captured")
            seg = pre.segments
            protected = (pre.window.key_positions < len(seg.prefix)) | (pre.window.key_positions >= seg.context_len)
            if seg.links:  # KVLink link tokens are kept like the question
                protected |= torch.isin(pre.window.key_positions, torch.tensor(seg.link_positions()))
            pre.output.cache = evict.apply(
                pre.output.cache, pre.window.queries, pre.window.scaling, pre.window.positions, pre.window.key_positions, protected
            )
            kept_chunk = cache_kv(pre.output.cache)[0][0].shape[2] - int(protected.sum())
            pre.stats.kept_kv_ratio = min(pre.stats.kept_kv_ratio, kept_chunk / max(1, pre.stats.context_tokens))
        ids = [c.id for c in pre.chunks]
        return AnswerStream(self._decode(pre, cfg), pre.stats, ids)

    def _decode(self, pre: Prefill, cfg: DecodeConfig) -> Iterator[str]:
        state = DecodeState()
        t = time.perf_counter()
        tokens = stream_tokens(self.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, self.lm.max_context)
        while True:
            with self._lock:
                piece = next(tokens, None)
            if piece is None:
                break
            yield piece
        pre.stats.kv_bytes = cache_nbytes(pre.output.cache)
        pre.stats.decode_s = time.perf_counter() - t
        pre.stats.generated_tokens = len(state.token_ids)

    def match_prompt(self, prompt: str) -> tuple[list[Chunk], str]:
        """Known chunks whose text appears verbatim in `prompt` (in prompt order) and the text after the last.

        This is how a drop-in LLM reuses cached chunks inside a prompt a framework built itself.
        """
        found: list[tuple[int, int, Chunk]] = []
        for chunk in self._chunks.values():
            if chunk.text and (at := prompt.find(chunk.text)) >= 0:
                found.append((at, at + len(chunk.text), chunk))
        found.sort(key=lambda f: (f[0], -f[1]))
        picked: list[tuple[int, int, Chunk]] = []
        for start, end, chunk in found:
            if not picked or start >= picked[-1][1]:  # no overlaps: a chunk inside another is skipped
                picked.append((start, end, chunk))
        rest = prompt[picked[-1][1] :].strip() if picked else prompt
        return [c for _, _, c in picked], rest

    def complete(self, prompt: str, method: str | Method = "reuse", **kwargs: Any) -> AnswerStream:
        """Answer a ready-made prompt (what a framework's LLM call receives).

        Known chunks found verbatim in it are reused (`stats.path == "prompt-match"`), the text after
        the last one is the question; the text around them that belongs to no chunk is dropped.
        With no known chunk, the whole prompt is read as the question (`stats.path == "plain"`).
        """
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        decode_keys = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "evict")
        dec = {k: kwargs.pop(k) for k in decode_keys if k in kwargs}
        with self._lock:
            chunks, question = self.match_prompt(prompt)
        if not chunks:
            pre = self.prefill(prompt, method="full", allow_empty=True, evict=dec.get("evict"))
            pre.stats.path = "plain"
        else:
            pre = self.prefill(question or prompt, chunks=chunks, method=method, evict=dec.get("evict"), **kwargs)
            pre.stats.path = "prompt-match"
        return self.decode(pre, **dec)

    def answer(self, question: str, chunk_ids: Sequence[str] | None = None, **kwargs: Any) -> Answer:
        """Answer `question` from the given chunks; `.stats` tells what it cost and which path it took."""
        return self.stream(question, chunk_ids, **kwargs).answer()

    def chunk(self, chunk_id: str) -> Chunk:
        try:
            return self._chunks[chunk_id]
        except KeyError:
            raise ChunkNotFoundError(f"unknown chunk id {chunk_id!r}") from None

    @property
    def home(self) -> Path:
        return kvrag_home()
