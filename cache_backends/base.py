"""The store protocol, the entry type, the store's errors, and the shared byte-store logic.

Stores hold opaque, content-addressed entries: the key already encodes the model fingerprint,
layout, entry kind and chunk tokens, so a store never needs to understand what it holds. Beside
the entries, a store keeps a node-id index (user id -> content key) so integrations can name
chunks by their own ids, and changed text under an old id becomes a miss rather than stale KV.
"""

from __future__ import annotations

import hashlib
import logging
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
    # the tensors view a file's mapped pages (disk_map): a store that keeps the entry copies them first,
    # since a file truncated in place under a live mapping faults its reader (SIGBUS)
    mapped: bool = field(default=False, compare=False)

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
    unverified: int = 0  # entries the store key could not verify (no MAC, another key's): misses, kept
    unverified_refs: int = 0  # id refs the store key could not verify: misses, kept
    bad_refs: int = 0  # id refs that are no small regular file (a FIFO, a symlink, a device, oversized): misses

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


def user_id_digest(user_id: str) -> str:
    """A user id becomes a file/field name only through this hash."""
    return hashlib.sha256(user_id.encode("utf-8", "surrogatepass")).hexdigest()
