"""Host memory: the buffers disk reads land in, and the host-RAM LRU tier (`host://`).

`BufferPool` hands out 1-D uint8 CPU tensors for reads. Lifetime rule: every entry read from disk
owns its own buffer (allocated or reused once per entry, read into once), and the tensors of the
returned entry are views of it, so the buffer lives exactly as long as any of those tensors (or a
view of them) does. The pool reuses a pageable buffer only when its storage use count shows no
tensor references it any more -- so a caller may hold returned tensors as long as it likes -- which
saves the kernel's page zeroing of fresh memory on every read. A pageable buffer of at least
`HUGE_MIN` bytes is private anonymous memory advised onto transparent huge pages where the OS
offers them (exact size, no rounding: the 2 MiB-aligned stretches inside it get huge pages), so the
kernel's copy out of the page cache into it walks fewer pages (3-10% faster disk reads measured on
2 cores). Pinned buffers (for CUDA targets) come from torch's caching host allocator instead, which
also waits for in-flight asynchronous copies out of a buffer before reusing it, something a use
count cannot see.

`HostStore` is a MemoryStore that keeps entries in CPU RAM (pinned when `pin=True` and CUDA is
available, so host-to-device copies run at full speed), bounded by default to
`DEFAULT_HOST_FRACTION` (25%) of physical memory.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading

import torch

from .memory import MemoryStore

DEFAULT_HOST_FRACTION = 0.25
_PAGE = 4096
HUGE_MIN = 4 << 20  # below this a buffer holds at most one aligned 2 MiB stretch: not worth an mmap
_HUGE_OK = all(hasattr(mmap, n) for n in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_HUGEPAGE"))


def physical_memory() -> int:
    """Bytes of physical RAM (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    """Python references to `t`'s storage object as `_use_count` sees them, less nobody else's."""
    s = t.untyped_storage()
    return sys.getrefcount(s)


_STORAGE_REFS = _storage_refs(torch.empty(1))  # the count when no caller holds the storage object


def _use_count(t: torch.Tensor) -> int | None:
    """How many tensors share `t`'s storage, beside `t`, plus the caller's own references to its storage
    object (None where torch does not expose the count). The storage object is one Python object per
    storage that holds one count itself, so a caller holding only `entry.keys.untyped_storage()` shows
    in its Python reference count, not in the storage's use count: without it, the pool would hand
    that memory to a later read while the caller still reads it."""
    if _STORAGE_USE_COUNT is None:  # pragma: no cover - another torch: no reuse, always fresh buffers
        return None
    s = t.untyped_storage()
    held = sys.getrefcount(s) - _STORAGE_REFS
    return int(_STORAGE_USE_COUNT(s._cdata)) - 2 + max(0, held)  # minus `t` and the storage object


def _fresh(nbytes: int) -> torch.Tensor:
    """A new pageable buffer; a large one on transparent huge pages where the OS offers them. The
    tensor keeps its mmap alive (torch.frombuffer holds a reference), so the memory lives exactly
    as long as the buffer or any view of it."""
    if _HUGE_OK and nbytes >= HUGE_MIN:
        try:
            m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # pragma: no cover - no THP here: plain pages
                pass
            return torch.frombuffer(m, dtype=torch.uint8)
        except (OSError, ValueError):  # pragma: no cover - fall back to the allocator
            pass
    return torch.empty(nbytes, dtype=torch.uint8)


class BufferPool:
    """Read buffers; a pageable one is reused only once nothing views it (see the module docstring)."""

    def __init__(self, pin: bool = False, max_idle_bytes: int = 256 << 20, max_tracked: int = 32) -> None:
        self.pin = bool(pin) and torch.cuda.is_available()
        self.max_idle_bytes = max_idle_bytes
        self.max_tracked = max_tracked
        self._bufs: list[torch.Tensor] = []  # most recently handed out last
        self._sizes: list[int] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly `nbytes` bytes (a view of a pooled one that may be slightly larger)."""
        if self.pin:
            self.allocated += 1
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        limit = nbytes + nbytes // 4 + _PAGE
        with self._lock:
            for i, size in enumerate(self._sizes):  # sizes first: a use count costs more
                if nbytes <= size <= limit and _use_count(self._bufs[i]) == 0:
                    buf = self._bufs.pop(i)
                    self._sizes.pop(i)
                    self.reused += 1
                    break
            else:
                buf = _fresh(-(-nbytes // _PAGE) * _PAGE)
                self.allocated += 1
                if _use_count(buf) is None:
                    return buf[:nbytes]
                self._trim()
            self._bufs.append(buf)
            self._sizes.append(buf.numel())
            return buf[:nbytes]

    def _trim(self) -> None:
        """Forget idle buffers beyond `max_idle_bytes` (freed) and the oldest beyond `max_tracked`
        (busy ones are not freed by this: their owners keep them)."""
        idle, keep = 0, []
        for buf in reversed(self._bufs):  # newest first: keep the recently used
            if _use_count(buf) == 0:
                idle += buf.numel()
                if idle > self.max_idle_bytes:
                    continue
            keep.append(buf)
        keep = keep[: self.max_tracked - 1][::-1]
        self._bufs, self._sizes = keep, [b.numel() for b in keep]


class HostStore(MemoryStore):
    """CPU-RAM LRU tier: entries copied to host memory (pinned on request), bounded in bytes."""

    tier = "host"

    def __init__(self, max_bytes: int | None = None, pin: bool = False, url: str = "host://") -> None:
        if max_bytes is None:
            max_bytes = int(DEFAULT_HOST_FRACTION * physical_memory()) or (4 << 30)
        super().__init__(max_bytes=max_bytes, url=url, device="cpu")
        self.pin = bool(pin) and torch.cuda.is_available()

    def _to_tier(self, t: torch.Tensor, mapped: bool = False) -> torch.Tensor:
        if self.pin:
            return t if t.device.type == "cpu" and t.is_pinned() else t.to("cpu").pin_memory()
        return t.to("cpu", copy=mapped)  # a mapped file's pages: memory of its own (see MemoryStore._to_tier)

    def __repr__(self) -> str:
        return f"HostStore(max_bytes={self.max_bytes}, pin={self.pin})"
