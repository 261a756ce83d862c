"""The store protocol, the entry type, the store's errors, and the shared byte-store logic.

Stores hold opaque, content-addressed entries: the key already encodes the model fingerprint,
layout, entry kind and chunk tokens, so a store never needs to understand what it holds. Beside
the entries, a store keeps a node-id index (user id -> content key) so integrations can name
chunks by their own ids, and changed text under an old id becomes a miss rather than stale KV.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from kvrag.errors import KVRagError

log = logging.getLogger(__name__)


class StoreError(KVRagError):
    """A store could not be used (unreachable, misconfigured)."""


class CorruptEntryError(StoreError):
    """An entry's bytes failed to decode or its checksum did not match."""


class StoreURLError(StoreError, ValueError):
    """A store URL names an unknown option or a bad value."""


@dataclass
class KVEntry:
    """One cached segment: keys [layers, kv_heads, tokens, head_dim] (RoPE-free), values alike,
    and optionally the segment's token ids (which make the entry self-contained).

    `tier` names the store tier that served a `get` ("memory", "gpu", "host", "disk", "redis"),
    so callers can report where their KV came from; None on entries not read from a store."""

    keys: torch.Tensor
    values: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)
    token_ids: torch.Tensor | None = None
    tier: str | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def content_key(*parts: str | bytes | Sequence[int]) -> str:
    """A hex content address over the given parts (strings, bytes or token id lists)."""
    h = hashlib.sha256()
    for p in parts:
        if isinstance(p, str):
            b = p.encode()
        elif isinstance(p, bytes):
            b = p
        else:
            b = ",".join(str(int(t)) for t in p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    evictions: int = 0
    prefetched: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class KVStore(Protocol):
    """What the engine needs from a KV store."""

    url: str

    def get(self, key: str) -> KVEntry | None: ...

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]: ...

    def put(self, key: str, entry: KVEntry) -> None: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def stats(self) -> StoreStats: ...

    def prefetch(self, keys: Iterable[str]) -> None: ...

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None: ...

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]: ...


def check_key(key: str) -> str:
    """Keys are hex digests; anything else is refused so no user text can reach a file name."""
    if not isinstance(key, str) or not (16 <= len(key) <= 128) or any(c not in "0123456789abcdef" for c in key):
        raise StoreError(f"invalid store key {str(key)[:40]!r}: expected a lowercase hex digest")
    return key


Fetched = tuple["KVEntry | CorruptEntryError | None", int]  # a decoded entry, its damage, or a miss; bytes read


class ByteStore:
    """Shared logic of stores that keep encoded bytes (disk, Redis): decode, verify, count, evict corrupt.

    Subclasses implement `_read_many`, `_write`, `_remove`, `_exists`, `_link` and `_resolve`; a
    backend that can read into its own buffers and decode in parallel (disk) overrides `_fetch_many`.
    `_read_many` may return bytes or 1-D uint8 CPU tensors; entries decoded from a tensor view it.
    """

    url: str = ""
    tier: str = ""  # the name reported in KVEntry.tier; default: the class name less "Store"

    def __init__(self, quantize: bool = False) -> None:
        self.quantize = quantize
        self._stats = StoreStats()
        self._lock = threading.Lock()

    # -- raw operations, per backend ------------------------------------------------------------
    def _read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        raise NotImplementedError

    def _fetch_many(self, keys: Sequence[str]) -> list[Fetched]:
        """Read and decode each key: (entry, bytes read), (CorruptEntryError, bytes read) or (None, 0)."""
        return [decode_fetched(data) for data in self._read_many(keys)]

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
        from .format import StaleEntryError

        for k in keys:
            check_key(k)
        name = self.tier or type(self).__name__.removesuffix("Store").lower()
        out: list[KVEntry | None] = []
        for key, (entry, nbytes) in zip(keys, self._fetch_many(keys)):
            if isinstance(entry, CorruptEntryError):
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

    def put(self, key: str, entry: KVEntry) -> None:
        from .format import encode_entry

        data = encode_entry(entry, quantize=self.quantize)
        self._write(check_key(key), data)
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


def decode_fetched(data: Any) -> Fetched:
    """Decode one raw read (bytes, a uint8 tensor, or None for a miss) without raising."""
    from .format import decode_entry

    if data is None:
        return None, 0
    nbytes = data.numel() if isinstance(data, torch.Tensor) else len(data)
    try:
        return decode_entry(data), nbytes
    except CorruptEntryError as exc:
        return exc, nbytes


def user_id_digest(user_id: str) -> str:
    """A user id becomes a file/field name only through this hash."""
    return hashlib.sha256(user_id.encode("utf-8", "surrogatepass")).hexdigest()
