"""The store admin over a disk store: files, their headers and mtimes, temp files, link files.

Nothing here blocks on, follows or reads without bound a file planted in the store: entries and refs
are opened non-blocking, without following a symlink, regular files only (disk_read, disk_files), and
shard folders are listed without following a symlink. What is no ref file (a FIFO, a symlink, a
device, an oversized file, a symlinked shard folder under `index/`) is a bad link that `gc` removes
(a symlink itself, never its target).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from kvrag.cache_backends import DiskStore, StoreError
from kvrag.cache_backends.base import CorruptEntryError, check_key
from kvrag.cache_backends.disk import _SUFFIX, _TEMP, read_entry
from kvrag.cache_backends.disk_files import BadFile, SymlinkedFolderError, kind_of, open_folder, read_small, unlink_in, write_at
from kvrag.cache_backends.disk_read import _O_FLAGS
from kvrag.cache_backends.format import MAX_HEADER_BYTES, header_length
from kvrag.cache_backends.refs import MAX_REF_BYTES, check_ref, ref_mac
from kvrag.cache_backends.admin.base import EntryInfo, Link, StoreAdmin, TempFile, damage_of, unverified_or_damaged
from kvrag.cache_backends.admin.base import HEAD_BYTES, _as_tensor, _header_meta

_HEX = set("0123456789abcdef")


def _is_ref_name(name: str) -> bool:
    return name.endswith(".ref") and len(name) == 68 and set(name[:64]) <= _HEX


# -- disk ---------------------------------------------------------------------------------------
class DiskAdmin(StoreAdmin):
    kind = "disk"
    store: DiskStore

    def _entry_path(self, key: str) -> Path:
        return self.store._path(key)

    def _open(self, key: str) -> int | None:
        """The entry file, opened non-blocking and without following a symlink; None unless a regular file."""
        try:
            fd = os.open(self._entry_path(key), _O_FLAGS)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def entries(self) -> Iterator[EntryInfo]:
        now = time.time()
        for e in self.store._files():
            key = e.name[: -len(_SUFFIX)]
            try:
                check_key(key)
            except StoreError:
                continue
            fd = self._open(key)
            if fd is None:
                continue  # deleted while listed, or replaced by something that is no entry file
            try:
                st = os.fstat(fd)
                head = os.pread(fd, HEAD_BYTES, 0)
                n = header_length(_as_tensor(head))
                if n is not None and HEAD_BYTES < 8 + n <= 8 + MAX_HEADER_BYTES:
                    head = os.pread(fd, 8 + n, 0)
            finally:
                os.close(fd)
            meta, problem = _header_meta(_as_tensor(head))
            yield EntryInfo(key, st.st_size, max(0.0, now - st.st_mtime), meta, problem)

    def _read(self, fd: int, key: str, keyed: bool) -> object:
        size = os.fstat(fd).st_size
        if not size:
            return CorruptEntryError("empty file")
        return read_entry(fd, torch.empty(size, dtype=torch.uint8), self.store.mac_key if keyed else None, key)[0]

    def verify(self, key: str) -> str | None:
        # Not DiskStore.get: that deletes what it finds damaged and refreshes the LRU time.
        fd = self._open(key)
        if fd is None:
            return None
        try:
            keyed = damage_of(self._read(fd, key, keyed=True))
            return unverified_or_damaged(keyed, lambda: self._read(fd, key, keyed=False))
        finally:
            os.close(fd)

    def raw(self, key: str) -> bytes | None:
        fd = self._open(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def links(self) -> list[Link]:
        out, now = [], time.time()
        index = str(self.store.root / "index")
        try:
            shards = sorted(os.scandir(index), key=lambda e: e.name)
        except FileNotFoundError:
            return out
        for d in shards:
            if d.is_symlink():  # a symlinked shard folder: nothing under it is the store's
                out.append(Link(None, None, ("link", d.path), None, f"index/{d.name} -> (symlinked folder)", status="bad: a symlinked folder"))
                continue
            if not d.is_dir(follow_symlinks=False):
                continue
            out.extend(self._shard_links(d.name, now))
        return out

    def _shard_links(self, shard: str, now: float) -> list[Link]:
        out = []
        try:
            fd = open_folder(str(self.store.root / "index"), (shard,))
        except SymlinkedFolderError:
            return out
        if fd is None:
            return out
        try:
            for f in sorted(os.scandir(fd), key=lambda e: e.name):
                if not _is_ref_name(f.name):
                    continue
                rel = f"index/{shard}/{f.name}"
                try:
                    age = max(0.0, now - os.stat(f.name, dir_fd=fd, follow_symlinks=False).st_mtime)
                    data = read_small(f.name, MAX_REF_BYTES, dir_fd=fd)
                except FileNotFoundError:
                    continue
                handle = (shard, f.name)
                if data is None:
                    continue
                if isinstance(data, BadFile):
                    out.append(Link(None, None, handle, age, f"{rel} ({data.reason})", status=f"bad: {data.reason}"))
                    continue
                digest = f.name[:64]
                ref = check_ref(data, self.store.mac_key, digest)
                shown = data[:16].decode("ascii", "replace")
                out.append(Link(None, ref.entry_key, handle, age, f"{rel} -> {shown}", status=ref.status, digest=digest))
        finally:
            os.close(fd)
        return out

    def index_namespaces(self) -> set[str]:
        return set()  # ids are hashed on disk: namespaces come from the entries' headers

    def unlink(self, links: Sequence[Link]) -> None:
        """Delete these refs (or symlinked shard folders: the link itself, never what it points to)."""
        index = str(self.store.root / "index")
        for lk in links:
            shard, name = lk.handle
            if shard == "link":
                if os.path.islink(name):
                    os.unlink(name)
                continue
            try:
                unlink_in(index, (shard,), name)
            except SymlinkedFolderError:
                continue

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        self.store.unlink(user_ids)

    def sign_link(self, link: Link) -> None:
        key = self.store.mac_key
        shard, name = link.handle
        if key is None or link.key is None or shard == "link":
            return
        fd = open_folder(str(self.store.root / "index"), (shard,))
        if fd is None:
            return
        try:
            write_at(fd, name, f"{link.key} {ref_mac(key, link.digest, link.key)}".encode())
        finally:
            os.close(fd)

    def foreign_folders(self) -> list[str]:
        """Symlinked shard folders under entries/ (the store never reads or writes through them)."""
        top = self.store.root / "entries"
        out = []
        for d in os.scandir(top):
            if d.is_symlink():
                out.append(os.path.relpath(d.path, self.store.root))
            elif d.is_dir(follow_symlinks=False):
                out += [os.path.relpath(m.path, self.store.root) for m in os.scandir(d.path) if m.is_symlink()]
        return out

    def remove_folder_link(self, rel: str) -> None:
        """Delete a symlinked shard folder under entries/: the link, never what it points to."""
        parts = Path(rel).parts
        if parts[0] != "entries" or len(parts) not in (2, 3) or any(len(p) != 2 for p in parts[1:]):
            raise StoreError(f"refusing to delete {rel}: not a shard folder of this store")
        path = self.store.root / rel
        if path.is_symlink() and not path.parent.is_symlink():
            os.unlink(path)

    def temp_files(self) -> list[TempFile]:
        out, now = [], time.time()
        for e in self.store._walk(temp=True):
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            out.append(TempFile(os.path.relpath(e.path, self.store.root), st.st_size, max(0.0, now - st.st_mtime)))
        return out

    def remove_temp(self, temp: TempFile) -> None:
        path = self.store.root / temp.name
        parent = path.parent
        if not path.name.startswith(_TEMP) or parent.is_symlink() or self.store.root.resolve() not in parent.resolve().parents:
            raise StoreError(f"refusing to delete {path}: not a temp file of this store")
        path.unlink(missing_ok=True)

    def cap(self) -> dict[str, Any]:
        return {"max_bytes": self.store.max_bytes, "root": str(self.store.root)}


__all__ = ["DiskAdmin", "kind_of"]
