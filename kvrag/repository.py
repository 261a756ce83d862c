"""The KV repository: chunk ids, cache keys, entry validation, the prefix KV, and load / compute / store.

Everything a request needs from storage goes through here, so the pipeline sees only stacks of KV
tensors: what is in the store is validated before use, what is missing is computed and written
back, and a store fault is a logged miss (see `GuardedStore`), never a failed request.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from kvrag.cache_backends import KVEntry, KVStore, content_key
from kvrag.cache_backends.format import FORMAT_VERSION
from kvrag.entry_check import entry_problem
from kvrag.errors import ChunkNotFoundError, ContextTooLongError, EmptyRetrievalError
from kvrag.guarded_store import GuardedStore
from kvrag.layout import PromptLayout
from kvrag.model import LoadedModel
from kvrag.options import CHUNK_KINDS, KIND_CHUNK, KIND_PREFIX, KIND_SIMILARITY
from kvrag.precompute import KVComputer, LayerStack
from kvrag.timing import clock
from kvrag.similarity import neighbours_by_embedding, neighbours_from_index
from kvrag.types import AnswerStats, Chunk
from kvrag.version import __version__

log = logging.getLogger(__name__)

# What a key is made of beyond the tokens: bump KEY_SCHEMA when the meaning of an entry changes.
KEY_SCHEMA = "kvrag-key-2"
QUESTION_ROOM = 64  # tokens kept free for a question when checking that a chunk fits the context


@dataclass
class PrecomputeReport:
    chunks: int = 0
    computed: int = 0
    already_cached: int = 0
    tokens: int = 0
    seconds: float = 0.0
    not_stored: list[str] = field(default_factory=list)  # ids computed but not in the store afterwards (store down?)


@dataclass
class Resolved:
    """The chunks of one request: their token ids, plain-entry keys, and entries already loaded."""

    chunks: list[Chunk]
    token_ids: list[list[int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    loaded: dict[int, KVEntry] = field(default_factory=dict)
    read_ahead: set[int] = field(default_factory=set)  # of `loaded`: read from the store before the model lock
    read_s: float = 0.0  # time that read took (part of the answer's load time and TTFT)


def check_fits(lm: LoadedModel, layout: PromptLayout, chunks: Sequence[Chunk], token_ids: Sequence[Sequence[int]]) -> None:
    """A chunk longer than the model's context (less the prefix and room for a question) is refused before any compute."""
    room = lm.max_context - len(layout.prefix_ids) - QUESTION_ROOM
    for c, ids in zip(chunks, token_ids):
        if len(ids) > room:
            raise ContextTooLongError(
                f"chunk {c.id!r} has {len(ids)} tokens but at most {room} fit in the model's context with a question: "
                "split it into smaller chunks (kvrag.documents caps chunks at 256 tokens by default)"
            )


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


class KVRepository:
    """Chunks by id and their KV: keys from (model, layout, kind, token ids), validated entries, misses computed."""

    def __init__(
        self, lm: LoadedModel, store: KVStore, layout: PromptLayout, computer: KVComputer, batch_size: int = 8, layerwise: bool | None = None
    ) -> None:
        """`layerwise`: load chunk KV layer by layer, overlapped with the passes (kvrag.layer_feed); None
        (default): on CUDA, where the copies hide behind compute, off on the CPU (nothing to hide)."""
        self.lm = lm
        self.layerwise = layerwise
        self.store = store
        self.guarded = GuardedStore(store)
        self.layout = layout
        self.computer = computer
        self.batch_size = batch_size
        self.chunks: dict[str, Chunk] = {}
        self.similarity_context: dict[str, str] = {}  # chunk id -> digest of the neighbours its similarity entry was computed after
        self._prefix: LayerStack | None = None
        self._registry_lock = threading.Lock()

    # -- keys and validation ------------------------------------------------------------------
    def key(self, kind: str, token_ids: Sequence[int], context: str = "") -> str:
        """The store key of an entry: model, layout, kind, tokens, and everything else its KV
        depends on (storage quantisation, entry format, code version, a similarity entry's context)."""
        storage = "int8" if getattr(self.store, "quantize", False) else "exact"
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
    def prefix_kv(self) -> LayerStack:
        """The system prefix's KV, computed once per (model, system prompt) and kept in the store."""
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

    # -- chunks by id ---------------------------------------------------------------------------
    def register(self, chunks: Iterable[Chunk], relink: bool = True) -> list[Chunk]:
        """Remember chunks by id (here and in the store's node-id index) so requests by id find them.

        The index maps a user id to the content key of its current text, so a chunk whose text
        changed under the same id resolves to a new key: a miss, never stale KV.
        """
        out = list(chunks)
        with self._registry_lock:
            changed = [c for c in out if self.chunks.get(c.id) != c]
            for c in out:
                self.chunks[c.id] = c
        self.link(out if relink else changed)
        return out

    @property
    def namespace(self) -> str:
        """The node-id index namespace: ids map to keys per (model, layout), so engines with another
        model or system prompt sharing a store never overwrite each other's ids."""
        return content_key(self.lm.fingerprint, self.layout.identity)[:16]

    def link(self, chunks: Sequence[Chunk]) -> None:
        """(Re)write these chunks' ids in the store's index: a store that lost its index (a Redis
        restart, FLUSHALL, eviction) gets it back on the next register or precompute."""
        if chunks:
            self.guarded.link([f"{self.namespace}/{c.id}" for c in chunks], self.resolve(chunks).keys)

    def forget(self, resolved: Resolved) -> int:
        """Drop these chunks from the registry and delete their KV entries; returns entries deleted."""
        deleted = 0
        for c, ids in zip(resolved.chunks, resolved.token_ids):
            with self._registry_lock:
                self.chunks.pop(c.id, None)
                context = self.similarity_context.pop(c.id, None)
            keys = [self.key(KIND_CHUNK, ids)] + ([self.key(KIND_SIMILARITY, ids, context)] if context else [])
            for key in keys:
                if self.guarded.contains(key):
                    self.guarded.delete(key)
                    deleted += 1
        return deleted

    def chunk(self, chunk_id: str) -> Chunk:
        try:
            return self.chunks[chunk_id]
        except KeyError:
            raise ChunkNotFoundError(f"unknown chunk id {chunk_id!r}") from None

    def resolve(self, chunks: Sequence[Chunk], kind: str = KIND_CHUNK) -> Resolved:
        res = Resolved(chunks=list(chunks))
        for c in res.chunks:
            if not isinstance(c.text, str) or not c.text.strip():
                raise ValueError(f"chunk {c.id!r} has no text: a chunk must hold text to be cached or answered from")
            ids = self.layout.chunk_ids(c)
            if not ids:
                raise ValueError(f"chunk {c.id!r} has no tokens (empty text?): it cannot be cached or answered from")
            res.token_ids.append(ids)
            res.keys.append(self.key(kind, ids))
        return res

    def lookup(self, chunk_ids: Sequence[str] | None, chunks: Sequence[Chunk] | None, allow_empty: bool = False) -> Resolved:
        """Chunks given with text, or ids known here, or ids the store's node index can resolve."""
        if chunks:
            return self.resolve(self.register(chunks, relink=False))
        if not chunk_ids and allow_empty:
            return Resolved(chunks=[])
        if not chunk_ids:
            raise EmptyRetrievalError("no chunks to answer from: pass chunk_ids=[...] or chunks=[...] (retrieval returned nothing?)")
        from_store = self._entries_by_id([i for i in dict.fromkeys(chunk_ids) if i not in self.chunks])
        res = Resolved(chunks=[])
        for i, cid in enumerate(chunk_ids):
            if cid in self.chunks:
                chunk = self.chunks[cid]
                ids = self.layout.chunk_ids(chunk)
            else:  # known only to the store: the entry carries the token ids
                entry = from_store[cid]
                ids = entry.token_ids.tolist()
                chunk = Chunk(cid, self.lm.tokenizer.decode(ids), metadata={"source": "store"})
                res.loaded[i] = entry
            res.chunks.append(chunk)
            res.token_ids.append(ids)
            res.keys.append(self.key(KIND_CHUNK, ids))
        return res

    def _entries_by_id(self, unknown: list[str]) -> dict[str, KVEntry]:
        """Entries of ids this process never saw, through the store's node-id index."""
        if not unknown:
            return {}
        keys = self.guarded.resolve([f"{self.namespace}/{u}" for u in unknown])
        found = [(u, k) for u, k in zip(unknown, keys) if k]
        entries = self.guarded.get_many([k for _, k in found])
        out = {}
        for (uid, key), entry in zip(found, entries):
            if entry is None or entry.token_ids is None:
                continue
            ids = entry.token_ids.reshape(-1).tolist()
            if self.key(KIND_CHUNK, ids) == key and self.valid(entry, KIND_CHUNK, len(ids), ids):  # its tokens hash to its key
                out[uid] = entry
        missing = [u for u in unknown if u not in out]
        if missing:
            raise ChunkNotFoundError(f"unknown chunk id(s) {missing[:5]}: precompute() them first or pass chunks=[Chunk(...)] with their text")
        return out

    def prefetch_keys(self, chunk_ids: Sequence[str] | None = None, chunks: Sequence[Chunk] | None = None) -> list[str]:
        """Store keys of these chunks (ids unknown here are resolved through the store's index)."""
        known = list(chunks or ()) + [self.chunks[i] for i in (chunk_ids or ()) if i in self.chunks]
        keys = self.resolve(known).keys
        unknown = [i for i in (chunk_ids or ()) if i not in self.chunks]
        if unknown:
            keys += [k for k in self.guarded.resolve([f"{self.namespace}/{u}" for u in unknown]) if k]
        return keys

    # -- precompute -----------------------------------------------------------------------------
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
        """Compute and store the KV of every chunk not cached yet (see `KVRag.precompute`)."""
        t0 = time.perf_counter()
        if kind not in CHUNK_KINDS:
            raise ValueError(f"kind must be one of {CHUNK_KINDS}, got {kind!r}")
        resolved = self.resolve(self.register(chunks), kind)
        context: list[list[int]] | None = None
        if kind == KIND_SIMILARITY:  # the neighbours are part of the entry's identity (and key)
            context = self._neighbour_context(resolved.chunks, neighbours, top_n, index)
            for i, (c, ctx) in enumerate(zip(resolved.chunks, context)):
                self.similarity_context[c.id] = content_key(f"top_n={top_n}", ctx)
                resolved.keys[i] = self.similarity_key(c, resolved.token_ids[i])
        report = PrecomputeReport(chunks=len(resolved.chunks))
        missing = [i for i, k in enumerate(resolved.keys) if not self.guarded.contains(k)]
        report.already_cached = len(resolved.chunks) - len(missing)
        if missing:
            check_fits(self.lm, self.layout, [resolved.chunks[i] for i in missing], [resolved.token_ids[i] for i in missing])
            self.compute_and_store(resolved, missing, batch_size, progress, kind, [context[i] for i in missing] if context else None)
            report.not_stored = [resolved.chunks[i].id for i in missing if not self.guarded.contains(resolved.keys[i])]
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
                neighbours = neighbours_by_embedding(list(self.chunks.values()), top_n)
        unknown = sorted({n for c in chunks for n in neighbours.get(c.id, ()) if n not in self.chunks})
        if unknown:
            raise ChunkNotFoundError(f"neighbour chunk ids not known to the engine: {unknown[:5]}; register() or precompute() them")
        context = []
        for c in chunks:
            ids: list[int] = []
            for n in neighbours.get(c.id, ()):
                ids.extend(self.layout.chunk_ids(self.chunks[n]))
            context.append(ids)
        return context

    def compute_and_store(
        self,
        resolved: Resolved,
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
            entry = KVEntry(k, v, meta=self.entry_meta(kind, len(ids)), token_ids=torch.tensor(ids, dtype=torch.int64))
            key = self.similarity_key(resolved.chunks[i], ids) if kind == KIND_SIMILARITY else self.key(kind, ids)
            if key is not None:
                self.guarded.put(key, entry)
        return stacks

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
        `to_device=False`: stored entries stay on the host (pinned on CUDA) for a layer feed (kvrag.layer_feed)."""
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
                keys = [self.key(k, resolved.token_ids[i]) for i in todo]
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
