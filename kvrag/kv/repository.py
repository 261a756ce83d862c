"""The KV repository: cache keys, entry validation, the prefix KV, and load / compute / store (chunk
ids: kvrag.kv.registry).

Everything a request needs from storage goes through here, so the pipeline sees only stacks of KV
tensors: what is in the store is validated before use, what is missing is computed and written
back, and a store fault is a logged miss (see `GuardedStore`), never a failed request.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence, Sized

import torch

from kvrag.cache_backends import FORMAT_VERSION, KVEntry, KVStore, content_key, entry_bytes_bound
from kvrag.kv.registry import ChunkRegistry, Resolved, scope_salt
from kvrag.kv.entry_check import all_finite, entry_problem, kv_shape, mark_finite
from kvrag.errors import ChunkNotFoundError, ContextTooLongError
from kvrag.cache_backends.format import storage_of
from kvrag.cache_backends.guarded import GuardedStore
from kvrag.kv.layout import PromptLayout
from kvrag.model.loading import LoadedModel
from kvrag.kv.kinds import CHUNK_KINDS, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY
from kvrag.kv.precompute import KVComputer
from kvrag.model.cache import LayerStack
from kvrag.timing import clock
from kvrag.kv.similarity import neighbours_by_embedding, neighbours_from_index
from kvrag.types import AnswerStats, Chunk
from kvrag.version import __version__

log = logging.getLogger(__name__)

# What a key is made of beyond the tokens: bump KEY_SCHEMA when the meaning of an entry changes.
KEY_SCHEMA = "kvrag-key-2"
QUESTION_ROOM = 64  # tokens kept free for a question when checking that a chunk fits the context
# precompute takes chunks this many at a time: registered, tokenised, looked up, computed and stored
# before the next group is read (each forward batch of a group is stored as soon as it is computed)
STORE_GROUP = 128


@dataclass
class PrecomputeReport:
    chunks: int = 0
    computed: int = 0
    already_cached: int = 0
    tokens: int = 0
    seconds: float = 0.0
    not_stored: list[str] = field(default_factory=list)  # ids computed but not in the store afterwards (store down?)


def check_fits(lm: LoadedModel, layout: PromptLayout, chunks: Sequence[Chunk], token_ids: Sequence[Sequence[int]]) -> None:
    """A chunk longer than the model's context (less the prefix and room for a question) is refused before any compute."""
    room = lm.max_context - len(layout.prefix_ids) - QUESTION_ROOM
    for c, ids in zip(chunks, token_ids):
        if len(ids) > room:
            raise ContextTooLongError(
                f"chunk {c.id!r} has {len(ids)} tokens but at most {room} fit in the model's context with a question: "
                "split it into smaller chunks (kvrag.ingest.documents caps chunks at 256 tokens by default)"
            )


def _progress_bar(progress: Any, total: int | None) -> tuple[Any, bool]:
    """(bar, whether it is ours to close) for a `progress` argument: True (a new bar), False/None
    (none), or a tqdm-like object (used as it is)."""
    if progress is None or progress is False:
        return None, False
    if progress is True:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="chunk KV", unit="chunk"), True
    return progress, False


def _groups(chunks: Iterable[Chunk], size: int) -> Iterator[list[Chunk]]:
    """`chunks` in lists of `size` (the last shorter), read only as far as each list needs."""
    it = iter(chunks)
    while True:
        group = list(itertools.islice(it, size))
        if not group:
            return
        yield group


def on_host(entry: KVEntry, pin: bool) -> LayerStack:
    """An entry's tensors where the store put them, for a layer feed to copy layer by layer: host
    tensors pinned when `pin` (the disk and host tiers already hand out pinned buffers on CUDA), so
    each layer's copy is an asynchronous DMA; tensors already on the device stay there."""
    keys, values = entry.keys, entry.values
    if pin and keys.device.type == "cpu" and not keys.is_pinned():
        keys = keys.pin_memory()
    if pin and values.device.type == "cpu" and not values.is_pinned():
        values = values.pin_memory()
    return keys, values


class KVRepository(ChunkRegistry):
    """Chunks' KV: keys from (model, layout, kind, token ids), validated entries, the prefix, misses
    computed and stored; chunks by id come from `ChunkRegistry`."""

    def __init__(
        self, lm: LoadedModel, store: KVStore, layout: PromptLayout, computer: KVComputer, batch_size: int = 8, layerwise: bool | None = None
    ) -> None:
        """`layerwise`: load chunk KV layer by layer, overlapped with the passes (kvrag.fuse.layer_feed); None
        (default): on CUDA, where the copies hide behind compute, off on the CPU (nothing to hide)."""
        self.lm = lm
        self.layerwise = layerwise
        self.store = store
        limit = getattr(store, "limit_entry_bytes", None)
        if callable(limit):  # an entry larger than this model could write is refused before it is read
            limit(entry_bytes_bound(lm.max_context, *kv_shape(lm), lm.dtype.itemsize))
        self.guarded = GuardedStore(store)
        self.layout = layout
        self.computer = computer
        self.batch_size = batch_size
        self.chunks: dict[str, Chunk] = {}
        self.similarity_context: dict[str, str] = {}  # chunk id -> digest of the neighbours its similarity entry was computed after
        self._prefix: LayerStack | None = None
        self._other_prefixes: dict[tuple[str, tuple[int, ...]], LayerStack] = {}
        self._registry_lock = threading.Lock()

    # -- keys and validation ------------------------------------------------------------------
    def key(self, kind: str, token_ids: Sequence[int], context: str = "") -> str:
        """The store key of an entry: model, layout, kind, tokens, and everything else its KV
        depends on (storage quantisation, entry format, code version, a similarity entry's context)."""
        kept = storage_of(getattr(self.store, "quantize", False))
        storage = "exact" if kept == "none" else kept
        return content_key(
            self.lm.fingerprint, self.layout.identity, kind, token_ids, KEY_SCHEMA, FORMAT_VERSION, __version__, storage, context
        )

    def similarity_key(self, chunk: Chunk, token_ids: Sequence[int]) -> str | None:
        """The key of a chunk's similarity-guided entry for the neighbour set it was precomputed with."""
        context = self.similarity_context.get(chunk.id)
        return None if context is None else self.key(KIND_SIMILARITY, token_ids, context)

    def entry_meta(self, kind: str, n: int) -> dict[str, str]:
        return {"model": self.lm.fingerprint, "layout": self.layout.identity, "kind": kind, "tokens": str(n)}

    def valid(self, entry: KVEntry | None, kind: str, n: int, token_ids: Sequence[int] | None = None) -> bool:
        """Defence in depth: under a matching key, an entry must still be this model's, for these
        tokens, of the right shape, and finite; anything else is a miss (and gets replaced)."""
        if entry is None:
            return False
        problem = entry_problem(entry, self.lm, self.layout.identity, kind, token_ids, n)
        if problem is not None:
            log.warning("ignoring a %s cache entry (%d tokens): %s; it will be recomputed and replaced", kind, n, problem)
        return problem is None

    def _to_device(self, entry: KVEntry) -> LayerStack:
        return entry.keys.to(self.lm.device, self.lm.dtype), entry.values.to(self.lm.device, self.lm.dtype)

    @property
    def layerwise_load(self) -> bool:
        """Whether requests load chunk KV layer by layer (see `__init__`)."""
        return self.lm.device.type == "cuda" if self.layerwise is None else bool(self.layerwise)

    # -- the prefix -----------------------------------------------------------------------------
    def prefix_kv(self, ids: Sequence[int] | None = None) -> LayerStack:
        """The system prefix's KV, computed once per (model, system prompt) and kept in the store;
        another prefix (a caller's system message, plain chat's template) is computed once and kept
        in memory (the last few), per cache salt (request_scoped_chunks: one tenant's system message
        never makes another's request faster)."""
        if ids is not None and list(ids) != list(self.layout.prefix_ids):
            key = (scope_salt(), tuple(ids))
            kv = self._other_prefixes.get(key)
            if kv is None:
                if len(self._other_prefixes) >= 16:
                    self._other_prefixes.pop(next(iter(self._other_prefixes)))
                kv = self._other_prefixes[key] = self.computer.prefix_kv(key[1])
            return kv
        if self._prefix is None:
            ids = self.layout.prefix_ids
            key = self.key(KIND_PREFIX, ids)
            entry = self.guarded.get(key)
            if self.valid(entry, KIND_PREFIX, len(ids), ids):
                self._prefix = self._to_device(entry)
            else:
                self._prefix = self.computer.prefix_kv(ids)
                token_ids = torch.tensor(ids, dtype=torch.int64)
                self.guarded.put(key, KVEntry(*self._prefix, meta=self.entry_meta(KIND_PREFIX, len(ids)), token_ids=token_ids))
        return self._prefix

    # -- precompute -----------------------------------------------------------------------------
    def precompute(
        self,
        chunks: Iterable[Chunk],
        batch_size: int | None = None,
        progress: Any = True,
        kind: str = KIND_CHUNK,
        neighbours: Mapping[str, Sequence[str]] | None = None,
        top_n: int = 2,
        index: Any = None,
    ) -> PrecomputeReport:
        """Compute and store the KV of every chunk not cached yet (see `KVRag.precompute`).

        It streams: `chunks` (any iterable, a generator too) is taken STORE_GROUP chunks at a time,
        each group tokenised, checked against the context and looked up in the store, every forward
        batch's KV written to the store as soon as it is computed and then dropped, and the group
        registered (its ids linked in the store's id index) once its KV is stored. Memory does not
        grow with the number of chunks, and an interrupted precompute keeps every batch it stored (a
        rerun finds them cached) and links no id to KV it did not store. A chunk too long for the context (or
        without text) is refused before its group is computed; the groups before it stay stored.
        `progress`: True (a bar of its own), False, or a tqdm-like object whose `update(n)` is called
        as chunks are found cached or computed. For `kind="similarity"` every chunk is registered
        and the neighbours found before the first group is computed.
        """
        t0 = time.perf_counter()
        if kind not in CHUNK_KINDS:
            raise ValueError(f"kind must be one of {CHUNK_KINDS}, got {kind!r}")
        source: Iterable[Chunk] = chunks
        if kind == KIND_SIMILARITY:  # the neighbours are part of the entry's identity (and key)
            source = self.register(chunks)
            neighbours = self._neighbour_map(source, neighbours, top_n, index)
        report = PrecomputeReport()
        bar, own_bar = _progress_bar(progress, len(source) if isinstance(source, Sized) else None)
        try:
            for group in _groups(source, STORE_GROUP):
                self._precompute_group(group, batch_size, bar, kind, neighbours, top_n, report)
        finally:
            if own_bar:
                bar.close()
        report.seconds = time.perf_counter() - t0
        return report

    def _precompute_group(
        self,
        group: list[Chunk],
        batch_size: int | None,
        bar: Any,
        kind: str,
        neighbours: Mapping[str, Sequence[str]] | None,
        top_n: int,
        report: PrecomputeReport,
    ) -> None:
        resolved = self.resolve(group, kind, memo=False)  # precompute fills no memo: the chunks may never be asked
        if kind == KIND_SIMILARITY:
            context: list[list[int]] | None = [self._context_ids(c, neighbours or {}) for c in group]
            for i, (c, ctx) in enumerate(zip(group, context)):
                self.similarity_context[c.id] = content_key(f"top_n={top_n}", ctx)
                resolved.keys[i] = self.similarity_key(c, resolved.token_ids[i])
        else:
            context = None
        missing = [i for i, k in enumerate(resolved.keys) if not self.guarded.contains(k)]
        if bar is not None and len(group) > len(missing):
            bar.update(len(group) - len(missing))
        if missing:
            check_fits(self.lm, self.layout, [resolved.chunks[i] for i in missing], [resolved.token_ids[i] for i in missing])
            self.compute_and_store(resolved, missing, batch_size, bar, kind, [context[i] for i in missing] if context else None, keep=False)
            report.not_stored += [resolved.chunks[i].id for i in missing if not self.guarded.contains(resolved.keys[i])]
            report.computed += len(missing)
            report.tokens += sum(len(resolved.token_ids[i]) for i in missing)
        if kind != KIND_SIMILARITY:  # registered (and linked in the store's id index) once its KV is stored
            self._register_resolved(group, resolved.keys if kind == KIND_CHUNK else [self.key(KIND_CHUNK, ids) for ids in resolved.token_ids])
        report.chunks += len(group)
        report.already_cached += len(group) - len(missing)

    def _register_resolved(self, chunks: Sequence[Chunk], plain_keys: Sequence[str]) -> None:
        """`register(chunks)` with their plain keys already known (no second tokenisation, no memo)."""
        with self._registry_lock:
            for c in chunks:
                self.chunks[c.id] = c
            tombstones = self._tombstones
            for c in chunks:
                tombstones.pop(c.id, None)
        if chunks:
            self.guarded.link([f"{self.namespace}/{c.id}" for c in chunks], list(plain_keys))

    def _neighbour_map(
        self, chunks: list[Chunk], neighbours: Mapping[str, Sequence[str]] | None, top_n: int, index: Any
    ) -> Mapping[str, Sequence[str]]:
        """Each chunk's neighbours (given, else from `index`, else by embedding among the chunks this
        engine knows), every one of them known here (ChunkNotFoundError before anything is computed)."""
        if neighbours is None:
            if index is not None:
                neighbours = neighbours_from_index(index, chunks, top_n)
                self.register(index.get(sorted({n for ns in neighbours.values() for n in ns})))
            else:
                neighbours = neighbours_by_embedding(list(self.chunks.values()), top_n)
        unknown = sorted({n for c in chunks for n in neighbours.get(c.id, ()) if n not in self.chunks})
        if unknown:
            raise ChunkNotFoundError(f"neighbour chunk ids not known to the engine: {unknown[:5]}; register() or precompute() them")
        return neighbours

    def _context_ids(self, chunk: Chunk, neighbours: Mapping[str, Sequence[str]]) -> list[int]:
        ids: list[int] = []
        for n in neighbours.get(chunk.id, ()):
            ids.extend(self.layout.chunk_ids(self.chunks[n]))
        return ids

    def compute_and_store(
        self,
        resolved: Resolved,
        idx: list[int],
        batch_size: int | None,
        progress: Any,
        kind: str = KIND_CHUNK,
        context: list[list[int]] | None = None,
        keep: bool = True,
    ) -> list[LayerStack]:
        """Compute the KV of `resolved`'s chunks at `idx` and store each forward batch's entries as
        soon as the batch is computed. Returns the KV in `idx` order (`keep=False`: nothing is
        kept, each batch is dropped once stored, and the answer is [])."""
        out: list[LayerStack | None] | None = [None] * len(idx) if keep else None
        bar, own_bar = _progress_bar(progress, len(idx))
        try:
            for batch in self.computer.iter_chunk_kv(
                self.prefix_kv(), [resolved.token_ids[i] for i in idx], batch_size=batch_size or self.batch_size, context=context
            ):
                self._store_batch(resolved, idx, batch, kind, out)
                if bar is not None:
                    bar.update(len(batch))
                del batch  # stored: nothing here holds its KV while the next batch is computed
        finally:
            if own_bar:
                bar.close()
        return out if out is not None else []  # type: ignore[return-value]

    def _store_batch(
        self, resolved: Resolved, idx: list[int], batch: list[tuple[int, LayerStack]], kind: str, out: list[LayerStack | None] | None
    ) -> None:
        for j, (k, v) in batch:
            i = idx[j]
            ids = resolved.token_ids[i]
            meta = self.entry_meta(kind, len(ids))
            entry = KVEntry(k, v, meta=meta, token_ids=torch.tensor(ids, dtype=torch.int64))
            if kind == KIND_SIMILARITY:
                key = self.similarity_key(resolved.chunks[i], ids)
            else:
                key = self.chunk_key(ids, resolved.salt) if kind == KIND_CHUNK else self.key(kind, ids)
            if key is not None and not mark_finite(meta, k, v):
                log.warning("not storing the KV of a %d-token %s: it holds non-finite values", len(ids), kind)
            elif key is not None:
                self.guarded.put(key, entry)
            if out is not None:
                out[j] = (k, v)

    # -- loading --------------------------------------------------------------------------------
    def read_ahead(self, resolved: Resolved) -> None:
        """Read the request's plain chunk entries before the model lock is taken, so a slow store
        (disk, Redis) never holds up other requests' forwards or decoding steps; `load_chunks`
        then checks and uses them. Misses and faults are left for `load_chunks` (computed there)."""
        todo = [i for i in range(len(resolved.chunks)) if i not in resolved.loaded]
        if not todo:
            return
        t = clock(self.lm.device)
        for i, e in zip(todo, self.guarded.get_many([resolved.keys[i] for i in todo])):
            if e is not None:
                resolved.loaded[i] = e
                resolved.read_ahead.add(i)
        resolved.read_s += clock(self.lm.device) - t

    def load_chunks(self, resolved: Resolved, stats: AnswerStats, kind: str = KIND_CHUNK, to_device: bool = True) -> list[LayerStack]:
        """Stored KV of each chunk: `kind` entries first, then plain ones, then computed (and kept).
        `to_device=False`: stored entries stay on the host (pinned on CUDA) for a layer feed (kvrag.fuse.layer_feed)."""
        if kind not in CHUNK_KINDS:
            raise ValueError(f"kv_kind must be one of {CHUNK_KINDS}, got {kind!r}")
        t = clock(self.lm.device)
        stacks: list[LayerStack | None] = [None] * len(resolved.chunks)
        kinds = [kind] if kind == KIND_CHUNK else [kind, KIND_CHUNK]
        for k in kinds:
            todo = [i for i, st in enumerate(stacks) if st is None]
            if not todo:
                break
            entries: dict[int, KVEntry | None] = {}
            if k == KIND_CHUNK and resolved.loaded:
                entries = {i: resolved.loaded[i] for i in todo if i in resolved.loaded}
                todo = [i for i in todo if i not in entries]
            if k == KIND_SIMILARITY:  # only chunks whose neighbour set this engine precomputed
                todo = [i for i in todo if self.similarity_key(resolved.chunks[i], resolved.token_ids[i]) is not None]
                keys = [self.similarity_key(resolved.chunks[i], resolved.token_ids[i]) for i in todo]
            else:
                keys = [self.chunk_key(resolved.token_ids[i], resolved.salt) for i in todo]
            entries.update(zip(todo, self.guarded.get_many(keys)))  # type: ignore[arg-type]
            for i, e in entries.items():
                if self.valid(e, k, len(resolved.token_ids[i]), resolved.token_ids[i]):
                    stats.cache_hits += 1
                    stats.bytes_loaded += e.nbytes
                    tier = "request" if i in resolved.loaded and i not in resolved.read_ahead else (e.tier or "store")
                    stats.tiers[tier] = stats.tiers.get(tier, 0) + 1
                    stacks[i] = self._to_device(e) if to_device else on_host(e, pin=self.lm.device.type == "cuda")
        stats.path = kind
        stats.load_s = clock(self.lm.device) - t + resolved.read_s
        misses = [i for i, st in enumerate(stacks) if st is None]
        if misses:
            stats.cache_misses = len(misses)
            stats.tiers["computed"] = len(misses)
            computed = self.compute_and_store(resolved, misses, None, progress=False)
            for i, st in zip(misses, computed):
                stacks[i] = st
            stats.chunk_prefill_tokens = sum(len(resolved.token_ids[i]) for i in misses)
        return stacks  # type: ignore[return-value]


def drop_non_finite(repo: KVRepository, resolved: Resolved, stacks: Sequence[LayerStack], kind: str = KIND_CHUNK) -> list[int]:
    """The chunks whose loaded KV holds a non-finite value (an entry whose writer marked it finite
    and lied, or a store that changed it): each logged, its entries deleted and forgotten by the
    request, so a retried prefill computes and stores them anew. Called only when a prefill's
    logits came out non-finite, so the usual read scans nothing (kvrag.kv.entry_check)."""
    bad = [i for i, (k, v) in enumerate(stacks) if not (all_finite(k) and all_finite(v))]
    for i in bad:
        ids = resolved.token_ids[i]
        log.warning("ignoring a %s cache entry (%d tokens): non-finite values; it will be recomputed and replaced", kind, len(ids))
        keys = {repo.chunk_key(ids, resolved.salt), repo.key(kind, ids) if kind != KIND_SIMILARITY else repo.similarity_key(resolved.chunks[i], ids)}
        for key in filter(None, keys):
            repo.guarded.delete(key)
        resolved.loaded.pop(i, None)
        resolved.read_ahead.discard(i)
    return bad
