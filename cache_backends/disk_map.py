"""Disk reads by mapping: an entry file's pages are mapped copy-on-write and its tensors view them.

Why (`disk:///path?read=map`; the default is `read=copy`, disk_read): a mapping costs only the
checksum's pass over the page cache, which also faults the pages in. But the pages are the file's,
not memory of the process: a tier that keeps the entry copies it first (a second whole-entry pass
that a copy read never needs), and a GPU copy from them is a pageable one (~7x slower than from
pinned memory: 7.5 against 46.7 GB/s on an H200). So it suits a lone disk store on a CPU, read once
per request.

Safety: every byte, header and data, goes through the entry's checksum before any tensor leaves
(format.decode_entry). The mapping is private (copy-on-write): a caller writing into a returned
tensor never changes the file, and the pages stay valid after the file is replaced or deleted. The
store only ever replaces files by rename and deletes them by unlink, but another process may truncate
an entry file in place (`: > file`, `rsync --inplace`), which makes a reader of its live mapping fault
(SIGBUS). So a mapped entry lives only as long as one request: it is marked `mapped`, and a store that
keeps entries (the memory tier a tiered store promotes into) copies it into memory of its own first.
`read=copy` (the default) reads into buffers of the process's own instead.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from .base import CorruptEntryError, StoreError
from .byte_store import Fetched
from .disk_read import open_entry_file
from .format import MacKey, decode_entry


def map_entry(path: str, max_bytes: int | None = None, touch_after_s: float | None = None,
              mac_key: MacKey | None = None, key: str = "") -> Fetched:  # fmt: skip
    """Map, verify and decode the entry file at `path`: (entry, bytes), (CorruptEntryError, bytes) or
    (None, 0) for a missing file. A file over `max_bytes` is refused on its fstat, before it is mapped.
    With `mac_key`, the entry's MAC for the store key `key` is checked in place of its checksum.
    Touches the mtime (LRU) when it is older than `touch_after_s`."""
    opened = open_entry_file(path, max_bytes)
    if not isinstance(opened[0], int):
        return opened  # type: ignore[return-value]
    fd, st = opened
    size = st.st_size
    try:
        if size == 0:
            return CorruptEntryError("empty entry file"), 0
        try:
            mapped = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            raise StoreError(f"cannot map {path}: {exc}") from exc
        if touch_after_s is not None and time.time() - st.st_mtime > touch_after_s:
            try:
                os.utime(fd)
            except OSError:
                pass
    finally:
        os.close(fd)
    try:
        entry = decode_entry(torch.frombuffer(mapped, dtype=torch.uint8), mac_key, key)
        entry.mapped = True
        return entry, size
    except CorruptEntryError as exc:
        return exc, size
