"""The store protocol, the entry type and the store's errors.

Stores hold opaque, content-addressed entries: the key already encodes the model fingerprint,
layout and chunk tokens, so a store never needs to understand what it holds.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch

from kvrag.errors import KVRagError


class StoreError(KVRagError):
    """A store could not be used (unreachable, misconfigured)."""


class CorruptEntryError(StoreError):
    """An entry's bytes failed to decode or its checksum did not match."""


@dataclass
class KVEntry:
    """One cached segment: keys [layers, kv_heads, tokens, head_dim] (RoPE-free) and values alike."""

    keys: torch.Tensor
    values: torch.Tensor
    meta: dict[str, str] = field(default_factory=dict)

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

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

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


def check_key(key: str) -> str:
    """Keys are hex digests; anything else is refused so no user text can reach a file name."""
    if not (16 <= len(key) <= 128) or any(c not in "0123456789abcdef" for c in key):
        raise StoreError(f"invalid store key {key[:40]!r}: expected a lowercase hex digest")
    return key
