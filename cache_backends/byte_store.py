"""Shared logic of the stores that keep encoded bytes (disk, Redis): decode, verify, count, evict corrupt.

Both take `key=` (default: `$KVRAG_STORE_KEY`; see format.MacKey): with a key, every entry written
is signed and every entry read must carry a valid MAC, else it is a miss, counted in `stats().unverified`
and warned about once, but never deleted: it may be another writer's genuine data (see trust.py). Damage
(a bad checksum without a key, an unreadable header) is still a logged miss that deletes the entry. Both take a bound on
an entry's size (`limit_entry_bytes`, set by the engine from its model) that a read checks before it
allocates, maps or decodes anything.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable, Sequence

import torch

from .base import CorruptEntryError, KVEntry, StoreStats, check_key
from .format import MacKey, StaleEntryError, UnverifiedEntryError, decode_entry, encode_entry, mac_key
from .trust import HINT, WarnOnce, count_unverified

log = logging.getLogger(__name__)


Fetched = tuple["KVEntry | CorruptEntryError | None", int]  # a decoded entry, its damage, or a miss; bytes read


class ByteStore:
    """Shared logic of stores that keep encoded bytes (disk, Redis): decode, verify, count, evict corrupt.

    Subclasses implement `_read_many`, `_write`, `_remove`, `_exists`, `_link` and `_resolve`; a
    backend that can read into its own buffers and decode in parallel (disk) overrides `_fetch_many`.
    `_read_many` may return bytes or 1-D uint8 CPU tensors (entries decoded from a tensor view it), or
    the CorruptEntryError it found before reading (a value over the entry limit).
    """

    url: str = ""
    tier: str = ""  # the name reported in KVEntry.tier; default: the class name less "Store"

    def __init__(self, quantize: bool = False, key: str | bytes | MacKey | None = None) -> None:
        """`key`: the secret entries are signed and checked with (see format.MacKey); None: from
        `$KVRAG_STORE_KEY`, unset or empty meaning no key (an empty `key` means none too)."""
        self.quantize = quantize
        self.mac_key = mac_key(key)
        self.entry_limit: int | None = None  # bytes; see limit_entry_bytes
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._warn = WarnOnce()

    def limit_entry_bytes(self, n: int | None) -> None:
        """Refuse any entry over `n` bytes as a logged miss, checked before a read allocates or maps
        it. The engine calls this with its model's largest possible entry (format.entry_bytes_bound);
        a store shared by engines of several models keeps the largest bound asked for. None lifts it."""
        with self._lock:
            self.entry_limit = None if n is None else max(int(n), self.entry_limit or 0)

    # -- raw operations, per backend ------------------------------------------------------------
    def _read_many(self, keys: Sequence[str]) -> list[bytes | CorruptEntryError | None]:
        raise NotImplementedError

    def _fetch_many(self, keys: Sequence[str]) -> list[Fetched]:
        """Read and decode each key: (entry, bytes read), (CorruptEntryError, bytes read) or (None, 0)."""
        return [decode_fetched(data, self.mac_key, k, self.entry_limit) for k, data in zip(keys, self._read_many(keys))]

    def _write(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _remove(self, key: str) -> None:
        raise NotImplementedError

    def _exists(self, key: str) -> bool:
        raise NotImplementedError

    def _link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        raise NotImplementedError

    def _resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        raise NotImplementedError

    # -- the protocol -----------------------------------------------------------------------------
    def get(self, key: str) -> KVEntry | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        for k in keys:
            check_key(k)
        name = self.tier or type(self).__name__.removesuffix("Store").lower()
        out: list[KVEntry | None] = []
        for key, (entry, nbytes) in zip(keys, self._fetch_many(keys)):
            if isinstance(entry, UnverifiedEntryError):
                self._unverified_entry(key, entry)
                entry = None
            elif isinstance(entry, CorruptEntryError):
                if isinstance(entry, StaleEntryError):
                    log.info("dropping cache entry %s… of an older format: %s", key[:12], entry)
                else:
                    log.warning("deleting corrupt cache entry %s…: %s", key[:12], entry)
                    with self._lock:
                        self._stats.errors += 1
                self._remove(key)
                entry = None
            with self._lock:
                if entry is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.bytes_read += nbytes
            if entry is not None:
                entry.tier = name
            out.append(entry)
        return out

    def _unverified_entry(self, key: str, exc: UnverifiedEntryError) -> None:
        """A keyed read met an entry its key cannot verify: a miss, counted, warned about once, kept."""
        with self._lock:
            self._stats.unverified += 1
        count_unverified(entries=1)
        self._warn("entry", "store %s holds entries its key cannot verify (%s… : %s); they are misses, never "
                   "served and never deleted: %s", self.url, key[:12], exc, HINT)

    def _unverified_ref(self, digest: str, status: str) -> None:
        """A keyed resolve met an id ref its key cannot verify: a miss, counted, warned about once, kept."""
        with self._lock:
            self._stats.unverified_refs += 1
        count_unverified(refs=1)
        self._warn("ref", "store %s holds id refs its key cannot verify (ref %s…: %s); those ids are misses, "
                   "never served: %s", self.url, digest[:12], status, HINT)

    def _bad_ref(self, where: str, reason: str) -> None:
        """An id ref that is no small regular file: a miss, logged (`kvrag store gc` removes it)."""
        with self._lock:
            self._stats.bad_refs += 1
        log.warning("id ref %s is %s: a miss (`kvrag store gc` removes it)", where, reason)

    def warn_unsigned(self, limit: int = 256) -> int:
        """On opening a keyed store: look at up to `limit` entry headers and warn once if some carry no
        MAC (written without the key), so an operator learns at start-up, not from misses. Returns how
        many of those seen are unsigned."""
        if self.mac_key is None:
            return 0
        try:
            metas = self._sample_headers(limit)
        except Exception as exc:  # noqa: BLE001 - a look at start-up never fails the open
            log.debug("could not look at %s's entries at start-up: %s", self.url, exc)
            return 0
        unsigned = sum(1 for m in metas if "mac" not in m)
        if unsigned:
            self._warn("open", "store %s: %d of the %d entries looked at%s carry no MAC (written without the store "
                       "key); a reader with the key treats them as misses and keeps them: %s",
                       self.url, unsigned, len(metas), "" if len(metas) < limit else " (the first)", HINT)
        return unsigned

    def _sample_headers(self, limit: int) -> list[dict[str, str]]:
        """The metadata of up to `limit` entries, read from their headers only (per backend)."""
        return []

    def put(self, key: str, entry: KVEntry) -> None:
        data = encode_entry(entry, quantize=self.quantize, key=self.mac_key, name=check_key(key))
        self._write(key, data)
        with self._lock:
            self._stats.puts += 1
            self._stats.bytes_written += len(data)

    def contains(self, key: str) -> bool:
        return self._exists(check_key(key))

    def delete(self, key: str) -> None:
        self._remove(check_key(key))

    def stats(self) -> StoreStats:
        return self._stats

    def prefetch(self, keys: Iterable[str]) -> None:
        """Nothing to do here; the tiered store prefetches from a byte store into memory."""

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        for k in keys:
            check_key(k)
        self._link([str(u) for u in user_ids], list(keys))

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self._resolve([str(u) for u in user_ids])


def decode_fetched(data: Any, key: MacKey | None = None, name: str = "", limit: int | None = None) -> Fetched:
    """Decode one raw read (bytes, a uint8 tensor, None for a miss, or the CorruptEntryError the read
    found) without raising; with `key`, only an entry whose MAC for the store key `name` verifies;
    with `limit`, only one of at most `limit` bytes."""
    if data is None:
        return None, 0
    if isinstance(data, CorruptEntryError):
        return data, 0
    nbytes = data.numel() if isinstance(data, torch.Tensor) else len(data)
    if limit is not None and nbytes > limit:
        return CorruptEntryError(f"entry of {nbytes} bytes is over this store's entry limit ({limit} bytes)"), 0
    try:
        return decode_entry(data, key, name), nbytes
    except CorruptEntryError as exc:
        return exc, nbytes
