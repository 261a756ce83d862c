"""One entry file of a disk read: opened safely, its staging buffer and hash state, positional reads,
and the tight read-and-hash loop every byte of an entry goes through.

Why a module of its own: disk_read.ReadBatch schedules entries and pieces among threads; what happens
to one entry file -- opened without following a symlink, checked to be a regular file within the
store's bound before any buffer is taken, read with `preadv` into its buffer, hashed right after each
step lands -- is the same whoever schedules it, and is where the bytes per second are won or lost.

The loop (`read_hashing`): on the 2-core machine, a verified read of a 6.9 MB entry is ~80% the
kernel's copy out of the page cache, ~15% xxh3 over the same bytes, the rest Python. The copy and the
hash each release the GIL; the Python between them does not. So the loop keeps nothing but the two
calls and a slice per step (no method lookups, no per-step bookkeeping), and each step is
`HASH_STEP` bytes, small enough that xxh3 reads it back from this core's L2 (~4x faster than from
memory) and large enough that the Python per step stays ~2% of the step's time.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .base import CorruptEntryError, StoreError
from .byte_store import Fetched
from .format import MAX_ENTRY_BYTES, MacKey, PreparedEntry

HASH_STEP = 256 << 10  # read and hashed this much at a time (in cache: ~40 against ~10 GB/s)
PARALLEL = hasattr(os, "preadv")  # positional reads: several threads can read one file at once

# never through a symlink, never blocked by a FIFO or device planted at an entry's path
_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def open_entry_file(path: str, max_bytes: int | None = None) -> tuple[int, os.stat_result] | Fetched:
    """Open an entry file for reading: (fd, its stat), or the answer already -- (None, 0) for a
    missing file, (CorruptEntryError, 0) for one larger than any entry or than `max_bytes` (checked
    on the fstat, so a sparse file of huge apparent size costs nothing). Unreadable: StoreError."""
    try:
        fd = os.open(path, _O_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None, 0
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink planted at the entry's path: not this store's file
            return CorruptEntryError("entry path is a symlink"), 0
        raise StoreError(f"cannot read {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise StoreError(f"cannot read {path}: {exc}") from exc
    if not stat.S_ISREG(st.st_mode):  # a FIFO would block the reader for good, a device read forever
        os.close(fd)
        return CorruptEntryError("entry path is not a regular file"), 0
    if st.st_size > MAX_ENTRY_BYTES or (max_bytes is not None and st.st_size > max_bytes):
        os.close(fd)
        bound = MAX_ENTRY_BYTES if max_bytes is None else min(max_bytes, MAX_ENTRY_BYTES)
        return CorruptEntryError(f"entry file of {st.st_size} bytes is larger than any valid entry ({bound} bytes)"), 0
    return fd, st


def pread_into(fd: int, view: memoryview, start: int, stop: int) -> int:
    """Fill view[start:stop] from file offset `start` (one kernel copy, no Python bytes, GIL
    released). Returns the position reached: short only at the end of the file."""
    got = start
    while got < stop:
        if PARALLEL:
            n = os.preadv(fd, [view[got:stop]], got)
        else:  # pragma: no cover - no preadv: one reader thread, so seek + readv is safe
            os.lseek(fd, got, os.SEEK_SET)
            n = os.readv(fd, [view[got:stop]])
        if n == 0:
            break
        got += n
    return got


@dataclass(eq=False)
class EntryFile:
    """One open entry file, its read buffer and its hashing state (one hasher at a time: `busy`)."""

    index: int  # position in the request
    name: str  # for errors
    fd: int
    buf: torch.Tensor  # 1-D uint8, exactly the file's size
    touch: bool = False  # refresh the mtime (LRU) once read
    owned: bool = True  # the batch closes the fd
    mac_key: MacKey | None = None  # the store's key: check the entry's MAC (for the store key `key`) in place of its checksum
    key: str = ""
    arr: np.ndarray = field(init=False)
    view: memoryview = field(init=False)
    size: int = field(init=False)
    pieces: list[Piece] = field(default_factory=list)  # handed out so far, in file order
    next_at: int = 0  # offset of the next piece to hand out
    consumed: int = 0  # pieces hashed (or skipped, once failed)
    sealed: bool = False  # no more pieces will be handed out
    busy: bool = False  # a thread is hashing (or finishing) it
    failed: CorruptEntryError | None = None
    reached: int = 0  # bytes landed and seen by the hasher, contiguous from 0
    header: dict[str, Any] | None = None
    start: int = 0
    prepared: PreparedEntry | None = None
    hasher: Any = None
    hashed: int = 0

    def __post_init__(self) -> None:
        self.size = self.buf.numel()
        self.arr = self.buf.numpy()
        self.view = memoryview(self.arr)

    def landed(self) -> int:
        """How many pieces from `consumed` on have landed, contiguously. Hold the batch's lock."""
        n = self.consumed
        while n < len(self.pieces) and self.pieces[n].reached is not None:
            n += 1
        return n - self.consumed


@dataclass(eq=False)
class Piece:
    """A byte range of an entry file, handed to one thread to read."""

    file: EntryFile
    begin: int
    end: int
    reached: int | None = None  # set once read; below `end` if the file ended early
    hash: bool = False  # its reader hashes it right away: next in its entry's order, and the entry is the reader's


def read_range(f: EntryFile, begin: int, end: int) -> int:
    """Read `f`'s bytes begin..end into its buffer; returns the position reached."""
    if f.failed is not None:  # read unlocked: a stale None only costs a wasted read of a bad entry
        return begin
    try:
        return pread_into(f.fd, f.view, begin, end)
    except OSError as exc:
        raise StoreError(f"cannot read {f.name}: {exc}") from exc


def read_hashing(f: EntryFile, stop: int, step: int = HASH_STEP) -> int:
    """Read `f`'s bytes from `f.hashed` up to `stop`, `step` at a time, each step hashed right after it
    lands (see the module docstring). Only once its header is parsed and every landed byte hashed
    (`f.hashed == f.reached`), by the thread that holds `f.busy`. Returns the position reached: below
    `stop` when the file ended early (the caller fails the entry); `f.reached`/`f.hashed` follow it."""
    view, fd, update, at = f.view, f.fd, f.hasher.update, f.hashed
    assert f.header is not None and at == f.reached
    try:
        while at < stop:
            end = stop if stop - at < step else at + step
            got = pread_into(fd, view, at, end)
            if got < end:  # the file shrank since its fstat
                return got
            update(view[at:end])
            at = end
    except OSError as exc:
        raise StoreError(f"cannot read {f.name}: {exc}") from exc
    finally:
        f.reached = f.hashed = at
    return at


def shrank(f: EntryFile, reached: int) -> CorruptEntryError:
    return CorruptEntryError(f"entry file shrank while read ({reached} of {f.size} bytes)")


def close_entry_file(f: EntryFile) -> None:
    """Close the file and drop its pieces: they point back at it, and a cycle would keep the
    buffer alive until the garbage collector runs, so the buffer pool could not reuse it."""
    if f.owned and f.fd >= 0:
        os.close(f.fd)
    f.fd = -1
    f.pieces = []
