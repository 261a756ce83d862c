"""Whether the store agrees with the retrieval index: retrieval answers an index entry only when the store's
node-id index binds its id to the text the index holds for it.

Why (issue 69): the index is shared and written by others, and the store key's MAC says an entry was once
written by kvrag, not that it is current. A Chroma writer without the key re-added an old signed version
after a replace (retrieval answered the old text while asking by id answered the new) or a deleted entry
(the chunk came back). Replace and delete keep each id's binding in the store (id -> its text's entry
key), every replica's, so that is what decides. Where the store cannot be read (a Redis outage) this
replica's own registry decides instead; an id it never saw is then answered as the index holds it (its MAC
still checked). Only with a store key: without one the index is trusted as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvrag.types import Chunk

log = logging.getLogger("kvrag.server")

STALE = "the store binds this id to other text: an old version (replayed into the index, or a replace not yet settled)"
UNBOUND = ("the store binds no text to this id: deleted (and re-added to the index), or never ingested for this "
           "model and layout")
STALE_HERE = "this replica holds other text for this id (the store cannot be read now): an old version"


class StoreBinding:
    """The server's `ChunkIndex.binding` where a store key is set (without one the index is answered as it
    holds it, as before: whoever writes it may write anything). An id the store binds to other text, or to
    none (deleted; or the store lost its ids: `kvrag ingest` again binds them), is skipped."""

    def __init__(self, rag: Any, strict: bool = True) -> None:
        self.rag, self.strict = rag, strict

    def _key(self, chunk: Chunk) -> str | None:
        repo = self.rag.repo
        try:
            return repo.chunk_key(repo.layout.chunk_ids(chunk, memo=False))
        except Exception:  # noqa: BLE001 (text a tokenizer refuses: kvrag.server.fit drops it, with its reason)
            return None

    def __call__(self, chunks: Sequence[Chunk]) -> list[str | None]:
        repo = self.rag.repo
        links = repo.store_links([c.id for c in chunks])
        if links is None:  # the store cannot say: this replica's own registry
            with repo._registry_lock:
                mine = [repo.chunks.get(c.id) for c in chunks]
            return [None if m is None or (m.text, m.title) == (c.text, c.title) else STALE_HERE for c, m in zip(chunks, mine)]
        out: list[str | None] = []
        for chunk, link in zip(chunks, links):
            if link is None:
                out.append(UNBOUND if self.strict else None)
                continue
            key = self._key(chunk)
            out.append(None if key is None or key == link else STALE)
        return out
