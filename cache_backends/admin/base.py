"""What the store admin reads: entry headers, links, temp files, and the per-store interface."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from kvrag.cache_backends import content_key
from kvrag.cache_backends.base import CorruptEntryError
from kvrag.cache_backends.format import StaleEntryError, UnverifiedEntryError, parse_header

HEAD_BYTES = 4096  # first read of an entry: a real header is well under this
_BATCH = 256  # Redis keys per pipeline


def namespace_of(model: str, layout: str) -> str:
    """The node-id index namespace of a (model fingerprint, layout identity): the same formula as
    `KVRepository.namespace`, so ids can be resolved without loading the model."""
    return content_key(model, layout)[:16]


@dataclass
class EntryInfo:
    key: str
    nbytes: int
    age_s: float | None  # since last written or read; None where the store cannot tell
    meta: dict[str, str] = field(default_factory=dict)  # model, layout, kind, tokens, dtype, quant, format
    problem: str | None = None  # the header could not be read: "stale: ..." (older format) or "corrupt: ..."

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Link:
    user_id: str | None  # None on disk: the index file is named by the id's hash
    key: str | None  # what it points to; None when the value is not a store key
    handle: Any  # what unlink() needs
    age_s: float | None = None
    name: str = ""  # how to show it: the id, or the index file
    # refs.OK (verified, or no store key), refs.UNSIGNED, refs.MISMATCH, refs.MALFORMED, or "bad: <what>"
    # for something that is no ref file at all (a FIFO, a symlink, a device, oversized): see refs.py
    status: str = "ok"
    digest: str = ""  # sha256 of the id: what a ref's MAC binds (a disk ref's file name)

    @property
    def bad(self) -> bool:
        """No reader can use it, with or without a key: not a ref file, or no entry key in it."""
        return self.status.startswith("bad") or self.status == "malformed" or self.key is None

    @property
    def unverified(self) -> bool:
        """A ref the store key cannot vouch for (no MAC, or another key's)."""
        return self.status in ("unsigned", "mismatch")

    def __post_init__(self) -> None:
        self.name = self.name or self.user_id or str(self.handle)


@dataclass
class TempFile:
    name: str
    nbytes: int
    age_s: float


def _header_meta(buf: torch.Tensor) -> tuple[dict[str, str], str | None]:
    """The entry's metadata from its first bytes, or the problem with them."""
    try:
        header, _ = parse_header(buf)
    except StaleEntryError as exc:
        return {}, f"stale: {exc}"
    except CorruptEntryError as exc:
        return {}, f"corrupt: {exc}"
    meta = dict(header["__metadata__"])
    meta.pop("checksum", None)
    meta.pop("magic", None)
    return meta, None


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class StoreAdmin:
    """What the admin commands need from one kind of store."""

    kind = ""

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def url(self) -> str:
        return self.store.url

    def entries(self) -> Iterator[EntryInfo]:
        raise NotImplementedError

    def verify(self, key: str) -> str | None:
        """Read the whole entry and check it: None if sound, else the problem ("unverified: …" when
        only the store key's MAC fails and the checksum is sound: see `unverified_or_damaged`)."""
        raise NotImplementedError

    def raw(self, key: str) -> bytes | None:
        """The entry's bytes as stored (for `sign`)."""
        raise NotImplementedError

    def rewrite(self, key: str, data: bytes) -> None:
        """Replace the entry's bytes (atomically, as a put does)."""
        self.store._write(key, data)

    def sign_link(self, link: Link) -> None:
        """Rewrite a ref signed with the store key (for `sign`)."""
        raise NotImplementedError

    @property
    def mac_key(self) -> Any:
        return getattr(self.store, "mac_key", None)

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def exists(self, key: str) -> bool:
        return self.store.contains(key)

    def links(self) -> list[Link]:
        raise NotImplementedError

    def index_namespaces(self) -> set[str]:
        """Namespaces the index itself names (where ids are readable)."""
        return {lk.user_id.split("/", 1)[0] for lk in self.links() if lk.user_id and "/" in lk.user_id}

    def unlink(self, links: Sequence[Link]) -> None:
        raise NotImplementedError

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        raise NotImplementedError

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self.store.resolve(list(user_ids))

    def temp_files(self) -> list[TempFile]:
        return []

    def remove_temp(self, temp: TempFile) -> None:
        raise NotImplementedError

    def cap(self) -> dict[str, Any]:
        return {}


def damage_of(entry: object) -> str | None:
    """What a decoded read says about the entry: "stale: …" (an older format), "unverified: …" (the
    store key's MAC fails), "corrupt: …", or None (sound)."""
    if isinstance(entry, UnverifiedEntryError):
        return f"unverified: {entry}"
    if isinstance(entry, StaleEntryError):
        return f"stale: {entry}"
    if isinstance(entry, CorruptEntryError):
        return f"corrupt: {entry}"
    return None


def unverified_or_damaged(keyed: str | None, unkeyed: Callable[[], object]) -> str | None:
    """A keyed check's verdict, refined: when only the MAC failed, the entry's unkeyed checksum tells
    another writer's sound data ("unverified: …", kept by `gc` unless asked) from damage ("corrupt: …")."""
    if keyed is None or not keyed.startswith("unverified"):
        return keyed
    return damage_of(unkeyed()) or keyed
