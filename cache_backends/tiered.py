"""A stack of stores, fastest first (GPU memory, host RAM, disk, Redis), with promotion and prefetch.

URL: `tiered://?workers=4&tiers=<url>|<url>|...` -- `tiers=` comes last and everything after it is
the tier list, split on `|`; each tier is a store URL with its own options (`&` inside a tier URL
belongs to that tier), or a bare scheme name (`memory`, `host`). Example, the CUDA default:

    tiered://?tiers=memory://?device=cuda&max_bytes=2147483648|host://?pin=1|disk:///var/kv?pin=1

The older `tiered://?lower=<url>&max_bytes=N` means `tiers=memory://?max_bytes=N|<url>`.

A get asks the tiers top-down, each for the keys still missing, in one `get_many` per tier (so the
disk tier reads them in parallel); an entry found in a lower tier is promoted into every tier above
it (copied to the GPU, pinned host memory, ...), and the copy from the topmost tier that kept it is
returned, with `entry.tier` naming the tier that hit. A put writes through every tier, bottom first.
The node-id index lives in the bottom tier, the shared and persistent one.

Where a tier above uploads to a GPU (the CUDA default), a lower tier is read `READ_GROUP` entries at a
time and each group promoted as soon as it lands: its copies to the GPU are asynchronous
(memory.to_device), so they run while the next group is read from disk, and a cold chunk fills
the pinned host tier on the way (it keeps the disk read's pinned buffer: no copy).

`prefetch(keys)` starts the same lookup-and-promote in a background thread as soon as the chunk ids
are known (FusionRAG's loader); a later `get` takes what the top tier has and waits only for
entries still in flight.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

import torch

from .redis_options import redact_url
from .base import KVEntry, KVStore, StoreStats, check_key
from .memory import MemoryStore

READ_GROUP = 8  # entries a lower tier reads at a time when the tiers above upload to a GPU (see the module docstring)


def tier_name(store: KVStore) -> str:
    name = getattr(store, "tier", "") or type(store).__name__.removesuffix("Store").lower()
    return str(name)


class TieredStore:
    def __init__(
        self,
        lower: KVStore | Sequence[KVStore],
        max_bytes: int | None = 2 << 30,
        workers: int = 4,
        url: str | None = None,
    ) -> None:
        tiers = list(lower) if isinstance(lower, (list, tuple)) else [MemoryStore(max_bytes=max_bytes), lower]
        if len(tiers) < 2:
            raise ValueError("a tiered store needs at least two tiers")
        self.tiers: list[KVStore] = tiers
        names: list[str] = []
        for t in tiers:
            base = tier_name(t)
            names.append(base if base not in names else f"{base}{len(names)}")
        self.names = names
        self.url = redact_tiers(url) if url else "tiered://?tiers=" + "|".join(t.url for t in tiers)  # no password in clear
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvrag-prefetch")
        self._inflight: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._stats = StoreStats()
        self._group = READ_GROUP if any(_uploads(t) for t in tiers) else 0

    @property
    def quantize(self) -> str:
        """The coarsest precision any tier keeps entries at: an entry may be served from that tier, so
        the cache key (kvrag.kv.repository) must say so, or a lossy entry would pass as an exact one."""
        from .format import STORAGE, storage_of

        kept = [storage_of(getattr(t, "quantize", False)) for t in self.tiers]
        return max(kept, key=STORAGE.index)

    @property
    def upper(self) -> KVStore:
        return self.tiers[0]

    @property
    def lower(self) -> KVStore:
        return self.tiers[-1]

    # -- lookup and promotion ---------------------------------------------------------------------
    def _promote(self, key: str, entry: KVEntry, level: int) -> KVEntry:
        for upper in reversed(self.tiers[:level]):
            kept = upper.put(key, entry)
            if isinstance(kept, KVEntry):
                entry = kept
        return dataclasses.replace(entry, tier=self.names[level])

    def _lookup(self, keys: Sequence[str], start: int = 1) -> dict[str, KVEntry]:
        """Ask tiers[start:] top-down for `keys`; promote and return what was found."""
        found: dict[str, KVEntry] = {}
        pending = list(dict.fromkeys(keys))
        for level in range(start, len(self.tiers)):
            if not pending:
                break
            rest = []
            step = self._group or len(pending)
            for lo in range(0, len(pending), step):
                part = pending[lo : lo + step]
                for key, entry in zip(part, self.tiers[level].get_many(part)):
                    if entry is None:
                        rest.append(key)
                    else:
                        found[key] = self._promote(key, entry, level)
            pending = rest
        return found

    def _load(self, keys: list[str]) -> dict[str, KVEntry]:
        try:
            return self._lookup(keys)
        finally:
            with self._lock:
                for key in keys:
                    self._inflight.pop(key, None)

    def prefetch(self, keys: Iterable[str]) -> None:
        with self._lock:
            todo = [check_key(k) for k in dict.fromkeys(keys) if k not in self._inflight and not self.upper.contains(k)]
            if not todo:
                return
            fut = self._pool.submit(self._load, todo)
            for key in todo:
                self._inflight[key] = fut
            self._stats.prefetched += len(todo)

    # -- the protocol -----------------------------------------------------------------------------
    def get(self, key: str) -> KVEntry | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        for key in keys:
            check_key(key)
        out = self.upper.get_many(keys)
        missing = [k for k, e in zip(keys, out) if e is None]
        found: dict[str, KVEntry] = {}
        if missing:
            with self._lock:
                waits = {k: self._inflight[k] for k in missing if k in self._inflight}
            for key, fut in waits.items():
                entry = fut.result().get(key)
                if entry is not None:
                    found[key] = entry
            found.update(self._lookup([k for k in missing if k not in found and k not in waits]))
        result: list[KVEntry | None] = [e if e is not None else found.get(k) for k, e in zip(keys, out)]
        with self._lock:
            for entry in result:
                if entry is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.bytes_read += entry.nbytes
        return result

    def put(self, key: str, entry: KVEntry) -> None:
        for tier in reversed(self.tiers):
            tier.put(key, entry)
        with self._lock:
            self._stats.puts += 1
            self._stats.bytes_written += entry.nbytes

    def contains(self, key: str) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def delete(self, key: str) -> None:
        for tier in self.tiers:
            tier.delete(key)

    def stats(self) -> StoreStats:
        return self._stats

    def tier_stats(self) -> dict[str, StoreStats]:
        """Each tier's own counters, by tier name."""
        return {name: t.stats() for name, t in zip(self.names, self.tiers)}

    def limit_entry_bytes(self, n: int | None) -> None:
        """Bound every tier's entries (see ByteStore.limit_entry_bytes); a tier without a bound is left as it is."""
        for t in self.tiers:
            limit = getattr(t, "limit_entry_bytes", None)
            if callable(limit):
                limit(n)

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        self.lower.link(user_ids, keys)

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self.lower.resolve(user_ids)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every prefetch in flight has finished."""
        with self._lock:
            pending = set(self._inflight.values())
        for fut in pending:
            fut.result(timeout=timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for t in self.tiers:
            close = getattr(t, "close", None)
            if callable(close):
                close()


def _uploads(store: KVStore) -> bool:
    """Whether the tier keeps its entries on a GPU (its puts copy them there)."""
    device = getattr(store, "device", None)
    return isinstance(device, torch.device) and device.type == "cuda"


def redact_tiers(url: str) -> str:
    """A tiered URL with every tier's credentials replaced by ***."""
    head, sep, tiers = url.partition("tiers=")
    if not sep:
        return redact_url(url)
    return head + sep + "|".join(redact_url(t) if "@" in t or "password=" in t else t for t in tiers.split("|"))
