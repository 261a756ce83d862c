"""The memory store admin and `open_admin`: the right admin for a store URL or object."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qs, urlparse


from kvrag.cache_backends import DiskStore, MemoryStore, StoreError, open_store, tier_urls
from kvrag.cache_backends.disk import DEFAULT_MAX_BYTES
from kvrag.cache_backends.redis_options import REDIS_SCHEMES
from kvrag.cache_backends.admin.base import EntryInfo, Link, StoreAdmin
from kvrag.cache_backends.admin.disk_admin import DiskAdmin
from kvrag.cache_backends.admin.redis_admin import RedisAdmin



# -- memory (a fresh process: empty; useful from Python with a live store) ---------------------
class MemoryAdmin(StoreAdmin):
    kind = "memory"
    store: MemoryStore

    def entries(self) -> Iterator[EntryInfo]:
        for key, e in list(self.store._items.items()):
            yield EntryInfo(key, e.nbytes, None, dict(e.meta), None)

    def verify(self, key: str) -> str | None:
        return None  # kept decoded: nothing to check

    def links(self) -> list[Link]:
        return [Link(u, k, u) for u, k in list(self.store._index.items())]

    def unlink(self, links: Sequence[Link]) -> None:
        for lk in links:
            self.store._index.pop(lk.handle, None)

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        for u in user_ids:
            self.store._index.pop(str(u), None)

    def cap(self) -> dict[str, Any]:
        return {"max_bytes": self.store.max_bytes}


def _open_disk(url: str) -> DiskStore:
    """A disk store that does not clean its temp files on open (so stats can show them and gc
    --dry-run deletes nothing); same URL rules as open_store."""
    from kvrag import cache_backends as cb

    parsed = urlparse(url)
    q = parse_qs(parsed.query, keep_blank_values=True)
    cb._check_options("disk", url, q)
    path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
    if not path:
        raise StoreError(f"disk store URL needs a path: {url!r} (e.g. disk:///var/cache/kvrag)")
    if not Path(path).expanduser().is_dir():
        raise StoreError(f"no store at {path}: the folder does not exist")
    cap = q.get("max_bytes", [""])[0].lower()
    max_bytes = None if cap == "none" else (cb._int(q, "max_bytes", url) if cap else DEFAULT_MAX_BYTES)
    return DiskStore(path, url=url, max_bytes=max_bytes, threads=1, clean_temp=False, warn_unsigned=False)


def open_admin(store: str | Any) -> StoreAdmin:
    """The admin view of a store URL (or an open store). Only disk, Redis and memory stores; a
    tiered URL is managed through its one disk or Redis tier."""
    if not isinstance(store, str):
        for cls, name in ((DiskStore, "disk"), (MemoryStore, "memory")):
            if isinstance(store, cls):
                return DiskAdmin(store) if name == "disk" else MemoryAdmin(store)
        if type(store).__name__ == "RedisStore":
            return RedisAdmin(store)
        raise StoreError(f"store management works on disk, redis and memory stores, not {type(store).__name__}")
    url = store
    scheme = urlparse(url).scheme.lower()
    if scheme == "tiered":
        lower = [u for u in tier_urls(url) if urlparse(u).scheme.lower() in ("disk", *REDIS_SCHEMES)]
        if len(lower) != 1:
            raise StoreError(f"{url!r} has {len(lower)} persistent tiers; run `kvrag store` on one of them: {', '.join(lower) or 'none'}")
        print(f"kvrag store: managing the persistent tier of the tiered store: {lower[0]}", file=sys.stderr)
        return open_admin(lower[0])
    if scheme == "disk":
        return DiskAdmin(_open_disk(url))
    if scheme in REDIS_SCHEMES:
        return RedisAdmin(open_store(url))
    if scheme == "memory":
        return MemoryAdmin(open_store(url))
    raise StoreError(
        f"`kvrag store` manages disk://, redis:// (rediss://) and memory:// stores (tiered:// through its "
        f"disk or redis tier), not {scheme or 'this'}:// ({url!r})"
    )
