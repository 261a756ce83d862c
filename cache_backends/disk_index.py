"""The disk store's node-id index: one small file per user id, `index/<xx>/<sha256(id)>.ref`.

Why its own module: a ref is read like an entry is opened (disk_files.read_small: O_NOFOLLOW,
O_NONBLOCK, a regular file, at most `MAX_REF_BYTES`), written through a shard folder opened without
following a symlink, and signed with the store key when there is one (refs.py). A FIFO, a symlink, a
device or an oversized file at a ref's path is a logged miss, never a hang or a large read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from .base import user_id_digest
from .disk_files import SymlinkedFolderError, open_folder, read_small, write_at
from .refs import MAX_REF_BYTES, check_ref, ref_value


class DiskIndex:
    """The node-id index half of DiskStore (a mixin: it uses the store's root, key and counters)."""

    root: Path
    mac_key: Any
    _index: str

    def _ref(self, user_id: str) -> Path:
        d = user_id_digest(user_id)
        return self.root / "index" / d[:2] / (d + ".ref")

    def _link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        for uid, key in zip(user_ids, keys):
            d = user_id_digest(uid)
            try:
                fd = open_folder(self._index, (d[:2],), create=True)
            except SymlinkedFolderError as exc:
                self._refused(exc)
                continue
            assert fd is not None
            try:
                write_at(fd, f"{d}.ref", ref_value(self.mac_key, uid, key).encode())
            finally:
                os.close(fd)

    def unlink(self, user_ids: Sequence[str]) -> None:
        """Drop these ids from the node-id index (their entries stay)."""
        for uid in user_ids:
            d = user_id_digest(str(uid))
            self._unlink_in(self._index, (d[:2],), f"{d}.ref")

    def _resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return [self._resolve_one(user_id_digest(uid)) for uid in user_ids]

    def _resolve_one(self, d: str) -> str | None:
        """The entry key the ref of id digest `d` names, if it is a small regular file (see the module
        docstring) and, with a store key, its MAC verifies; else a miss."""
        where = f"index/{d[:2]}/{d[:16]}….ref"
        try:
            fd = open_folder(self._index, (d[:2],))
        except SymlinkedFolderError:
            self._bad_ref(where, "in a symlinked shard folder")
            return None
        if fd is None:
            return None
        try:
            data = read_small(f"{d}.ref", MAX_REF_BYTES, dir_fd=fd)
        finally:
            os.close(fd)
        if data is None:
            return None
        if not isinstance(data, bytes):
            self._bad_ref(where, data.reason)
            return None
        ref = check_ref(data, self.mac_key, d)
        if ref.status == "malformed":
            self._bad_ref(where, "not a ref (no store key in it)")
        elif ref.served is None:
            self._unverified_ref(d, ref.status)
        return ref.served

