"""Chunks by id: the request's chunks resolved to token ids and keys, the registry of known chunks,
and the store's node-id index (so a process that never saw a chunk finds it by id).

`ChunkRegistry` is the id half of `KVRepository` (kvrag.kv.repository), which supplies the keys
(`key`), entry checks (`valid`), the guarded store and the layout it relies on.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from kvrag.cache_backends import KVEntry, content_key
from kvrag.errors import ChunkNotFoundError, EmptyRetrievalError
from kvrag.kv.kinds import KIND_CHUNK, KIND_SIMILARITY
from kvrag.types import Chunk

if TYPE_CHECKING:
    from kvrag.cache_backends.guarded import GuardedStore
    from kvrag.kv.layout import PromptLayout
    from kvrag.model.loading import LoadedModel

log = logging.getLogger(__name__)

_REQUEST_SCOPED: contextvars.ContextVar[bool] = contextvars.ContextVar("kvrag_request_scoped_chunks", default=False)
MAX_TOMBSTONES = 65536  # forgotten ids remembered where the store cannot unlink them (see `ChunkRegistry.unlink`)
SHARE_SCAN_LIMIT = 10_000  # forgetting an id reads the store's whole id index only up to this many ids


@dataclass
class ForgetReport:
    deleted: int = 0  # KV entries deleted
    kept: int = 0  # KV entries kept because another id still refers to them
    unlinked: bool = False  # the store's id index no longer resolves the ids


def _count_files(root: Path, suffix: str, stop: int) -> int:
    """Files ending in `suffix` under `root` (one level of folders), counting no further than `stop`."""
    n = 0
    try:
        for d in os.scandir(root):
            if d.is_dir(follow_symlinks=False):
                for f in os.scandir(d.path):
                    n += f.name.endswith(suffix)
                    if n >= stop:
                        return n
    except FileNotFoundError:
        pass
    return n


@contextlib.contextmanager
def request_scoped_chunks() -> Iterator[None]:
    """Within this block (this thread or task), chunks passed *with their text* (`chunks=[...]`) are
    answered from but belong to that one call: they are not registered, their ids are not linked in
    the store's node-id index, and a registered chunk with the same id keeps its text. Their KV is
    still read from and written to the store by content key, so a repeated chunk is a cache hit.

    The server answers every chat request inside this scope, so one client's inline chunk never
    rebinds an id for the others; only an explicit ingest (`precompute`/`register`) binds ids.
    """
    token = _REQUEST_SCOPED.set(True)
    try:
        yield
    finally:
        _REQUEST_SCOPED.reset(token)


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


class ChunkRegistry:
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

    def _index_store(self) -> object:
        """The store holding the node-id index: a tiered store keeps it in its bottom tier."""
        store: object = self.guarded.store
        while callable(getattr(store, "link", None)) and getattr(store, "lower", None) not in (None, store):
            store = store.lower  # type: ignore[attr-defined]
        return store

    def _index_admin(self) -> object | None:
        """The store-management view (kvrag.cache_backends.admin) of the index's store; None for other kinds."""
        try:
            from kvrag.cache_backends.admin.opening import open_admin

            return open_admin(self._index_store())
        except Exception:  # a store kind store_admin does not manage
            return None

    def _index_size(self, admin: object, stop: int) -> int | None:
        """Ids in the store's node-id index, counted without reading them (disk: up to `stop`); None
        for a kind whose index cannot be counted so."""
        kind = getattr(admin, "kind", "")
        if kind == "redis":
            return int(admin.client.hlen(admin.rs._INDEX))  # type: ignore[attr-defined]
        if kind == "disk":
            return _count_files(Path(admin.store.root) / "index", ".ref", stop)  # type: ignore[attr-defined]
        if kind == "memory":
            return len(admin.links())  # type: ignore[attr-defined]  (in this process: cheap)
        return None

    def store_index_size(self, limit: int = SHARE_SCAN_LIMIT) -> int | None:
        """How many ids the store's node-id index holds (every id any replica registered, for any model
        sharing the store): what `/health` reports, so it stays cheap for a poller. None where that is
        not cheap to count (more than `limit` on disk, a store kind without such an index) or the store fails."""
        admin = self._index_admin()
        if admin is None:
            return None
        try:
            n = self._index_size(admin, limit + 1)
        except Exception as exc:  # a store fault never fails a health check
            log.warning("could not count the store's node-id index (%s)", exc)
            return None
        return None if n is None or n > limit else n

    def _index_links(self) -> list | None:
        """Every link in the store's node-id index, where reading them all is cheap: a memory index,
        or a disk or Redis one holding at most SHARE_SCAN_LIMIT ids (counted without reading them).
        None where it is not (or the store fails)."""
        admin = self._index_admin()
        if admin is None:
            return None
        try:
            n = self._index_size(admin, SHARE_SCAN_LIMIT + 1)
            if n is None:
                return None
            return admin.links() if n <= SHARE_SCAN_LIMIT else None  # type: ignore[attr-defined]
        except Exception as exc:  # a store fault never fails a request
            log.warning("could not read the store's node-id index (%s)", exc)
            return None

    def _keys_linked_by_others(self, keys: set[str], own: set[str]) -> set[str]:
        """Which of `keys` some id other than `own` (namespaced ids) still points to in the store's index."""
        links = self._index_links()
        if links is None:
            return set()
        return {lk.key for lk in links if lk.key in keys and lk.user_id not in own}

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
        try:
            return self.chunks[chunk_id]
        except KeyError:
            raise ChunkNotFoundError(f"unknown chunk id {chunk_id!r}") from None

    def resolve(self, chunks: Sequence[Chunk], kind: str = KIND_CHUNK, memo: bool = True) -> Resolved:
        """The chunks' token ids and keys (`memo=False`: token ids not memoised, see `_ids_once`)."""
        ids_of = self.layout.chunk_ids if memo else self._ids_once
        res = Resolved(chunks=list(chunks))
        for c in res.chunks:
            if not isinstance(c.text, str) or not c.text.strip():
                raise ValueError(f"chunk {c.id!r} has no text: a chunk must hold text to be cached or answered from")
            ids = ids_of(c)
            if not ids:
                raise ValueError(f"chunk {c.id!r} has no tokens (empty text?): it cannot be cached or answered from")
            res.token_ids.append(ids)
            res.keys.append(self.key(kind, ids))
        return res

    def lookup(self, chunk_ids: Sequence[str] | None, chunks: Sequence[Chunk] | None, allow_empty: bool = False) -> Resolved:
        """Chunks given with text, or ids known here, or ids the store's node index can resolve."""
        if chunks:
            if _REQUEST_SCOPED.get():  # see request_scoped_chunks: answered from, never registered
                return self.resolve(chunks, memo=False)
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

    def _ids_once(self, chunk: Chunk) -> list[int]:
        """A chunk's token ids without memoising them (ids the layout already memoised are reused), so
        a stream of one-off request-scoped chunks keeps nothing here."""
        try:
            return self.layout.chunk_ids(chunk, memo=False)
        except TypeError:  # another layout: its own chunk_ids
            return self.layout.chunk_ids(chunk)

    def _entries_by_id(self, unknown: list[str]) -> dict[str, KVEntry]:
        """Entries of ids this process never saw, through the store's node-id index."""
        if not unknown:
            return {}
        tombstones = self._tombstones
        linkable = [u for u in unknown if u not in tombstones]  # forgotten here, the store could not unlink
        keys = self.guarded.resolve([f"{self.namespace}/{u}" for u in linkable])
        found = [(u, k) for u, k in zip(linkable, keys) if k]
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
            raise ChunkNotFoundError(f"unknown chunk id(s) {missing[:5]}: precompute() them first or pass chunks=[Chunk(...)] with their text", ids=missing)
        return out

    def prefetch_keys(self, chunk_ids: Sequence[str] | None = None, chunks: Sequence[Chunk] | None = None) -> list[str]:
        """Store keys of these chunks (ids unknown here are resolved through the store's index)."""
        known = list(chunks or ()) + [self.chunks[i] for i in (chunk_ids or ()) if i in self.chunks]
        keys = self.resolve(known).keys
        tombstones = self._tombstones
        unknown = [i for i in (chunk_ids or ()) if i not in self.chunks and i not in tombstones]
        if unknown:
            keys += [k for k in self.guarded.resolve([f"{self.namespace}/{u}" for u in unknown]) if k]
        return keys
