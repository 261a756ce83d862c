"""The store admin over a disk store: files, their headers and mtimes, temp files, link files."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from kvrag.cache_backends import DiskStore, StoreError
from kvrag.cache_backends.base import CorruptEntryError, check_key
from kvrag.cache_backends.disk import _SUFFIX, _TEMP, read_entry
from kvrag.cache_backends.disk_read import _O_FLAGS
from kvrag.cache_backends.format import MAX_HEADER_BYTES, header_length
from kvrag.cache_backends.admin.base import EntryInfo, Link, StoreAdmin, TempFile, damage_of
from kvrag.cache_backends.admin.base import HEAD_BYTES, _as_tensor, _header_meta



# -- disk ---------------------------------------------------------------------------------------
class DiskAdmin(StoreAdmin):
    kind = "disk"
    store: DiskStore

    def _entry_path(self, key: str) -> Path:
        return self.store._path(key)

    def entries(self) -> Iterator[EntryInfo]:
        now = time.time()
        for e in self.store._files():
            key = e.name[: -len(_SUFFIX)]
            try:
                check_key(key)
                st = e.stat()
                with open(e.path, "rb") as f:
                    head = f.read(HEAD_BYTES)
                    n = header_length(_as_tensor(head))
                    if n is not None and HEAD_BYTES < 8 + n <= 8 + MAX_HEADER_BYTES:
                        head += f.read(8 + n - len(head))
            except (StoreError, FileNotFoundError):
                continue  # not an entry name, or deleted while listed
            meta, problem = _header_meta(_as_tensor(head))
            yield EntryInfo(key, st.st_size, max(0.0, now - st.st_mtime), meta, problem)

    def verify(self, key: str) -> str | None:
        # Not DiskStore.get: that deletes what it finds damaged and refreshes the LRU time.
        try:
            fd = os.open(self._entry_path(key), _O_FLAGS)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            entry, _ = read_entry(fd, torch.empty(size, dtype=torch.uint8), self.store.mac_key, key) if size else (CorruptEntryError("empty file"), 0)
        finally:
            os.close(fd)
        return damage_of(entry)

    def links(self) -> list[Link]:
        out, now = [], time.time()
        index = self.store.root / "index"
        for d in sorted(index.iterdir()) if index.is_dir() else ():
            if not d.is_dir():
                continue
            for ref in d.glob("*.ref"):
                try:
                    text = ref.read_text(errors="replace").strip()
                    age = now - ref.stat().st_mtime
                except FileNotFoundError:
                    continue
                try:
                    key: str | None = check_key(text)
                except StoreError:
                    key = None
                out.append(Link(None, key, ref, max(0.0, age), f"{ref.relative_to(self.store.root)} -> {text[:16]}"))
        return out

    def index_namespaces(self) -> set[str]:
        return set()  # ids are hashed on disk: namespaces come from the entries' headers

    def unlink(self, links: Sequence[Link]) -> None:
        for lk in links:
            Path(lk.handle).unlink(missing_ok=True)

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        self.store.unlink(user_ids)

    def temp_files(self) -> list[TempFile]:
        out, now = [], time.time()
        for e in self.store._walk(temp=True):
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            out.append(TempFile(os.path.relpath(e.path, self.store.root), st.st_size, max(0.0, now - st.st_mtime)))
        return out

    def remove_temp(self, temp: TempFile) -> None:
        path = (self.store.root / temp.name).resolve()
        if not path.name.startswith(_TEMP) or self.store.root.resolve() not in path.parents:
            raise StoreError(f"refusing to delete {path}: not a temp file of this store")
        path.unlink(missing_ok=True)

    def cap(self) -> dict[str, Any]:
        return {"max_bytes": self.store.max_bytes, "root": str(self.store.root)}
