"""A folder of entries: hashed, sharded file names, atomic writes, a size cap with LRU eviction.

Safe with several processes: every write goes to a temp file in the target folder and is renamed
over the final name, so readers see the old file or the whole new one; two writers of one key
both leave a complete entry. A read touches the file's mtime, which is what LRU eviction orders by.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

from .base import ByteStore, StoreError, user_id_digest

log = logging.getLogger(__name__)
_SUFFIX = ".kv"


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class DiskStore(ByteStore):
    def __init__(
        self,
        root: str | os.PathLike,
        url: str | None = None,
        max_bytes: int | None = None,
        quantize: bool = False,
    ) -> None:
        super().__init__(quantize=quantize)
        self.root = Path(root).expanduser()
        self.url = url or f"disk://{self.root}"
        self.max_bytes = max_bytes
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "index").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store folder {self.root}: {exc}") from exc
        self._size: int | None = None  # running estimate, rescanned when over the cap

    def _path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / key[2:4] / (key + _SUFFIX)

    def _read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            path = self._path(key)
            try:
                out.append(path.read_bytes())
                try:
                    os.utime(path)  # last use, for LRU
                except OSError:
                    pass
            except (FileNotFoundError, NotADirectoryError):
                out.append(None)
            except OSError as exc:
                raise StoreError(f"cannot read {path}: {exc}") from exc
        return out

    def _write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            atomic_write(path, data)
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc}") from exc
        if self.max_bytes is not None:
            with self._lock:
                if self._size is None:
                    self._size = self._scan_size()
                else:
                    self._size += len(data)
                over = self._size > self.max_bytes
            if over:
                self.evict()

    def _remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _exists(self, key: str) -> bool:
        return self._path(key).exists()

    def _files(self) -> list[os.DirEntry]:
        out = []
        for top in os.scandir(self.root / "entries"):
            if not top.is_dir():
                continue
            for mid in os.scandir(top.path):
                if mid.is_dir():
                    out.extend(e for e in os.scandir(mid.path) if e.name.endswith(_SUFFIX))
        return out

    def _scan_size(self) -> int:
        total = 0
        for e in self._files():
            try:
                total += e.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def evict(self, target: float = 0.9) -> int:
        """Delete least recently used entries until the folder is under target x max_bytes."""
        if self.max_bytes is None:
            return 0
        files = []
        for e in self._files():
            try:
                st = e.stat()
                files.append((st.st_mtime, st.st_size, e.path))
            except FileNotFoundError:
                continue
        total = sum(s for _, s, _ in files)
        removed = 0
        for _, size, path in sorted(files):
            if total <= target * self.max_bytes:
                break
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass  # another process evicted it first
            total -= size
        with self._lock:
            self._size = total
            self._stats.evictions += removed
        return removed

    # -- node-id index: one small file per user id, named by the id's hash -----------------------
    def _ref(self, user_id: str) -> Path:
        d = user_id_digest(user_id)
        return self.root / "index" / d[:2] / (d + ".ref")

    def _link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        for uid, key in zip(user_ids, keys):
            atomic_write(self._ref(uid), key.encode())

    def _resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        out: list[str | None] = []
        for uid in user_ids:
            try:
                out.append(self._ref(uid).read_text().strip() or None)
            except (FileNotFoundError, NotADirectoryError):
                out.append(None)
        return out

    def __repr__(self) -> str:
        return f"DiskStore({self.root}, max_bytes={self.max_bytes}, quantize={self.quantize})"

