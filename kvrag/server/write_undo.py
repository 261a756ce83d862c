"""A write through `POST /v1/chunks` that the store did not take whole is undone, so a 503 leaves nothing
behind: this replica's registration, the store's links it wrote, and the KV entries it computed now.

Why (issue 69): Redis killed mid-replace gave a 503 `kv_not_stored`, and then the index held the old text
while that replica answered the new one by id, even after FLUSHALL: the new chunk stayed registered here
(answered by id, its KV computed at question time), while the index kept the old entry. Now each id whose
write did not land whole (its KV not kept, or the store's link to it not confirmed by reading it back) is
put back as it was before the call: the registration here (the old chunk, or none), the store's link (only
where the link is still the one this call wrote: a later writer's is never overwritten), and the entry it
computed now (content-keyed and linked by no id: dropped from every tier that has it, a memory tier first).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from kvrag.types import Chunk

log = logging.getLogger("kvrag.server")


@dataclass
class WriteUndo:
    """What one ingest's ids held before it wrote: taken before `precompute`, applied to the ids that failed."""

    repo: Any
    chunks: list[Chunk]
    keys: list[str]  # each chunk's new entry key
    local: dict[str, Chunk | None] = field(default_factory=dict)
    links: list[str | None] | None = None  # the store's links before (None: it could not be read)
    present: list[bool] = field(default_factory=list)  # whether each new key's entry was already kept

    @classmethod
    def before(cls, repo: Any, chunks: Sequence[Chunk], keys: Sequence[str]) -> "WriteUndo":
        ids = [c.id for c in chunks]
        with repo._registry_lock:
            local = {i: repo.chunks.get(i) for i in ids}
        present = [bool(repo.guarded.contains(k)) for k in keys]
        return cls(repo, list(chunks), list(keys), local, repo.store_links(ids), present)

    def failed(self, not_stored: Sequence[str]) -> list[str]:
        """The ids whose write did not land whole: the KV not kept, or the store's link not read back as this
        call's (the store unreadable now, or the link lost)."""
        missing = set(not_stored)
        now = self.repo.store_links([c.id for c in self.chunks])
        if now is None:
            return [c.id for c in self.chunks]
        return [c.id for c, key, link in zip(self.chunks, self.keys, now) if c.id in missing or link != key]

    def undo(self, ids: Sequence[str]) -> None:
        """Put these ids back as they were before the call (see the module docstring)."""
        if not ids:
            return
        repo, todo = self.repo, set(ids)
        rows = [j for j, c in enumerate(self.chunks) if c.id in todo]
        now = repo.store_links([self.chunks[j].id for j in rows])
        relink: dict[str, str] = {}
        unlink: list[str] = []
        for n, j in enumerate(rows):
            cid = self.chunks[j].id
            ours = now is None or now[n] == self.keys[j]  # unreadable: our link may have landed; put back what we can
            old = None if self.links is None else self.links[j]
            if ours and old is not None and old != self.keys[j]:
                relink[cid] = old
            elif ours and self.links is not None and old is None:
                unlink.append(cid)
        if relink:
            repo.guarded.link([f"{repo.namespace}/{i}" for i in relink], list(relink.values()))
        if unlink:
            repo.unlink(unlink)
        with repo._registry_lock:
            for j in rows:
                cid, old_chunk = self.chunks[j].id, self.local.get(self.chunks[j].id)
                if old_chunk is None:
                    repo.chunks.pop(cid, None)
                else:
                    repo.chunks[cid] = old_chunk
        for j in rows:
            if not self.present[j] and not any(k == self.keys[j] for i, k in enumerate(self.keys) if i not in rows):
                repo.guarded.delete(self.keys[j])  # computed by this call: linked by no id once undone
        log.warning("ingest of %d chunk id(s) not kept whole by the store (%s%s): put back as they were before the call",
                    len(rows), ", ".join(repr(self.chunks[j].id) for j in rows[:5]), " ..." if len(rows) > 5 else "")
