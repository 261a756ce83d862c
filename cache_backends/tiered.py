"""Hot entries in memory over a lower store (disk or Redis), with asynchronous prefetch.

`prefetch(keys)` starts loading from the lower tier in background threads as soon as the chunk
ids are known (FusionRAG's loader); a later `get` takes what is already in memory and waits only
for entries still in flight. Writes go through to the lower tier and stay hot in memory.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

from .base import KVEntry, KVStore, StoreStats, check_key
from .memory import MemoryStore


class TieredStore:
    def __init__(self, lower: KVStore, max_bytes: int | None = 2 << 30, workers: int = 4, url: str | None = None) -> None:
        self.lower = lower
        self.upper = MemoryStore(max_bytes=max_bytes)
        self.url = url or f"tiered://?lower={lower.url}"
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvrag-prefetch")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stats = StoreStats()

    def _load(self, key: str) -> KVEntry | None:
        try:
            entry = self.lower.get(key)
            if entry is not None:
                self.upper.put(key, entry)
            return entry
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def prefetch(self, keys: Iterable[str]) -> None:
        for key in keys:
            check_key(key)
            with self._lock:
                if key in self._inflight or self.upper.contains(key):
                    continue
                self._inflight[key] = self._pool.submit(self._load, key)
                self._stats.prefetched += 1

    def get(self, key: str) -> KVEntry | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        out: list[KVEntry | None] = []
        for key in keys:
            check_key(key)
            entry = self.upper.get(key) if self.upper.contains(key) else None
            if entry is None:
                with self._lock:
                    fut = self._inflight.get(key)
                entry = fut.result() if fut is not None else self._load(key)
            with self._lock:
                if entry is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.bytes_read += entry.nbytes
            out.append(entry)
        return out

    def put(self, key: str, entry: KVEntry) -> None:
        self.lower.put(key, entry)
        self.upper.put(key, entry)
        with self._lock:
            self._stats.puts += 1
            self._stats.bytes_written += entry.nbytes

    def contains(self, key: str) -> bool:
        return self.upper.contains(key) or self.lower.contains(key)

    def delete(self, key: str) -> None:
        self.upper.delete(key)
        self.lower.delete(key)

    def stats(self) -> StoreStats:
        return self._stats

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        self.lower.link(user_ids, keys)

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self.lower.resolve(user_ids)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every prefetch in flight has finished."""
        with self._lock:
            pending = list(self._inflight.values())
        for fut in pending:
            fut.result(timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
