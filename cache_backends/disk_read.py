"""A request's disk reads: each entry file read once into its own buffer, by several threads at
once, every piece hashed right after it lands.

Why: on a small CPU a verified read is the kernel's copy out of the page cache (~5 GB/s a core)
plus xxh3 over the same bytes (~10-18 GB/s in cache); done one after the other on one core they
cost their sum (about 0.6 of a plain read). Both release the GIL, so threads can do them at once.

How: every entry file is cut into pieces, in file order. Each thread -- the caller and up to
`threads - 1` helpers from the store's pool -- takes an entry of its own and claims the rest of it as
one piece while other entries are left for the other threads (a piece is only worth its lock when
another thread could read it); it reads it with `os.preadv` straight into the entry's buffer and
hashes it as it lands, `HASH_STEP` bytes at a time, while each step is still in that core's cache
(xxh3 runs ~4x faster there than out of memory: ~40 against ~10 GB/s on the 2-core machine; the
loop is disk_entry.read_hashing); then it compares the checksum (format.finish_entry) and takes the
next entry. Entries are opened a few at a time (`WINDOW`, fewer when fewer are left per thread), so a
large request keeps only a few files open: the thread that opens them reads each one's small first
piece (`FIRST`), parses its header and builds its tensor views (format.prepare_entry) in one go --
per-entry Python that costs about twice as much when it runs after megabytes of copying have
evicted it from the cache (~1.8 ms of CPU saved per 10 entries, measured).
At the tail, when no entry is left to take, a thread claims a share of its entry's rest (at least
`PIECE` bytes) and an idle thread helps with another's: it reads that entry's next piece, and the
entry's hasher takes it in order (a single large entry is read by all threads this way). An entry is
hashed by one thread at a time, pieces strictly in file order. With one thread (no helpers) it is
the serial loop, with no job queue and no lock: a window prepared, then each entry read and hashed
to its end (`_serial`).

Verification: every byte of an entry, header and data, goes through its checksum (or,
with a store key, its MAC: format.MacKey) before `finish_entry` hands out any tensor; a bad header,
a file that shrinks while read or a wrong checksum or MAC is a CorruptEntryError (a clean miss for
the store), a missing file a miss. A file larger than the store's bound is refused on its fstat,
before any buffer is taken (`open_entry_file`).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from .base import CorruptEntryError
from .byte_store import Fetched
from .disk_entry import _O_FLAGS, PARALLEL, open_entry_file, pread_into  # noqa: F401 - re-exported (disk, disk_map, store admin)
from .disk_entry import HASH_STEP, EntryFile, Piece, close_entry_file, read_hashing, read_range, shrank
from .format import MAX_HEADER_BYTES, checksum_start, finish_entry, parse_header, prepare_entry

PIECE = 1 << 20  # the unit a thread claims and hashes: large enough to keep locking rare, small enough to stay in cache
FIRST = 64 << 10  # an entry's first piece: enough for its header
WINDOW = 8  # entries a thread opens and prepares in one go (fewer when fewer are left per thread)


def idle_cpus() -> int | None:
    """CPUs with nothing runnable right now besides the caller: the CPU count less the kernel's count
    of runnable threads (/proc/loadavg, which counts the caller itself); None where the OS does not say.

    Why: a helper only pays when it runs beside the caller. On the 2-core machine with both cores
    busy (load ~5), a request of 10 entries read with a helper came to ~0.78 of a plain read + xxh3
    against ~0.90 read by the caller alone: a helper that the scheduler keeps waiting holds the GIL
    or an entry's hash, and the caller waits for it."""
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) - running


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
        """One reader, no job queue and no lock a piece (on a busy small machine the per-piece
        bookkeeping costs as much as the hashing): a window of entries is opened and prepared in one
        go (`_prep`: each one's first piece read and hashed, its header parsed, its views built), then
        each one is read and hashed to its end (`read_hashing`) and finished. The per-entry Python
        runs together, warm, not between megabytes of copying that evict it (~9% of a 10-entry
        request on the 2-core machine: 0.76 -> 0.84 of a plain read + xxh3)."""
        step = min(HASH_STEP, self._piece)
        for lo in range(0, self._count, WINDOW):
            window = self._prep(_Prep(lo, min(self._count, lo + WINDOW)))
            self._files += [f for _, f in window if isinstance(f, EntryFile)]  # closed by run() if anything fails
            for i, f in window:
                if isinstance(f, EntryFile):
                    self._to_end(f, step)
                    f = finish_file(f)
                self._results[i] = f

    def _to_end(self, f: EntryFile, step: int) -> None:
        """Read and hash the rest of `f` (this thread holds it): a header longer than the first piece
        step by step until it is parsed, then the tight loop."""
        at = f.reached
        while at < f.size and f.failed is None and f.header is None:
            stop = min(f.size, at + step)
            at = stop if self._step(f, at, stop) >= stop else f.size
        if at < f.size and f.failed is None:
            reached = read_hashing(f, f.size, step)
            if reached < f.size:
                self._fail(f, shrank(f, reached))

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
                outcome = (job, self._read_hashing(job) if job.hash else _read_piece(job))
            elif isinstance(job, EntryFile):
                outcome = (job, finish_file(job))
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
            return _take_hash(f)
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
                return _take_hash(g)
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
                    p.reached = _read_piece(p)
                    self._consume_range(f, p.end, p.reached)
                    f.consumed, f.busy = 1, False
                    if f.sealed:  # read whole, or failed
                        out[-1] = (i, finish_file(f))
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
        the reader's own entry, idle (the common case: one lock a piece). While entries are left for
        the other threads to take, a thread claims the rest of its own entry at once: a piece is only
        worth its lock, its bookkeeping and its wake-ups when another thread could read it. At the
        tail (or in a request of one large entry) it claims a share of what is left, at least a
        `piece` (10 entries of 6.9 MB on the busy 2-core machine: 0.74 -> ~0.8 of a plain read +
        xxh3, against 1 MB pieces throughout). Hold the lock."""
        begin = f.next_at
        if not begin:
            size = min(self._piece, FIRST)
        elif f is me.file and (self._ready or self._next < self._count):
            size = f.size - begin
        else:
            size = max(self._piece, (f.size - begin) // self._threads)
        f.next_at = end = min(f.size, begin + size)
        f.sealed = end >= f.size
        p = Piece(f, begin, end)
        if f is me.file and not f.busy and f.consumed == len(f.pieces):
            f.busy = p.hash = True
        f.pieces.append(p)
        return p

    def _read_hashing(self, p: Piece) -> int:
        """Read a piece its reader hashes (this thread holds `f.busy`), `HASH_STEP` bytes at a time, each
        step hashed right after it lands, while it is still in this core's cache; returns the position reached."""
        f, at = p.file, p.begin
        if f.header is not None and f.hashed == at == f.reached and f.failed is None:  # the common case: the tight loop
            reached = read_hashing(f, p.end)
            if reached < p.end:
                self._fail(f, shrank(f, reached))
            return reached
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
            status = start_header(f)
            if status is None:
                return  # a header longer than a piece: wait for the next one
            if isinstance(status, CorruptEntryError):  # older formats too: no need to read further
                self._fail(f, status)
                return
        if f.reached > f.hashed:
            f.hasher.update(f.view[f.hashed : f.reached])
            f.hashed = f.reached

    def _fail(self, f: EntryFile, exc: CorruptEntryError) -> None:
        with self._cv:
            f.failed = exc
            f.sealed = True  # its remaining pieces are not handed out


def _take_hash(f: EntryFile) -> tuple[EntryFile, int]:
    f.busy = True
    return f, f.landed()


def _read_piece(p: Piece) -> int:
    """A piece into its entry's buffer: the position reached."""
    return read_range(p.file, p.begin, p.end)


def start_header(f: EntryFile) -> bool | CorruptEntryError | None:
    """Parse `f`'s header from the bytes landed and start its checksum and views: True once done; None while the
    header is longer than what landed (wait for the next piece); the error where it is not an entry's."""
    n = int.from_bytes(f.view[:8], "little") if f.reached >= 8 else None
    if n is not None and n <= MAX_HEADER_BYTES and f.reached < 8 + n <= f.size:
        return None
    try:
        f.header, f.start = parse_header(f.arr[: f.reached])  # numpy: no torch call per step
        f.hasher = checksum_start(f.arr, f.header, f.start, f.mac_key, f.key)
        f.prepared = prepare_entry(f.buf, f.header, f.start)  # views and fields, no data yet
    except CorruptEntryError as exc:
        return exc
    f.hashed = f.start
    return True


def finish_file(f: EntryFile) -> Fetched:
    """An entry read whole (or failed) as what a get returns: decoded and verified, or its error; the file closed."""
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
