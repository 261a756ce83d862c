"""A request's disk reads: each entry file read once into its own buffer, by several threads at
once, every piece hashed right after it lands.

Why: on a small CPU a verified read is the kernel's copy out of the page cache (~5 GB/s a core)
plus xxh3 over the same bytes (~10-18 GB/s in cache); done one after the other on one core they
cost their sum (about 0.6 of a plain read). Both release the GIL, so threads can do them at once.

How: every entry file is cut into pieces (`PIECE` bytes, in file order). Each thread -- the caller
and up to `threads - 1` helpers from the store's pool -- takes an entry of its own, reads its pieces
with `os.preadv` straight into the entry's buffer and hashes each one as it lands, `HASH_STEP` bytes
at a time, while they are still in that core's cache (xxh3 runs ~4x faster there than out of
memory: ~40 against ~10 GB/s on the 2-core machine); after the last piece it compares the checksum
(format.finish_entry) and takes the next entry. Entries are opened a few at a time (`WINDOW`, fewer
when fewer are left per thread), so a large request keeps only a few files open: the thread that
opens them reads each one's small first piece (`FIRST`), parses its header and builds its tensor
views (format.prepare_entry) in one go -- per-entry Python that costs about twice as much when it
runs after megabytes of copying have evicted it from the cache (~1.8 ms of CPU saved per 10
entries, measured).
When no entry is left to take, a thread helps with another's: it reads that entry's next piece,
and the entry's hasher takes it in order (a single large entry is read by all threads this way).
An entry is hashed by one thread at a time, pieces strictly in file order. With one thread (no
helpers) it is the plain serial loop, with no job queue: read a step, hash it (`_serial`).

Verification: every byte of an entry, header and data, goes through its checksum (or,
with a store key, its MAC: format.MacKey) before `finish_entry` hands out any tensor; a bad header,
a file that shrinks while read or a wrong checksum or MAC is a CorruptEntryError (a clean miss for
the store), a missing file a miss. A file larger than the store's bound is refused on its fstat,
before any buffer is taken (`open_entry_file`).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, Union

import numpy as np
import torch

from .base import CorruptEntryError, StoreError
from .byte_store import Fetched
from .format import MAX_ENTRY_BYTES, MAX_HEADER_BYTES, MacKey, PreparedEntry, checksum_start, finish_entry, parse_header, prepare_entry

PIECE = 1 << 20  # the unit a thread claims and hashes: large enough to keep locking rare, small enough to stay in cache
HASH_STEP = 256 << 10  # a piece its own hasher reads is read and hashed this much at a time (in cache: ~40 against ~10 GB/s)
FIRST = 64 << 10  # an entry's first piece: enough for its header
WINDOW = 8  # entries a thread opens and prepares in one go (fewer when fewer are left per thread)
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


Opened = Union[EntryFile, Fetched]  # an open file to read, or the request's answer for it already (miss, too large)


@dataclass(frozen=True)
class _Prep:
    """A job: open entries lo..hi-1 and read, hash and prepare each one's first piece."""

    lo: int
    hi: int


class _Worker:
    """A thread's place in a batch: the entry it reads and hashes (its pieces stay in its cache)."""

    file: EntryFile | None = None
    finish: EntryFile | None = None  # an entry this thread hashed to the end: it finishes it next


def read_range(f: EntryFile, begin: int, end: int) -> int:
    """Read `f`'s bytes begin..end into its buffer; returns the position reached."""
    if f.failed is not None:  # read unlocked: a stale None only costs a wasted read of a bad entry
        return begin
    try:
        return pread_into(f.fd, f.view, begin, end)
    except OSError as exc:
        raise StoreError(f"cannot read {f.name}: {exc}") from exc


def close_entry_file(f: EntryFile) -> None:
    """Close the file and drop its pieces: they point back at it, and a cycle would keep the
    buffer alive until the garbage collector runs, so the buffer pool could not reuse it."""
    if f.owned and f.fd >= 0:
        os.close(f.fd)
    f.fd = -1
    f.pieces = []


class ReadBatch:
    """One request's reads (see the module docstring); every thread runs `_work`."""

    def __init__(self, open_entry: Callable[[int], Opened], count: int, piece: int = PIECE) -> None:
        self._open = open_entry
        self._count = count
        self._piece = piece
        self._results: list[Fetched] = [(None, 0)] * count
        self._cv = threading.Condition()
        self._next = 0  # the next entry to open
        self._threads = 1
        self._prepping = 0  # _Prep jobs in flight
        self._ready: deque[EntryFile] = deque()  # prepared, not yet taken by a thread
        self._files: list[EntryFile] = []  # every file opened
        self._active: list[EntryFile] = []  # opened, not finished: oldest first
        self._stop = False
        self._helping = 0  # helper threads inside the batch
        self._error: BaseException | None = None

    def run(self, pool: Executor | None = None, helpers: int = 0) -> list[Fetched]:
        """Read, verify and decode every entry; (entry | CorruptEntryError | None, bytes) per key.
        Up to `helpers` threads of `pool` work beside the caller once there is more than a piece to read."""
        spawn = (pool, helpers) if pool is not None and helpers > 0 else None
        self._threads = 1 + (helpers if spawn else 0)
        try:
            if spawn is None:
                self._serial()
            else:
                self._work(_Worker(), spawn)
            with self._cv:
                if self._error is not None:
                    raise self._error
        finally:
            with self._cv:
                self._stop = True
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._helping == 0)  # no helper touches a file any more
            for f in self._files:
                close_entry_file(f)
            self._files, self._active = [], []
        results, self._results = self._results, []  # a helper task may outlive the call: it must hold no buffer
        return results

    def _serial(self) -> None:
        """One reader: each entry in turn, its first piece (`FIRST`) then `HASH_STEP` at a time, each
        step hashed as it lands; no job queue and no lock a piece (on a busy small machine the
        per-piece bookkeeping costs as much as the hashing)."""
        for i in range(self._count):
            f = self._open(i)
            if not isinstance(f, EntryFile):
                self._results[i] = f
                continue
            self._files.append(f)
            at, step = 0, min(HASH_STEP, self._piece)
            while at < f.size and f.failed is None:
                stop = min(f.size, at + (step if at else min(step, FIRST)))
                at = stop if self._step(f, at, stop) >= stop else f.size
            self._results[i] = self._finish(f)

    def _spawn(self, pool: Executor, helpers: int) -> None:
        try:
            for _ in range(helpers):
                pool.submit(self._help)
        except RuntimeError:  # the store is closing: the caller reads on alone
            pass

    def _help(self) -> None:
        with self._cv:
            if self._stop:
                return
            self._helping += 1
        try:
            self._work(_Worker())
        except BaseException as exc:  # handed to the caller, which raises it
            with self._cv:
                self._error = self._error or exc
                self._stop = True
        finally:
            with self._cv:
                self._helping -= 1
                self._cv.notify_all()

    def _work(self, me: _Worker, spawn: tuple[Executor, int] | None = None) -> None:
        """Until every entry is finished: hash what has landed, else read the next piece. A job's
        outcome is published under the same lock as the next job is picked: one lock a piece."""
        outcome: tuple[Any, ...] | None = None
        while True:
            with self._cv:
                if outcome is not None:
                    self._publish(me, outcome)
                    self._cv.notify_all()
                while True:
                    if self._stop:
                        return
                    job = self._pick(me)
                    if job is not None:
                        break
                    if self._next >= self._count and not self._active and not self._prepping:
                        return  # all done
                    self._cv.wait()  # pieces in flight, or being hashed or prepared, elsewhere
                if spawn is not None and self._more():
                    self._spawn(*spawn)
                    spawn = None
            if isinstance(job, _Prep):
                outcome = (job, self._prep(job))
            elif isinstance(job, Piece):
                outcome = (job, self._read_hashing(job) if job.hash else self._read(job))
            elif isinstance(job, EntryFile):
                outcome = (job, self._finish(job))
            else:
                outcome = (job, self._hash_landed(*job))

    def _publish(self, me: _Worker, outcome: tuple[Any, ...]) -> None:
        """Record what a job did: a piece landed, pieces hashed, an entry finished. Hold the lock."""
        job, result = outcome
        if isinstance(job, _Prep):
            self._prepping -= 1
            for i, got in result:
                if isinstance(got, EntryFile):
                    self._files.append(got)
                    self._active.append(got)
                    self._ready.append(got)
                else:
                    self._results[i] = got
        elif isinstance(job, Piece):
            job.reached = result
            if job.hash:
                self._hashed(me, job.file, 1)
        elif isinstance(job, EntryFile):  # finished
            self._results[job.index] = result
            self._active.remove(job)
        else:
            self._hashed(me, *job)

    def _hashed(self, me: _Worker, f: EntryFile, n: int) -> None:
        """`n` more pieces of `f` hashed by this thread. Hold the lock."""
        f.consumed += n
        if f.sealed and f.consumed == len(f.pieces):  # all its pieces are in: nobody reads its file
            me.finish = f  # stays busy: this thread decodes it next
        else:
            f.busy = False

    def _pick(self, me: _Worker) -> Piece | tuple[EntryFile, int] | EntryFile | _Prep | None:
        """This thread's next job, in order of preference: hash its entry's landed pieces, read its
        entry's next piece, take a prepared entry, prepare the next few entries, and at the tail
        hash any entry's landed pieces or read another entry's next piece. Hold the lock."""
        if me.finish is not None:
            f, me.finish = me.finish, None
            return f
        f = me.file
        if f is not None and not f.busy and f.landed():
            return self._take_hash(f)
        if f is not None and not f.sealed:
            return self._claim(f, me)
        if self._ready:
            me.file = f = self._ready.popleft()
            return self._claim(f, me)
        if self._next < self._count:
            left = self._count - self._next
            lo = self._next
            self._next += min(left, WINDOW, -(-left // self._threads))
            self._prepping += 1
            return _Prep(lo, self._next)
        for g in self._active:  # the tail: pieces another thread read for an entry of a third
            if not g.busy and g.landed():
                return self._take_hash(g)
        for g in self._active:
            if not g.sealed:
                return self._claim(g, me)
        return None

    def _more(self) -> bool:
        """Whether another job is left to hand out. Hold the lock."""
        return self._next < self._count or bool(self._ready) or any(not g.sealed for g in self._active)

    def _prep(self, job: _Prep) -> list[tuple[int, Opened]]:
        """Open entries job.lo..job.hi-1 and read, hash and prepare each one's first piece (header,
        views: format.prepare_entry), one after the other, so that per-entry Python runs warm
        rather than after megabytes of copying evicted it. An entry done in its first piece (small,
        or bad) is finished here; the others are ready for any thread to take."""
        out: list[tuple[int, Opened]] = []
        try:
            for i in range(job.lo, job.hi):
                f = self._open(i)
                if isinstance(f, EntryFile):
                    out.append((i, f))  # closed below if anything fails
                    p = Piece(f, 0, min(f.size, self._piece, FIRST), hash=True)
                    f.pieces.append(p)
                    f.next_at, f.sealed, f.busy = p.end, p.end >= f.size, True  # nobody else sees f yet
                    p.reached = self._read(p)
                    self._consume_range(f, p.end, p.reached)
                    f.consumed, f.busy = 1, False
                    if f.sealed:  # read whole, or failed
                        out[-1] = (i, self._finish(f))
                else:
                    out.append((i, f))
        except BaseException:
            for _, f in out:
                if isinstance(f, EntryFile):
                    close_entry_file(f)
            raise
        return out

    def _claim(self, f: EntryFile, me: _Worker) -> Piece:
        """Hand out `f`'s next piece; its reader hashes it too when it is next in order and `f` is
        the reader's own entry, idle (the common case: one lock a piece). Hold the lock."""
        begin = f.next_at
        f.next_at = end = min(f.size, begin + (self._piece if begin else min(self._piece, FIRST)))
        f.sealed = end >= f.size
        p = Piece(f, begin, end)
        if f is me.file and not f.busy and f.consumed == len(f.pieces):
            f.busy = p.hash = True
        f.pieces.append(p)
        return p

    def _take_hash(self, f: EntryFile) -> tuple[EntryFile, int]:
        f.busy = True
        return f, f.landed()

    def _read(self, p: Piece) -> int:  # a piece into its entry's buffer: the position reached
        return read_range(p.file, p.begin, p.end)

    def _read_hashing(self, p: Piece) -> int:
        """Read a piece its reader hashes (this thread holds `f.busy`), `HASH_STEP` bytes at a time, each
        step hashed right after it lands, while it is still in this core's cache; returns the position reached."""
        f, at = p.file, p.begin
        while at < p.end:
            stop = min(p.end, at + HASH_STEP)
            reached = self._step(f, at, stop)
            if reached < stop:
                return reached
            at = stop
        return at

    def _step(self, f: EntryFile, at: int, stop: int) -> int:
        """Read `f`'s bytes at..stop, next in its hash order (this thread holds `f.busy`), and hash them
        right away; returns the position reached."""
        reached = read_range(f, at, stop)
        if f.header is not None and reached == stop and f.hashed == at and f.failed is None:  # the common case, inline
            f.hasher.update(f.view[at:stop])
            f.reached = f.hashed = stop
        else:  # the header, a file that shrank, a failed entry
            self._consume_range(f, stop, reached)
        return reached

    def _hash_landed(self, f: EntryFile, n: int) -> int:
        """Hash `n` landed pieces of `f` in order (this thread holds `f.busy`); returns `n`."""
        for p in f.pieces[f.consumed : f.consumed + n]:
            self._consume_range(f, p.end, p.reached)  # type: ignore[arg-type]
        return n

    def _consume_range(self, f: EntryFile, end: int, reached: int) -> None:
        """Hash `f`'s bytes up to `end` (next in its order; this thread holds `f.busy`), landed up to `reached`."""
        if f.failed is not None:
            return
        if reached < end:
            self._fail(f, CorruptEntryError(f"entry file shrank while read ({reached} of {f.size} bytes)"))
        else:
            f.reached = end
            self._hash(f)

    def _hash(self, f: EntryFile) -> None:
        if f.header is None:
            n = int.from_bytes(f.view[:8], "little") if f.reached >= 8 else None
            if n is not None and n <= MAX_HEADER_BYTES and f.reached < 8 + n <= f.size:
                return  # a header longer than a piece: wait for the next one
            try:
                f.header, f.start = parse_header(f.arr[: f.reached])  # numpy: no torch call per step
                f.hasher = checksum_start(f.arr, f.header, f.start, f.mac_key, f.key)
                f.prepared = prepare_entry(f.buf, f.header, f.start)  # views and fields, no data yet
            except CorruptEntryError as exc:  # older formats too: no need to read further
                self._fail(f, exc)
                return
            f.hashed = f.start
        if f.reached > f.hashed:
            f.hasher.update(f.view[f.hashed : f.reached])
            f.hashed = f.reached

    def _fail(self, f: EntryFile, exc: CorruptEntryError) -> None:
        with self._cv:
            f.failed = exc
            f.sealed = True  # its remaining pieces are not handed out

    def _finish(self, f: EntryFile) -> Fetched:
        if f.failed is not None:
            fetched: Fetched = (f.failed, f.reached)
        elif f.prepared is None or f.hashed != f.size:  # pragma: no cover - every piece is in and hashed
            fetched = (CorruptEntryError("entry read incompletely"), f.reached)
        else:
            try:
                fetched = (finish_entry(f.prepared, f.hasher.hexdigest(), keyed=f.mac_key is not None), f.size)
            except CorruptEntryError as exc:
                fetched = (exc, f.size)
        if f.touch:
            try:
                os.utime(f.fd)  # last use, for LRU
            except OSError:
                pass
        close_entry_file(f)
        return fetched



def read_entry(fd: int, buf: torch.Tensor, mac_key: MacKey | None = None, key: str = "") -> Fetched:
    """Read a whole entry file (as long as `buf`) into `buf` on this thread, verify (with `mac_key`:
    its MAC for the store key `key`) and decode it. The fd stays open (the caller's)."""
    f = EntryFile(0, f"fd {fd}", fd, buf, owned=False, mac_key=mac_key, key=key)
    return ReadBatch(lambda i: f, 1).run()[0]
