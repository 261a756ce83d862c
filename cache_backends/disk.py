"""A folder of entries: hashed, sharded file names, atomic writes, corrupt files deleted on read."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

from .base import CorruptEntryError, KVEntry, StoreError, StoreStats, check_key
from .format import decode_entry, encode_entry

log = logging.getLogger(__name__)
_SUFFIX = ".kv"


class DiskStore:
    def __init__(self, root: str | os.PathLike, url: str | None = None) -> None:
        self.root = Path(root).expanduser()
        self.url = url or f"disk://{self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store folder {self.root}: {exc}") from exc
        self._stats = StoreStats()

    def _path(self, key: str) -> Path:
        check_key(key)
        return self.root / key[:2] / key[2:4] / (key + _SUFFIX)

    def get(self, key: str) -> KVEntry | None:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._stats.misses += 1
            return None
        try:
            entry = decode_entry(data)
        except CorruptEntryError as exc:
            log.warning("deleting corrupt cache entry %s: %s", path.name, exc)
            self._stats.errors += 1
            self._stats.misses += 1
            path.unlink(missing_ok=True)
            return None
        self._stats.hits += 1
        self._stats.bytes_read += len(data)
        return entry

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, entry: KVEntry) -> None:
        path = self._path(key)
        data = encode_entry(entry)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._stats.puts += 1
        self._stats.bytes_written += len(data)

    def contains(self, key: str) -> bool:
        return self._path(key).exists()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def stats(self) -> StoreStats:
        return self._stats

    def prefetch(self, keys: Iterable[str]) -> None:
        """The page cache is the prefetch for a local disk."""
