"""Chunks by id: the request's chunks resolved to token ids and keys, the registry of known chunks,
and the store's node-id index (so a process that never saw a chunk finds it by id, and one that holds
a chunk another process rebound or removed learns it: `ChunkRegistry._still_bound`; the index's reads
are kvrag.kv.id_index).

`ChunkRegistry` is the id half of `KVRepository` (kvrag.kv.repository), which supplies the keys
(`key`), entry checks (`valid`), the guarded store and the layout it relies on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Iterator, Sequence

from kvrag.cache_backends import KVEntry
from kvrag.errors import ChunkNotFoundError, EmptyRetrievalError
from kvrag.kv.id_index import StoreIdIndex
from kvrag.kv.recovery import TextRecovery
from kvrag.kv.kinds import KIND_CHUNK, KIND_SIMILARITY
from kvrag.kv.salt import salt_context
from kvrag.types import Chunk

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Scope:
    salt: str = ""  # the caller's cache scope (a tenant's): see request_scoped_chunks
    corpus: bool = False  # chunks given with text are the deployment's own (retrieved from its index): keyed by content alone


_REQUEST_SCOPED: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("kvrag_request_scoped_chunks", default=None)
RemovedJudge = Callable[[Sequence[str]], Collection[str]]
_REMOVED_BY: contextvars.ContextVar[RemovedJudge | None] = contextvars.ContextVar("kvrag_removed_by", default=None)
MAX_TOMBSTONES = 65536  # forgotten ids remembered where the store cannot unlink them (see `ChunkRegistry.unlink`)


@dataclass
class ForgetReport:
    deleted: int = 0  # KV entries deleted
    kept: int = 0  # KV entries kept because another id still refers to them
    unlinked: bool = False  # the store's id index no longer resolves the ids


@contextlib.contextmanager
def request_scoped_chunks(salt: str = "", corpus: bool = False) -> Iterator[None]:
    """Within this block (this thread or task), chunks passed *with their text* (`chunks=[...]`) are
    answered from but belong to that one call: they are not registered, their ids are not linked in
    the store's node-id index, and a registered chunk with the same id keeps its text. Their KV is
    still read from and written to the store by content key, so a repeated chunk is a cache hit.

    The server answers every chat request inside this scope, so one client's inline chunk never
    rebinds an id for the others; only an explicit ingest (`precompute`/`register`) binds ids.

    `salt` (a tenant's cache scope, kvrag.server.tenants): the KV of those chunks is keyed with it
    too, and so is the memo of system prefixes (`KVRepository.prefix_kv`), so a hit on either (a
    faster answer, `cache_hits`) only ever tells a caller what callers with the same salt sent.
    `corpus=True`: the chunks given with text are the deployment's own corpus (what the server
    retrieved from its index), keyed by content alone and shared, as ids are.
    """
    token = _REQUEST_SCOPED.set(_Scope(salt, corpus))
    try:
        yield
    finally:
        _REQUEST_SCOPED.reset(token)


def scope_salt() -> str:
    """The cache salt of the request-scoped block this thread or task is in ("" outside one)."""
    scope = _REQUEST_SCOPED.get()
    return scope.salt if scope is not None else ""


@contextlib.contextmanager
def removed_ids_by(judge: RemovedJudge | None) -> Iterator[None]:
    """Within this block (this thread or task), an id this process holds but the store's node-id index
    no longer binds is passed to `judge`, which says which of them were removed (by another process):
    those are dropped from the registry and are ChunkNotFoundError, the others answered from this
    process's text. Outside such a block (or with None) none is taken as removed: the store may have
    lost its index (a Redis restarted empty) and this process's table refills it, as it always did.

    Why a judge: an unlink and a lost index look alike in the store. The server knows better: with a
    retrieval index (which every DELETE empties first) an id the index lacks was deleted; without one,
    the store's index is every replica's registry (kvrag.server.chat).
    """
    token = _REMOVED_BY.set(judge)
    try:
        yield
    finally:
        _REMOVED_BY.reset(token)


@dataclass
class Resolved:
    """The chunks of one request: their token ids, plain-entry keys, and entries already loaded."""

    chunks: list[Chunk]
    token_ids: list[list[int]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    loaded: dict[int, KVEntry] = field(default_factory=dict)
    read_ahead: set[int] = field(default_factory=set)  # of `loaded`: read from the store before the model lock
    read_s: float = 0.0  # time that read took (part of the answer's load time and TTFT)
    whole: str | None = None  # its request's read-whole verdict (AnswerOptions.whole_reason_for), once decided
    salt: str = ""  # the cache salt its chunks' KV is keyed with (request_scoped_chunks); "": by content alone


class ChunkRegistry(StoreIdIndex, TextRecovery):
    """Chunks by id, here and in the store's node-id index (the id half of KVRepository)."""

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
            tombstones = self._tombstones
            for c in out:
                tombstones.pop(c.id, None)
        self.link(out if relink else changed)
        return out

    @property
    def _tombstones(self) -> dict[str, None]:
        """Ids forgotten here whose link the store cannot drop (it has no `unlink`): not resolved
        through the store's index again until registered anew (oldest dropped past MAX_TOMBSTONES)."""
        found = self.__dict__.get("_forgotten")
        if found is None:
            found = self.__dict__.setdefault("_forgotten", {})
        return found

    def link(self, chunks: Sequence[Chunk]) -> None:
        """(Re)write these chunks' ids in the store's index: a store that lost its index (a Redis
        restart, FLUSHALL, eviction) gets it back on the next register or precompute."""
        if chunks:
            self.guarded.link([f"{self.namespace}/{c.id}" for c in chunks], self.resolve(chunks).keys)

    def forget(self, resolved: Resolved) -> int:
        """Drop these chunks' ids and delete the KV entries no other id refers to (see
        `forget_report`); returns entries deleted."""
        return self.forget_report(resolved).deleted

    def forget_report(self, resolved: Resolved) -> ForgetReport:
        """Drop these chunks' ids (from the registry and the store's node-id index) and delete each
        KV entry that no other id still refers to.

        Entries are content-keyed, so two ids with the same text share one. An entry is kept while
        another id refers to it: an id registered here with the same tokens, or an id in the store's
        index pointing to its key. The store's index is searched only where that is cheap
        (`_index_links`: at most SHARE_SCAN_LIMIT ids); a larger one is not, and an id known only
        to it (registered by another process) then loses the entry, to be recomputed by a process
        that knows its text, or to be unknown to one that does not.
        """
        gone = {c.id for c in resolved.chunks}
        with self._registry_lock:
            contexts: dict[str, str | None] = {}
            for c in resolved.chunks:
                self.chunks.pop(c.id, None)
                contexts[c.id] = self.similarity_context.pop(c.id, None) or contexts.get(c.id)
            others = [c for c in self.chunks.values() if c.id not in gone]
            other_contexts = dict(self.similarity_context)
        report = ForgetReport(unlinked=self.unlink(sorted(gone)))
        by_text: dict[str, list[Chunk]] = {}
        for o in others:
            by_text.setdefault(self.layout.chunk_text(o), []).append(o)
        todo: list[str] = []
        for c, ids in zip(resolved.chunks, resolved.token_ids):
            plain = self.key(KIND_CHUNK, ids)
            # a chunk resolved through the store carries its decoded text (the whole chunk text)
            candidates = {id(o): o for t in {self.layout.chunk_text(c), c.text} for o in by_text.get(t, ())}
            sharers = [o for o in candidates.values() if self.key(KIND_CHUNK, self.layout.chunk_ids(o)) == plain]
            keys = [plain]
            context = contexts.get(c.id)
            if context:
                keys.append(self.key(KIND_SIMILARITY, ids, context))
            for key in keys:
                shared = bool(sharers) if key == plain else any(other_contexts.get(o.id) == context for o in sharers)
                if shared:
                    report.kept += int(self.guarded.contains(key))
                elif key not in todo:
                    todo.append(key)
        todo = [k for k in todo if self.guarded.contains(k)]
        if todo:
            linked = self._keys_linked_by_others(set(todo), {f"{self.namespace}/{i}" for i in gone})
            report.kept += sum(k in linked for k in todo)
            todo = [k for k in todo if k not in linked]
        for key in todo:
            self.guarded.delete(key)
            report.deleted += 1
        return report

    def unlink(self, chunk_ids: Sequence[str]) -> bool:
        """Drop these ids from the store's node-id index, so no process resolves them through it.

        True when the store dropped them (as far as it tells: the ids no longer resolve). A store
        this cannot unlink from (another kind) keeps the links; the ids are then remembered here as
        forgotten, so this process does not resolve them until they are registered anew, and the
        answer is False.
        """
        if not chunk_ids:
            return True
        names = [f"{self.namespace}/{i}" for i in chunk_ids]
        store = self._index_store()
        try:
            if callable(getattr(store, "unlink", None)):  # disk, Redis
                store.unlink(names)  # type: ignore[attr-defined]
            else:  # memory, host: through their admin view
                admin = self._index_admin()
                if admin is not None:
                    admin.unlink_ids(names)  # type: ignore[attr-defined]
        except Exception as exc:  # a store fault never fails a request
            log.warning("store unlink failed (%s)", exc)
        if not any(self.guarded.resolve(names)):
            return True
        if callable(getattr(store, "unlink", None)):
            return False  # a shared index that failed to drop them: never shadowed here (a re-ingest elsewhere would stay hidden)
        with self._registry_lock:
            tombstones = self._tombstones
            for i in chunk_ids:
                tombstones.pop(i, None)
                tombstones[i] = None
            while len(tombstones) > MAX_TOMBSTONES:
                tombstones.pop(next(iter(tombstones)))
        return False

    def chunk(self, chunk_id: str) -> Chunk:
        """The chunk this id names, as answering by id reads it (`lookup`), not this process's table
        unchecked: another process sharing the store may have replaced or deleted it. An id rebound
        elsewhere is the store's text (decoded from its entry, `metadata["source"] == "store"`), never
        the old text; one removed (as `removed_ids_by` judges) or unknown is ChunkNotFoundError. Where
        the store cannot be read, this process's table answers."""
        return self.lookup([chunk_id], None).chunks[0]

    def chunk_key(self, token_ids: Sequence[int], salt: str = "") -> str:
        """A plain chunk entry's key, salted for a caller's inline chunks (request_scoped_chunks)."""
        return self.key(KIND_CHUNK, token_ids, salt_context(salt))

    def resolve(self, chunks: Sequence[Chunk], kind: str = KIND_CHUNK, memo: bool = True, salt: str = "") -> Resolved:
        """The chunks' token ids and keys (`memo=False`: token ids not memoised, see `_ids_once`;
        `salt`: plain entries keyed with it, see request_scoped_chunks)."""
        ids_of = self.layout.chunk_ids if memo else self._ids_once
        res = Resolved(chunks=list(chunks), salt=salt if kind == KIND_CHUNK else "")
        for c in res.chunks:
            if not isinstance(c.text, str) or not c.text.strip():
                raise ValueError(f"chunk {c.id!r} has no text: a chunk must hold text to be cached or answered from")
            ids = ids_of(c)
            if not ids:
                raise ValueError(f"chunk {c.id!r} has no tokens (empty text?): it cannot be cached or answered from")
            res.token_ids.append(ids)
            res.keys.append(self.key(kind, ids, salt_context(res.salt)))
        return res

    def lookup(self, chunk_ids: Sequence[str] | None, chunks: Sequence[Chunk] | None, allow_empty: bool = False) -> Resolved:
        """Chunks given with text, or ids known here, or ids the store's node index can resolve.

        An id known here is answered from this process's text only while the store's node-id index
        does not bind it to other text (`_still_bound`): an id another process (a replica over the same
        Redis, `kvrag ingest` over the same disk store) rebound is answered from the new text's entry,
        and one it removed (as `removed_ids_by` judges) is ChunkNotFoundError, on the very next request."""
        if chunks:
            scope = _REQUEST_SCOPED.get()
            if scope is not None:  # see request_scoped_chunks: answered from, never registered
                return self.resolve(chunks, memo=False, salt="" if scope.corpus else scope.salt)
            return self.resolve(self.register(chunks, relink=False))
        if not chunk_ids and allow_empty:
            return Resolved(chunks=[])
        if not chunk_ids:
            raise EmptyRetrievalError("no chunks to answer from: pass chunk_ids=[...] or chunks=[...] (retrieval returned nothing?)")
        wanted = list(dict.fromkeys(chunk_ids))
        local = self._still_bound({i: c for i in wanted if (c := self.chunks.get(i)) is not None})
        from_store = self._entries_by_id([i for i in wanted if i not in local])
        res = Resolved(chunks=[])
        for i, cid in enumerate(chunk_ids):
            found = local[cid] if cid in local else from_store[cid]
            if isinstance(found, Chunk):  # known here, or read back from the text source (its entry recomputed)
                chunk = found
                ids = self.layout.chunk_ids(chunk)
            else:  # known only to the store: the entry carries the token ids
                ids = found.token_ids.tolist()
                chunk = Chunk(cid, self.lm.tokenizer.decode(ids), metadata={"source": "store"})
                res.loaded[i] = found
            res.chunks.append(chunk)
            res.token_ids.append(ids)
            res.keys.append(self.key(KIND_CHUNK, ids))
        return res

    def _still_bound(self, local: dict[str, Chunk]) -> dict[str, Chunk]:
        """Those of `local` (chunks of this process's registry, by id) still bound to this text. The store's
        node-id index is every process's registry: an id it binds to another key was rebound elsewhere (a
        replica's `replace`, a re-ingest); an id it binds to none was removed elsewhere when the judge
        says so (`removed_ids_by`). Either is dropped from this registry, so its old text is never
        answered again here, and the caller resolves it through the store (the new text's entry, or
        ChunkNotFoundError). Where the store cannot be read (down), this process's table answers."""
        if not local:
            return local
        links = self.store_links(list(local))
        if links is None:
            return local
        stale = {cid: c for (cid, c), key in zip(local.items(), links)
                 if key is not None and key != self.key(KIND_CHUNK, self.layout.chunk_ids(c))}
        unbound = [cid for cid, key in zip(local, links) if key is None]
        judge = _REMOVED_BY.get()
        if unbound and judge is not None:
            removed = set(judge(unbound))
            stale.update((cid, local[cid]) for cid in unbound if cid in removed)
        if stale:
            with self._registry_lock:
                for cid, c in stale.items():
                    if self.chunks.get(cid) is c:  # not registered anew meanwhile (that registration then stands)
                        del self.chunks[cid]
                        self.similarity_context.pop(cid, None)
            log.info("%d chunk id(s) were replaced or removed through another process; this one's text is dropped", len(stale))
        return {cid: c for cid, c in local.items() if cid not in stale}

    def _ids_once(self, chunk: Chunk) -> list[int]:
        """A chunk's token ids without memoising them (ids the layout already memoised are reused), so
        a stream of one-off request-scoped chunks keeps nothing here."""
        try:
            return self.layout.chunk_ids(chunk, memo=False)
        except TypeError:  # another layout: its own chunk_ids
            return self.layout.chunk_ids(chunk)

    def _entries_by_id(self, unknown: list[str]) -> dict[str, KVEntry | Chunk]:
        """Entries of ids this process never saw, through the store's node-id index. An id linked to an
        entry that is damaged or gone (a truncated file, an evicted key) is read back from the text
        source (`_recover`): its chunk, whose entry the request then computes and stores again."""
        if not unknown:
            return {}
        tombstones = self._tombstones
        linkable = [u for u in unknown if u not in tombstones]  # forgotten here, the store could not unlink
        keys = self.guarded.resolve([f"{self.namespace}/{u}" for u in linkable])
        found = [(u, k) for u, k in zip(linkable, keys) if k]
        entries = self.guarded.get_many([k for _, k in found])
        out: dict[str, KVEntry | Chunk] = {}
        for (uid, key), entry in zip(found, entries):
            if entry is None or entry.token_ids is None:
                continue
            ids = entry.token_ids.reshape(-1).tolist()
            if self.key(KIND_CHUNK, ids) == key and self.valid(entry, KIND_CHUNK, len(ids), ids):  # its tokens hash to its key
                out[uid] = entry
        damaged = {u: k for u, k in found if u not in out}
        out.update(self._recover(damaged))
        linked = dict(found)
        out.update(self._recover_unlinked([u for u in linkable if u not in linked]))
        missing = [u for u in unknown if u not in out]
        if missing:
            lost = [u for u in missing if u in damaged]
            if lost:
                raise ChunkNotFoundError(
                    f"chunk id(s) {lost[:5]} are linked in the KV store but their entry is damaged or gone, and no index "
                    "holds their text to recompute it: precompute() them again or pass chunks=[Chunk(...)] with their text", ids=missing)
            raise ChunkNotFoundError(f"unknown chunk id(s) {missing[:5]}: precompute() them first or pass chunks=[Chunk(...)] with their text", ids=missing)
        return out

    def removed_judge(self) -> RemovedJudge | None:
        """The judge of removed ids the current block set (`removed_ids_by`), or None."""
        return _REMOVED_BY.get()

    def prefetch_keys(self, chunk_ids: Sequence[str] | None = None, chunks: Sequence[Chunk] | None = None) -> list[str]:
        """Store keys of these chunks (ids unknown here are resolved through the store's index)."""
        known = list(chunks or ()) + [self.chunks[i] for i in (chunk_ids or ()) if i in self.chunks]
        keys = self.resolve(known).keys
        tombstones = self._tombstones
        unknown = [i for i in (chunk_ids or ()) if i not in self.chunks and i not in tombstones]
        if unknown:
            keys += [k for k in self.guarded.resolve([f"{self.namespace}/{u}" for u in unknown]) if k]
        return keys
