"""The store's node-id index as a registry reads it: the id -> entry key links every process sharing the
store writes (namespaced per model and layout), how many there are, and all of them where that is cheap.

Why its own module: `ChunkRegistry` (kvrag.kv.registry) decides what an id means; this only reads the
store, telling "unbound" from "the store cannot say" (`store_links`), which that decision rests on.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kvrag.cache_backends import content_key

if TYPE_CHECKING:
    from kvrag.cache_backends.guarded import GuardedStore
    from kvrag.kv.layout import PromptLayout
    from kvrag.model.loading import LoadedModel

log = logging.getLogger(__name__)

SHARE_SCAN_LIMIT = 10_000  # forgetting an id reads the store's whole id index only up to this many ids


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


class StoreIdIndex:
    """Reads of the store's node-id index (a base of ChunkRegistry)."""

    lm: LoadedModel
    layout: PromptLayout
    guarded: GuardedStore

    @property
    def namespace(self) -> str:
        """The node-id index namespace: ids map to keys per (model, layout), so engines with another
        model or system prompt sharing a store never overwrite each other's ids."""
        return content_key(self.lm.fingerprint, self.layout.identity)[:16]

    def store_links(self, chunk_ids: Sequence[str]) -> list[str | None] | None:
        """The entry key the store's node-id index binds each id to (None: unbound), or None when the
        store could not be read (a fault, or a Redis inside its back-off after one): unlike
        `guarded.resolve`, "unbound" and "cannot tell" differ."""
        names = [f"{self.namespace}/{i}" for i in chunk_ids]
        try:
            links = list(self.guarded.store.resolve(names))
        except Exception as exc:  # a store fault never fails a request
            log.warning("store resolve failed (%s)", exc)
            return None
        if getattr(self._index_store(), "available", True) is False:  # its own fault handling answered None
            return None
        return links if len(links) == len(names) else None

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
