"""Disk reads by mapping: an entry file's pages are mapped copy-on-write and its tensors view them.

Why: on a small CPU a verified copy out of the page cache costs the kernel's copy plus the checksum
pass; a mapping costs only the checksum's pass over the pages, which also faults them in. On the
2-core machine, 10 warm entries of 6.9 MB: mapped and verified ~15-22 GB/s, against ~8-17 GB/s for a
plain read of the same files into one reused buffer (it varies with the page cache's state) and
~9 GB/s for the threaded copy path (`kvrag bench store`).

Where not: into pinned buffers (`pin=True` on CUDA). Mapped pages are pageable, and the host-to-device
copy that follows runs ~7x faster from pinned memory (45 against 6.5 GB/s on an H100 machine), whose
16 cores also make the copy path reach a plain read; there `disk_read.ReadBatch` copies instead.

Safety: every byte, header and data, goes through the entry's checksum before any tensor leaves
(format.decode_entry). The mapping is private (copy-on-write): a caller writing into a returned
tensor never changes the file, and the pages stay valid after the file is replaced or deleted. The
store only ever replaces files by rename and deletes them by unlink; a process that truncated an
entry file in place while its tensors are alive would make their reader fault (SIGBUS). `read=copy`
(`disk:///path?read=copy`) reads into buffers of the process's own instead.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from .base import CorruptEntryError, StoreError
from .byte_store import Fetched
from .format import MAX_ENTRY_BYTES, decode_entry

_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def map_entry(path: str, max_bytes: int | None = None, touch_after_s: float | None = None) -> Fetched:
    """Map, verify and decode the entry file at `path`: (entry, bytes), (CorruptEntryError, bytes) or
    (None, 0) for a missing file. Touches the mtime (LRU) when it is older than `touch_after_s`."""
    try:
        fd = os.open(path, _O_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None, 0
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size > MAX_ENTRY_BYTES or (max_bytes is not None and size > max_bytes):
            return CorruptEntryError(f"entry file of {size} bytes is larger than any valid entry"), 0
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
        return decode_entry(torch.frombuffer(mapped, dtype=torch.uint8)), size
    except CorruptEntryError as exc:
        return exc, size
