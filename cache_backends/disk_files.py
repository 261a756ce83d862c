"""Small-file I/O inside a disk store that never leaves it: shard folders opened without following a
symlink, files written by an atomic rename in the folder's descriptor, small files (id refs) read
non-blocking, regular files only, up to a bound.

Why: the store's size cap counts what its walk finds, and the walk never follows a symlinked shard
folder; a write through one would land outside the store, uncounted (40 entries, 5.3 MB under a
200 kB cap). And a FIFO planted at a ref's path blocked a reader for good, a symlink to /dev/zero
made it read without end: a reader opens with O_NOFOLLOW | O_NONBLOCK and checks the file's type and
size on its descriptor before reading anything.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from dataclasses import dataclass
from typing import Sequence

from .base import StoreError

TEMP_PREFIX = ".tmp-"
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_NEW_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class SymlinkedFolderError(StoreError):
    """A shard folder of the store is a symlink (or not a folder): nothing is written through it."""


@dataclass(frozen=True)
class BadFile:
    """What stands at a path where the store expects a small regular file of its own."""

    reason: str  # "a symlink", "a FIFO", "a character device", "3 GB, over the 512-byte bound", ...


def kind_of(mode: int) -> str:
    """A file type in words, for logs."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a regular file"


def open_folder(top: str, parts: Sequence[str], create: bool = False) -> int | None:
    """A descriptor of top/parts[0]/parts[1]/..., each part opened without following a symlink (`top`,
    the store's own folder, as given); missing parts are made when `create`, else None. A part that
    is a symlink or a file: SymlinkedFolderError. The caller closes the descriptor."""
    fd = os.open(top, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    return None
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass  # another writer made it first
                nfd = _open_part(part, fd, top)
            except OSError as exc:
                raise _refused(part, top, exc) from None
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _open_part(part: str, fd: int, top: str) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise _refused(part, top, exc) from None


def _refused(part: str, top: str, exc: OSError) -> StoreError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return SymlinkedFolderError(f"{os.path.join(top, part)} is a symlink or not a folder: the store writes nothing through it")
    return StoreError(f"cannot open {os.path.join(top, part)}: {exc}")


def unlink_in(top: str, parts: Sequence[str], name: str) -> None:
    """Delete `name` in the shard folder `parts` under `top`, never through a symlinked folder (that
    file is not the store's: SymlinkedFolderError); a name or folder already gone is no error."""
    fd = open_folder(top, parts)
    if fd is None:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def write_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write `name` in the folder `dir_fd` atomically: a fresh temp file of its own (never through a
    link), renamed over the name. Readers see the old file or the whole new one."""
    tmp = f"{TEMP_PREFIX}{secrets.token_hex(8)}"
    fd = os.open(tmp, _NEW_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def read_small(path: str, bound: int, dir_fd: int | None = None) -> bytes | BadFile | None:
    """The bytes of a small regular file: None when missing, BadFile when it is a symlink, a FIFO, a
    device, a folder or over `bound` bytes (checked on its descriptor: nothing is read from it)."""
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return BadFile("a symlink")
        if exc.errno == errno.ENXIO:  # a socket
            return BadFile("a socket")
        raise StoreError(f"cannot read {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return BadFile(kind_of(st.st_mode))
        if st.st_size > bound:
            return BadFile(f"{st.st_size} bytes, over the {bound}-byte bound")
        data = os.read(fd, bound + 1)
        if len(data) > bound:  # grew since the fstat
            return BadFile(f"over the {bound}-byte bound")
        return data
    finally:
        os.close(fd)
