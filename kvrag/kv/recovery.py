"""Reading chunks back by id from their text's other home, the retrieval index, where the KV store lost
them: an entry damaged or gone (`_recover`), or links the store lost as a whole (`_recover_unlinked`);
and putting ids back as they were when a write failed half-way (`bindings`, `rebind`).

A mixin of `ChunkRegistry` (kvrag.kv.registry), which supplies the keys, the layout, the links and the
request's removed-id judge.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Collection, Sequence

from kvrag.kv.kinds import KIND_CHUNK
from kvrag.types import Chunk

log = logging.getLogger("kvrag.kv.registry")

TextSource = Callable[[Sequence[str]], Sequence[Chunk]]  # chunks by id (a retrieval index's `get`); those it lacks left out


class TextRecovery:
    """Chunks read back from `text_source` (see the module docstring)."""

    # where the text of an id whose KV entry is damaged or gone is read back: the retrieval index that holds
    # the same chunks (KVRagCore.recover_from); None: nowhere, such an id is ChunkNotFoundError
    text_source: TextSource | None = None
    layout: Any
    chunks: dict[str, Chunk]
    guarded: Any
    namespace: str
    _registry_lock: Any
    _tombstones: dict[str, None]

    def store_links(self, chunk_ids: Sequence[str]) -> list[str | None] | None:  # pragma: no cover - StoreIdIndex's
        raise NotImplementedError

    def unlink(self, chunk_ids: Sequence[str]) -> bool:  # pragma: no cover - ChunkRegistry's
        raise NotImplementedError

    def key(self, kind: str, token_ids: Sequence[int], context: str = "") -> str:  # pragma: no cover - KVRepository's
        raise NotImplementedError

    def link(self, chunks: Sequence[Chunk]) -> None:  # pragma: no cover - ChunkRegistry's
        raise NotImplementedError

    def removed_judge(self) -> Callable[[Sequence[str]], Collection[str]] | None:  # pragma: no cover - ChunkRegistry's
        raise NotImplementedError

    def _recover(self, damaged: dict[str, str]) -> dict[str, Chunk]:
        """Chunks of ids (-> the key the store links them to) whose entry is damaged or gone, read back
        from the text source: only a text whose tokens hash to that very key is taken (the id's own
        text, never another), and each one is named in the log. Their KV is then a miss: computed by
        the request that asked and stored again, so the id answers as before."""
        source = self.text_source
        if not damaged or source is None:
            return {}
        out: dict[str, Chunk] = {}
        for chunk in source(list(damaged)):
            key = damaged.get(chunk.id)
            if key is None or not isinstance(chunk.text, str) or not chunk.text.strip():
                continue
            if self.key(KIND_CHUNK, self.layout.chunk_ids(chunk)) != key:
                log.warning("chunk %r: its KV entry %s… is damaged or gone, and the index's text for it is not the text "
                            "the store linked: not answered", chunk.id, key[:12])
                continue
            log.warning("chunk %r: its KV entry %s… is damaged or gone; recomputing it from the index's text", chunk.id, key[:12])
            out[chunk.id] = chunk
        return out

    def _recover_unlinked(self, ids: list[str]) -> dict[str, Chunk]:
        """Chunks of ids the store's node-id index does not link (a Redis restarted empty, FLUSHALL) that
        were not removed, as `removed_ids_by`'s judge says (the server's: its retrieval index holds them),
        read back from the text source and linked again: every replica then answers them, not only the
        one whose table still holds them. Outside such a block none is read back (an id `forget` dropped
        stays unknown, whatever an index still holds)."""
        judge, source = self.removed_judge(), self.text_source
        if not ids or judge is None or source is None:
            return {}
        removed = set(judge(ids))
        alive = [u for u in ids if u not in removed]
        chunks = [c for c in source(alive) if c.id in alive and isinstance(c.text, str) and c.text.strip()] if alive else []
        if chunks:
            log.warning("%d chunk id(s) were not linked in the KV store (it lost its id index?) but the index holds them: "
                        "answered from the index's text and linked again (%s)", len(chunks), ", ".join(repr(c.id) for c in chunks[:5]))
            self.link(chunks)
        return {c.id: c for c in chunks}

    def bindings(self, chunk_ids: Sequence[str]) -> dict[str, tuple[str | None, Chunk | None]] | None:
        """What each id is bound to now: the store's link (every process's) and this process's chunk, for
        `rebind` to put back when a write fails half-way; None when the store's id index cannot be read."""
        links = self.store_links(list(chunk_ids))
        if links is None:
            return None
        with self._registry_lock:
            return {i: (k, self.chunks.get(i)) for i, k in zip(chunk_ids, links)}

    def rebind(self, previous: dict[str, tuple[str | None, Chunk | None]]) -> None:
        """Put ids back as `bindings` found them: a replace whose retrieval index write failed leaves the
        old text everywhere, never the new text by id and the old by retrieval. (The new text's KV entries
        stay in the store, content-keyed, linked by no id.)"""
        relink = {i: k for i, (k, _) in previous.items() if k}
        if relink:
            self.guarded.link([f"{self.namespace}/{i}" for i in relink], list(relink.values()))
        new = [i for i, (k, _) in previous.items() if not k]
        if new:
            self.unlink(new)
        with self._registry_lock:
            for i, (_, chunk) in previous.items():
                if chunk is None:
                    self.chunks.pop(i, None)
                else:
                    self.chunks[i] = chunk
                    self._tombstones.pop(i, None)
