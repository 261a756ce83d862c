"""Chunks by id: the request's chunks resolved to token ids and keys, the registry of known chunks,
and the store's node-id index (so a process that never saw a chunk finds it by id).

`ChunkIndex` is the id half of `KVRepository` (kvrag.repository), which supplies the keys
(`key`), entry checks (`valid`), the guarded store and the layout it relies on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

from kvrag.cache_backends import KVEntry, content_key
from kvrag.errors import ChunkNotFoundError, EmptyRetrievalError
from kvrag.options import KIND_CHUNK, KIND_SIMILARITY
from kvrag.types import Chunk

if TYPE_CHECKING:
    from kvrag.guarded_store import GuardedStore
    from kvrag.layout import PromptLayout
    from kvrag.model import LoadedModel


@dataclass
class Resolved:
    """The chunks of one request: their token ids, plain-entry keys, and entries already loaded."""

    chunks: list[Chunk]
    token_ids: list[list[int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    loaded: dict[int, KVEntry] = field(default_factory=dict)
    read_ahead: set[int] = field(default_factory=set)  # of `loaded`: read from the store before the model lock
    read_s: float = 0.0  # time that read took (part of the answer's load time and TTFT)


class ChunkIndex:
    """Chunks by id, here and in the store's node-id index (the id half of KVRepository)."""

    lm: LoadedModel
    layout: PromptLayout
    guarded: GuardedStore
    chunks: dict[str, Chunk]
    similarity_context: dict[str, str]  # chunk id -> digest of the neighbours its similarity entry was computed after
    _registry_lock: threading.Lock

    def key(self, kind: str, token_ids: Sequence[int], context: str = "") -> str:  # pragma: no cover - KVRepository's
        raise NotImplementedError

    def valid(self, entry: KVEntry | None, kind: str, n: int, token_ids: Sequence[int] | None = None) -> bool:  # pragma: no cover
        raise NotImplementedError

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
