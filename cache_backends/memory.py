"""An in-process LRU store, bounded in bytes; entries are kept decoded (no copy on get).

With `device=None` (the default) entries are kept as given, by reference; with a device
(`memory://?device=cuda`, the GPU tier) `put` copies them there once, so later gets need no
transfer: from host memory asynchronously (`to_device`), so the host goes on (reading the next
entries from disk) while the copy runs. `put` returns the entry as kept, which the tiered store
hands back after a promotion.
A `get` returns a shallow copy of the kept entry with `tier` set ("memory", or "gpu" on CUDA).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import Iterable, Sequence

import torch

from .base import KVEntry, StoreStats, check_key

_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}
_STREAMS_LOCK = threading.Lock()


def upload_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream host-to-device copies of entries run on (one per device, made on first use)."""
    with _STREAMS_LOCK:
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device)
        return stream


def to_device(t: torch.Tensor, device: torch.device, copy: bool = False) -> torch.Tensor:
    """`t` on `device`. A host tensor bound for a GPU is copied on the upload stream with
    non_blocking=True: from pinned memory (the disk and host tiers' buffers on CUDA) an asynchronous
    DMA at the link's speed (~47 against ~7.5 GB/s from pageable memory on an H200), so the host goes
    on while it runs. The caller's current stream waits for it on the device (no host sync), so
    whatever is queued there later sees the whole copy. The source stays safe: torch's pinned
    allocator does not reuse a pinned block before the copies issued from it are done."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, copy=copy)
    current = torch.cuda.current_stream(device)
    stream = upload_stream(device)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)  # allocated in `current`'s order: freed in it too
    stream.wait_stream(current)  # the block may be one that work queued on `current` still uses
    with torch.cuda.stream(stream):
        out.copy_(t, non_blocking=True)
    current.wait_stream(stream)
    return out


class MemoryStore:
    tier = "memory"

    def __init__(self, max_bytes: int | None = None, url: str = "memory://", device: str | torch.device | None = None) -> None:
        self.url = url
        self.max_bytes = max_bytes
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda":
            self.tier = "gpu"
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
        return dataclasses.replace(entry, tier=self.tier)

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        return [self.get(k) for k in keys]

    def _to_tier(self, t: torch.Tensor, mapped: bool = False) -> torch.Tensor:
        """Where this tier keeps a tensor: as given, copied to its device, or (a view of a file's mapped
        pages, which another process could truncate under it) copied into memory of its own."""
        if self.device is not None:
            return to_device(t, self.device, copy=mapped)
        return t.clone() if mapped else t

    def _ids(self, entry: KVEntry) -> torch.Tensor | None:
        """The token ids as kept: a copy of their own where the file's pages hold them (mapped) or where
        the tensors moved off the host (a GPU tier), so a view never keeps the whole read buffer alive."""
        ids = entry.token_ids
        moved = self.device is not None and self.device.type != "cpu"
        return ids.clone() if ids is not None and (entry.mapped or moved) else ids

    def put(self, key: str, entry: KVEntry) -> KVEntry | None:
        """Keep `entry` (moved to this tier's memory); returns the entry as kept, None if too large."""
        check_key(key)
        if self.max_bytes is not None and entry.nbytes > self.max_bytes:
            self.delete(key)
            return None  # larger than the whole budget: not kept
        entry = dataclasses.replace(
            entry,
            keys=self._to_tier(entry.keys, entry.mapped),
            values=self._to_tier(entry.values, entry.mapped),
            meta=dict(entry.meta),
            token_ids=self._ids(entry),
            tier=None,
            mapped=False,
        )
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = entry
            self._bytes += entry.nbytes
            self._stats.puts += 1
            self._stats.bytes_written += entry.nbytes
            while self.max_bytes is not None and self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._stats.evictions += 1
        return entry

    def contains(self, key: str) -> bool:
        return check_key(key) in self._items

    def clear(self) -> None:
        """Drop every entry (the node-id index stays): the next get of each goes to the tier below,
        as after a restart (`kvrag bench speed` times each tier this way)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._items.pop(check_key(key), None)
            if old is not None:
                self._bytes -= old.nbytes

    def stats(self) -> StoreStats:
        return self._stats

    def prefetch(self, keys: Iterable[str]) -> None:
        """Everything is in memory already."""

    def limit_entry_bytes(self, n: int | None) -> None:
        """Nothing to bound: every entry here was put by this process (from a verified read or a compute)."""

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
