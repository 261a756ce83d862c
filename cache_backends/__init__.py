"""KV stores chosen by URL.

- `memory://?max_bytes=N` — in-process LRU
- `disk:///path?max_bytes=N&quantize=int8` — the embedded default
- `redis://[:password@]host:port/db?ttl=S` (also `rediss://`) — shared by many workers
- `tiered://?lower=<disk or redis URL>&max_bytes=N` — memory over disk/Redis with prefetch
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

from .base import ByteStore, CorruptEntryError, KVEntry, KVStore, StoreError, StoreStats, content_key
from .disk import DiskStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = [
    "ByteStore",
    "CorruptEntryError",
    "DiskStore",
    "KVEntry",
    "KVStore",
    "MemoryStore",
    "StoreError",
    "StoreStats",
    "TieredStore",
    "content_key",
    "open_store",
]


def _int(q: dict, name: str) -> int | None:
    return int(float(q[name][0])) if name in q else None


def _quantize(q: dict) -> bool:
    value = q.get("quantize", ["none"])[0].lower()
    if value not in ("none", "int8", "0", "1", "false", "true"):
        raise StoreError(f"quantize must be none or int8, got {value!r}")
    return value in ("int8", "1", "true")


def open_store(url: str | None = None, default_root: str | Path | None = None) -> KVStore:
    """Open a store from its URL (see the module docstring); None means a disk store at `default_root`."""
    if url is None:
        if default_root is None:
            raise StoreError("no store URL and no default folder given")
        return DiskStore(default_root)
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    q = parse_qs(parsed.query)
    if scheme == "memory":
        return MemoryStore(max_bytes=_int(q, "max_bytes"), url=url)
    if scheme == "disk":
        path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        if not path:
            raise StoreError(f"disk store URL needs a path: {url!r} (e.g. disk:///var/cache/kvrag)")
        return DiskStore(path, url=url, max_bytes=_int(q, "max_bytes"), quantize=_quantize(q))
    if scheme in ("redis", "rediss"):
        from .redis_store import RedisStore

        return RedisStore(url, quantize=_quantize(q))
    if scheme == "tiered":
        lower = q.get("lower", [None])[0]
        if not lower or lower.startswith("tiered"):
            raise StoreError(f"tiered store URL needs a lower tier: tiered://?lower=disk:///path (got {url!r})")
        return TieredStore(open_store(lower), max_bytes=_int(q, "max_bytes") or (2 << 30), url=url)
    raise StoreError(
        f"unknown store URL scheme {scheme!r} in {url!r}; supported: memory://, disk:///path, redis://host:port/db, "
        "rediss://, tiered://?lower=..."
    )
