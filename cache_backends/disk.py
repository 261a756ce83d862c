"""A folder of entries: hashed, sharded file names, atomic writes, parallel zero-copy reads, a size cap.

Reads, two ways, both checking every byte, header and data, against the entry's xxh3 checksum (with
a store key, its MAC: format.MacKey) before anything is returned, and both refusing a file larger
than the store's entry bound on its fstat, before any buffer is taken or any page mapped
(`limit_entry_bytes`; the size cap bounds an entry too):
- "copy" (the default; disk_read.ReadBatch): each file is read once, by `threads` readers (default:
  the CPU count, at most 4, the caller one of them, helpers only on CPUs idle at the request) with
  `preadv`, which releases the GIL, into a staging buffer of its own that the entry's tensors view
  (no further copy; pinned with `pin=True` on CUDA, so the host-to-device copy that follows is an
  asynchronous DMA; see host.BufferPool for the lifetime rule), each piece hashed as it lands. The bytes are the caller's memory: a tier
  above keeps them as they are (the host tier on CUDA keeps the pinned buffer itself).
- "map" (disk_map): the file's pages are mapped copy-on-write and the tensors view them: one
  checksum pass over the page cache, but pages of the file, not the process's memory, so a tier
  that keeps the entry copies it first, and a GPU copy from them is a pageable one.
`disk:///path?read=copy|map` chooses ("auto", the older default's name, means copy).

Safe with several processes: every write goes to a temp file in the target folder and is renamed
over the final name, so readers see the old file or the whole new one; two writers of one key
both leave a complete entry. A read touches the file's mtime (at most once a minute), which LRU eviction orders by.

Size cap: `DEFAULT_MAX_BYTES` (20 GiB) unless given (`max_bytes=None`, or `?max_bytes=none` in the
URL, means no cap). Temp files count toward it; temp files older than `STALE_TEMP_S` (1 hour) are
writers that died mid-write and are deleted when the store is opened (`temp_cleaned` counts them).
An overwrite counts the new size in place of the old. Writes go through shard folders opened without
following a symlink (disk_files): a symlinked shard folder under `entries/` or `index/` is refused with a
logged warning (the write is skipped), so nothing lands outside the store, past its cap.

Node-id index: one small file per id, `index/<xx>/<sha256(id)>.ref`, holding the entry key (signed with
the store key when there is one: refs.py). A ref is read like an entry is opened (O_NOFOLLOW,
O_NONBLOCK, a regular file, at most `MAX_REF_BYTES`): a FIFO, a symlink, a device or an oversized file
there is a logged miss (`stats().bad_refs`), never a hang or a large read; `kvrag store gc` removes it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import numpy as np

from .base import CorruptEntryError, StoreError, check_key
from .byte_store import ByteStore, Fetched
from .disk_index import DiskIndex
from .disk_map import map_entry
from .disk_files import SymlinkedFolderError, open_folder, unlink_in, write_at
from .disk_read import PARALLEL, EntryFile, Opened, ReadBatch, idle_cpus, open_entry_file, read_entry  # noqa: F401 - read_entry: store admin's
from .format import MAX_HEADER_BYTES, MacKey, parse_header
from .host import BufferPool

log = logging.getLogger(__name__)
_SUFFIX = ".kv"
_TEMP = ".tmp-"
DEFAULT_MAX_BYTES = 20 << 30
from kvrag.defaults import STALE_TEMP_S  # noqa: E402,F401
READ_MODES = ("auto", "map", "copy")
TOUCH_S = 60.0  # a read refreshes the LRU time (mtime) at most once a minute: no inode write per read


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TEMP, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_shard(e: os.DirEntry) -> bool:
    """A two-hex-digit shard folder of this store (never a symlink)."""
    return len(e.name) == 2 and all(c in "0123456789abcdef" for c in e.name) and e.is_dir(follow_symlinks=False)


def _is_entry_name(name: str) -> bool:
    if not name.endswith(_SUFFIX):
        return False
    try:
        check_key(name[: -len(_SUFFIX)])
    except StoreError:
        return False
    return True


def entry_meta(path: str, bound: int | None = None) -> dict[str, str] | None:
    """An entry file's header metadata (None: missing, not a regular file, or no readable header)."""
    opened = open_entry_file(path, bound)
    if not isinstance(opened[0], int):
        return None
    fd = opened[0]
    try:
        head = os.pread(fd, 4096, 0)
        n = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
        if len(head) < 8 + n <= 8 + MAX_HEADER_BYTES:
            head = os.pread(fd, 8 + n, 0)
    finally:
        os.close(fd)
    try:
        return dict(parse_header(np.frombuffer(head, dtype=np.uint8))[0]["__metadata__"])
    except CorruptEntryError:  # damaged or stale: not this look's business
        return None


class DiskStore(DiskIndex, ByteStore):
    tier = "disk"

    def __init__(
        self,
        root: str | os.PathLike,
        url: str | None = None,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        quantize: bool = False,
        pin: bool = False,
        threads: int | None = None,
        clean_temp: bool = True,
        read: str = "auto",
        key: str | bytes | MacKey | None = None,
        warn_unsigned: bool = True,
    ) -> None:
        """`read`: "copy" (the default, "auto" too: into staging buffers of the process, pinned with
        `pin`: see disk_read) or "map" (tensors view the file's pages, see disk_map).
        `threads`: readers of a copy request, the caller included; by default the CPU count, at most 4,
        of which the helpers join a request only while CPUs are idle (disk_read.idle_cpus); a count
        given here is always used.
        `clean_temp=False` leaves stale temp files alone on open (`kvrag store` lists them first).
        `key`: entries are signed and checked with it (default `$KVRAG_STORE_KEY`; see ByteStore); with
        one, opening looks at a few entry headers and warns once if some are unsigned (`warn_unsigned`)."""
        super().__init__(quantize=quantize, key=key)
        self.root = Path(root).expanduser()
        self.url = url or f"disk://{self.root}"
        self.max_bytes = max_bytes
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            (self.root / "index").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store folder {self.root}: {exc}") from exc
        self._entries = str(self.root / "entries")
        self.buffers = BufferPool(pin=pin)
        if read not in READ_MODES:
            raise StoreError(f"disk store read mode must be one of {', '.join(READ_MODES)} (got {read!r})")
        self.read = "copy" if read == "auto" else read
        self.threads = max(1, threads or min(4, os.cpu_count() or 1))  # readers, the caller included
        self.adaptive = not threads  # the default: helpers join a request only on idle CPUs; a given count always
        self.helped = 0  # copy requests read with helpers (the bench reports it beside the default's figure)
        self._pool: ThreadPoolExecutor | None = None
        self.temp_cleaned = self.clean_temp() if clean_temp else 0
        self._size: int | None = None  # running estimate, rescanned when over the cap
        self._index = str(self.root / "index")
        if warn_unsigned:
            self.warn_unsigned()

    def _path(self, key: str) -> Path:
        return Path(self._file(key))

    def _file(self, key: str) -> str:
        """The entry's path as a string: a read opens it without pathlib's cost (~15 us an entry)."""
        return f"{self._entries}{os.sep}{key[:2]}{os.sep}{key[2:4]}{os.sep}{key}{_SUFFIX}"

    # -- reads ------------------------------------------------------------------------------------
    def _open_entry(self, index: int, key: str) -> Opened:
        """Open the entry file of `key` for a ReadBatch: the open file with a buffer of its size, or
        the answer already (a miss, or a file too large to be an entry)."""
        path = self._file(key)
        opened = open_entry_file(path, self._entry_bound())
        if not isinstance(opened[0], int):
            return opened  # type: ignore[return-value]
        fd, st = opened
        try:
            return EntryFile(index, path, fd, self.buffers.take(st.st_size), touch=time.time() - st.st_mtime > TOUCH_S,
                             mac_key=self.mac_key, key=key)  # fmt: skip
        except BaseException:
            os.close(fd)
            raise

    def _entry_bound(self) -> int | None:
        """The most bytes an entry file may have: the entry limit, and the size cap."""
        bounds = [b for b in (self.entry_limit, self.max_bytes) if b is not None]
        return min(bounds) if bounds else None

    def _fetch_many(self, keys: Sequence[str]) -> list[Fetched]:
        if self.read == "map":
            return self._map_many(keys)
        helpers = self.threads - 1 if PARALLEL else 0
        if helpers and self.adaptive:  # the default: helpers only on CPUs that are idle now (disk_read.idle_cpus)
            idle = idle_cpus()
            helpers = helpers if idle is None else max(0, min(helpers, idle))
        pool = self._helpers() if helpers and keys else None
        if pool is not None:
            self.helped += 1
        return ReadBatch(lambda i: self._open_entry(i, keys[i]), len(keys)).run(pool, helpers)

    def _helpers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvrag-disk")
            return self._pool

    def _map_many(self, keys: Sequence[str]) -> list[Fetched]:
        """Mapped reads. Unkeyed, on one thread: the xxh3 pass is the only work, and it is faster alone.
        With a store key the MAC pass (SHA-256, ~15x slower than xxh3) is the bottleneck and releases
        the GIL, so the entries are shared among the caller and the store's reader threads."""
        bound = self._entry_bound()

        def share(idx: range) -> list[Fetched]:
            return [map_entry(self._file(keys[i]), bound, TOUCH_S, self.mac_key, keys[i]) for i in idx]

        n, t = len(keys), self.threads
        if self.mac_key is None or t < 2 or n < 2:
            return share(range(n))
        t = min(t, n)
        pool = self._helpers()
        try:
            futures = [pool.submit(share, range(j, n, t)) for j in range(1, t)]
        except RuntimeError:  # the store is closing: read on alone
            return share(range(n))
        out: list[Fetched] = [(None, 0)] * n
        for i, got in zip(range(0, n, t), share(range(0, n, t))):
            out[i] = got
        for j, fut in enumerate(futures, 1):
            for i, got in zip(range(j, n, t), fut.result()):
                out[i] = got
        return out

    def drop_page_cache(self, keys: Sequence[str] | None = None) -> int:
        """Ask the kernel to drop the cached pages of these entries' files (None: every entry), written
        back first, so their next read comes from the device (`kvrag bench speed`'s cold-from-the-device
        rows). Returns how many files were advised: 0 where the OS has no `posix_fadvise`. Pages that a
        live mapping holds (read=map) stay, and on tmpfs the pages are the files themselves."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:  # pragma: no cover - not POSIX
            return 0
        paths = [self._file(check_key(k)) for k in keys] if keys is not None else [e.path for e in self._files()]
        done = 0
        for path in paths:
            opened = open_entry_file(path)
            if not isinstance(opened[0], int):
                continue
            fd = opened[0]
            try:
                os.fdatasync(fd)  # dirty pages are not dropped
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                done += 1
            except OSError as exc:
                log.debug("could not drop the cached pages of %s: %s", path, exc)
            finally:
                os.close(fd)
        return done

    # -- writes and the size cap ------------------------------------------------------------------
    def _refused(self, exc: SymlinkedFolderError) -> None:
        log.warning("write refused: %s (the store's size cap counts only its own folders)", exc)
        with self._lock:
            self._stats.errors += 1

    def _write(self, key: str, data: bytes) -> None:
        name = f"{key}{_SUFFIX}"
        try:
            fd = open_folder(self._entries, (key[:2], key[2:4]), create=True)
        except SymlinkedFolderError as exc:
            self._refused(exc)
            return
        except OSError as exc:
            raise StoreError(f"cannot write {self._file(key)}: {exc}") from exc
        assert fd is not None
        try:
            try:
                old = os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
            except OSError:
                old = 0
            write_at(fd, name, data)
        except OSError as exc:
            raise StoreError(f"cannot write {self._file(key)}: {exc}") from exc
        finally:
            os.close(fd)
        if self.max_bytes is not None:
            with self._lock:
                if self._size is None:
                    self._size = self._scan_size()
                else:
                    self._size += len(data) - old  # an overwrite replaces, it does not add
                over = self._size > self.max_bytes
            if over:
                self.evict()

    def _remove(self, key: str) -> None:
        self._unlink_in(self._entries, (key[:2], key[2:4]), f"{key}{_SUFFIX}")

    def _unlink_in(self, top: str, shards: Sequence[str], name: str) -> None:
        """Delete `name` in a shard folder, never through a symlinked one (that file is not the store's)."""
        try:
            unlink_in(top, shards, name)
        except SymlinkedFolderError as exc:
            log.warning("not deleting %s: %s", name, exc)

    def _exists(self, key: str) -> bool:
        return self._path(key).exists()

    def _walk(self, temp: bool = False) -> list[os.DirEntry]:
        """Entry files (or, with temp=True, temp files) under entries/ (and index/ for temp files).

        Only what this store could have written: shard folders and files that are no symlinks, files
        that are regular and whose names are entry names (a key and the suffix) or temp names, so
        cleaning and eviction never follow a link out of the folder or delete a file it did not make."""
        dirs = []
        for top in os.scandir(self.root / "entries"):
            if _is_shard(top):
                dirs.extend(m.path for m in os.scandir(top.path) if _is_shard(m))
        if temp:
            dirs += [t.path for t in os.scandir(self.root / "index") if t.is_dir(follow_symlinks=False)]
        wanted = (lambda n: n.startswith(_TEMP)) if temp else _is_entry_name
        out = []
        for d in dirs:
            try:
                out.extend(e for e in os.scandir(d) if wanted(e.name) and e.is_file(follow_symlinks=False))
            except FileNotFoundError:
                continue
        return out

    def _files(self) -> list[os.DirEntry]:
        return self._walk()

    def clean_temp(self, older_than: float = STALE_TEMP_S) -> int:
        """Delete temp files older than `older_than` seconds (killed writers); returns how many."""
        removed, now = 0, time.time()
        for e in self._walk(temp=True):
            try:
                if now - e.stat().st_mtime > older_than:
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                continue
        if removed:
            log.info("removed %d stale temp files from %s", removed, self.root)
        return removed

    def _scan_size(self) -> int:
        """Bytes of entry files plus temp files in flight."""
        total = self._temp_bytes()
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
        total = sum(s for _, s, _ in files) + self._temp_bytes()
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

    def _temp_bytes(self) -> int:
        total = 0
        for e in self._walk(temp=True):
            try:
                total += e.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _sample_headers(self, limit: int) -> list[dict[str, str]]:
        """Up to `limit` entries' metadata, from their headers (non-blocking opens, regular files only)."""
        out: list[dict[str, str]] = []
        for e in self._walk():
            if len(out) >= limit:
                break
            meta = entry_meta(e.path, self._entry_bound())
            if meta is not None:
                out.append(meta)
        return out

    def __repr__(self) -> str:
        return (f"DiskStore({self.root}, max_bytes={self.max_bytes}, quantize={self.quantize}, pin={self.buffers.pin}, "
                f"read={self.read!r}, keyed={self.mac_key is not None})")  # fmt: skip

