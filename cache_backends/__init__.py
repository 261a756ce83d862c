"""KV stores chosen by URL: memory://, disk:///path."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

from .base import CorruptEntryError, KVEntry, KVStore, StoreError, StoreStats, content_key
from .disk import DiskStore
from .memory import MemoryStore

__all__ = [
    "CorruptEntryError",
    "DiskStore",
    "KVEntry",
    "KVStore",
    "MemoryStore",
    "StoreError",
    "StoreStats",
    "content_key",
    "open_store",
]


def open_store(url: str | None = None, default_root: str | Path | None = None) -> KVStore:
    """Open a store from a URL: `memory://?max_bytes=N`, `disk:///abs/path` (default: `default_root`)."""
    if url is None:
        if default_root is None:
            raise StoreError("no store URL and no default folder given")
        return DiskStore(default_root)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme == "memory":
        q = parse_qs(parsed.query)
        max_bytes = int(q["max_bytes"][0]) if "max_bytes" in q else None
        return MemoryStore(max_bytes=max_bytes, url=url)
    if scheme == "disk":
        path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        if not path:
            raise StoreError(f"disk store URL needs a path: {url!r} (e.g. disk:///var/cache/kvrag)")
        return DiskStore(path, url=url)
    raise StoreError(f"unknown store URL scheme {scheme!r} in {url!r}; supported: memory://, disk:///path")
