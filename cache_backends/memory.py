"""An in-process LRU store, bounded in bytes; entries are kept decoded (no copy on get)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable, Sequence

from .base import KVEntry, StoreStats, check_key


class MemoryStore:
    def __init__(self, max_bytes: int | None = None, url: str = "memory://") -> None:
        self.url = url
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, KVEntry] = OrderedDict()
        self._bytes = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._index: dict[str, str] = {}

    def get(self, key: str) -> KVEntry | None:
        with self._lock:
            entry = self._items.get(check_key(key))
            if entry is None:
                self._stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._stats.hits += 1
            self._stats.bytes_read += entry.nbytes
            return entry

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, entry: KVEntry) -> None:
        with self._lock:
            check_key(key)
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            if self.max_bytes is not None and entry.nbytes > self.max_bytes:
                return  # larger than the whole budget: not kept
            self._items[key] = entry
            self._bytes += entry.nbytes
            self._stats.puts += 1
            self._stats.bytes_written += entry.nbytes
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._stats.evictions += 1

    def contains(self, key: str) -> bool:
        return check_key(key) in self._items

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(check_key(key), None)
            if old is not None:
                self._bytes -= old.nbytes

    def stats(self) -> StoreStats:
        return self._stats

    def prefetch(self, keys: Iterable[str]) -> None:
        """Everything is in memory already."""

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        with self._lock:
            for uid, key in zip(user_ids, keys):
                self._index[str(uid)] = check_key(key)

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return [self._index.get(str(u)) for u in user_ids]

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
