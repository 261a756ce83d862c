"""KV stores chosen by URL.

- `memory://?max_bytes=N&device=cuda` — in-process LRU (with `device`, kept on that device: the GPU tier)
- `host://?max_bytes=N&pin=1` — CPU-RAM LRU, pinned for fast uploads; default cap 25% of RAM
- `disk:///path?max_bytes=N&quantize=int8&pin=1&threads=T&read=copy|map` — the embedded default; cap 20 GiB
  unless given (`max_bytes=none`: no cap)
- `redis://[:password@]host:port/db?ttl=S` (also `rediss://`) — shared by many workers
- `tiered://?workers=W&tiers=<url>|<url>|...` — tiers fastest first, `tiers=` last (see tiered.py);
  the older `tiered://?lower=<url>&max_bytes=N` is memory over `<url>`

Disk and Redis stores sign every entry they write and check every entry they read with
`$KVRAG_STORE_KEY` when it is set (or `key=` on `DiskStore`/`RedisStore`; see format.MacKey), and
refuse entries over the bound the engine sets from its model (`limit_entry_bytes`, passed on by a
tiered store to its tiers) before reading them.

Sizes take plain numbers (`2e9` too). An option a store does not know is a StoreURLError (a
ValueError) naming it and the allowed ones. `default_store_url(root, device)` is the stack to use
when none is configured: GPU memory -> pinned host -> disk on CUDA, memory -> disk on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlparse

import torch

from .redis_options import REDIS_SCHEMES, redact_url
from .base import CorruptEntryError, KVEntry, KVStore, StoreError, StoreStats, StoreURLError, content_key
from .byte_store import ByteStore
from .disk import DEFAULT_MAX_BYTES, READ_MODES, DiskStore
from .format import FORMAT_VERSION, KEY_ENV, MacKey, entry_bytes_bound
from .host import HostStore
from .memory import MemoryStore
from .tiered import TieredStore

__all__ = [
    "default_disk_url",
    "ByteStore",
    "CorruptEntryError",
    "DiskStore",
    "FORMAT_VERSION",
    "HostStore",
    "KEY_ENV",
    "KVEntry",
    "KVStore",
    "MacKey",
    "MemoryStore",
    "StoreError",
    "StoreStats",
    "StoreURLError",
    "TieredStore",
    "content_key",
    "default_store_url",
    "entry_bytes_bound",
    "open_store",
    "tier_urls",
]

_OPTIONS = {
    "memory": {"max_bytes", "device"},
    "host": {"max_bytes", "pin"},
    "disk": {"max_bytes", "quantize", "pin", "threads", "read"},
    "tiered": {"tiers", "lower", "max_bytes", "workers"},
}
DEFAULT_MEMORY_BYTES = 2 << 30


def _check_options(scheme: str, url: str, q: dict) -> None:
    allowed = _OPTIONS[scheme]
    for name in q:
        if name not in allowed:
            raise StoreURLError(
                f"unknown option {name!r} in {scheme}:// store URL {url!r}; allowed: {', '.join(sorted(allowed))}"
            )


def _int(q: dict, name: str, url: str) -> int | None:
    if name not in q:
        return None
    try:
        return int(float(q[name][0]))
    except ValueError:
        raise StoreURLError(f"{name} must be a number in {url!r}, got {q[name][0]!r}") from None


def _flag(q: dict, name: str, url: str) -> bool:
    value = q.get(name, ["0"])[0].lower()
    if value not in ("0", "1", "false", "true", "no", "yes"):
        raise StoreURLError(f"{name} must be 0 or 1 in {url!r}, got {value!r}")
    return value in ("1", "true", "yes")


def _quantize(q: dict) -> str:
    from .format import storage_of

    try:
        return storage_of(q.get("quantize", ["none"])[0])
    except ValueError as exc:
        raise StoreURLError(str(exc)) from None


def _read_mode(q: dict) -> str:
    value = q.get("read", ["auto"])[0].lower()
    if value not in READ_MODES:
        raise StoreURLError(f"read must be one of {', '.join(READ_MODES)}, got {value!r}")
    return value


def default_disk_url(root: str | Path, pin: bool = False) -> str:
    """The default disk store at `root`: KV kept at `DEFAULT_DISK_PRECISION` (kvrag.defaults), so what
    `kvrag ingest` writes is what an engine's default store reads (the precision is in every key)."""
    from kvrag.defaults import DEFAULT_DISK_PRECISION

    root = Path(root).expanduser().absolute()
    return f"disk://{root}?quantize={DEFAULT_DISK_PRECISION}" + ("&pin=1" if pin else "")


def default_store_url(root: str | Path, device: str | torch.device | None = None) -> str:
    """The store stack for `device` when none is configured: GPU memory (10% of the GPU, at most
    2 GiB) -> pinned host RAM (25% of RAM) -> disk on CUDA; memory (2 GiB) -> disk on the CPU."""
    root = Path(root).expanduser().absolute()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory if torch.cuda.is_available() else 0
        gpu = min(DEFAULT_MEMORY_BYTES, int(0.1 * total)) or DEFAULT_MEMORY_BYTES
        return f"tiered://?tiers=memory://?device={dev}&max_bytes={gpu}|host://?pin=1|{default_disk_url(root, pin=True)}"
    return f"tiered://?tiers=memory://?max_bytes={DEFAULT_MEMORY_BYTES}|{default_disk_url(root)}"


def _split_tiered(url: str) -> tuple[dict, list[str]]:
    query = url.split("?", 1)[1] if "?" in url else ""
    head, sep, tail = ("&" + query).partition("&tiers=")
    q = parse_qs(head.lstrip("&"))
    _check_options("tiered", url, q)
    if sep:
        if "lower" in q:
            raise StoreURLError(f"give tiers= or lower=, not both: {url!r}")
        parts = [p if "://" in p else f"{p}://" for p in tail.split("|")]
    else:
        lower = q.get("lower", [None])[0]
        if not lower:
            raise StoreURLError(f"tiered store URL needs tiers: tiered://?tiers=memory|disk:///path (got {url!r})")
        parts = [f"memory://?max_bytes={_int(q, 'max_bytes', url) or DEFAULT_MEMORY_BYTES}", lower]
    if len(parts) < 2 or any(not p.split("://")[0] or p.lower().startswith("tiered") for p in parts):
        raise StoreURLError(f"a tiered store needs two or more non-tiered tiers, got {parts} from {url!r}")
    return q, parts


def tier_urls(url: str) -> list[str]:
    """The store URLs a tiered URL is made of (a non-tiered URL: itself), e.g. for checking every
    disk path a user-typed URL would open."""
    if urlparse(url).scheme.lower() != "tiered":
        return [url]
    return _split_tiered(url)[1]


def _open_tiered(url: str) -> TieredStore:
    q, parts = _split_tiered(url)
    return TieredStore([open_store(p) for p in parts], workers=_int(q, "workers", url) or 4, url=url)


def open_store(url: str | None = None, default_root: str | Path | None = None, device: str | torch.device | None = None) -> KVStore:
    """Open a store from its URL (see the module docstring).

    With no URL: `default_store_url(default_root, device)` when a device is given, else a plain
    disk store at `default_root`.
    """
    if url is None:
        if default_root is None:
            raise StoreError("no store URL and no default folder given")
        if device is not None:
            return open_store(default_store_url(default_root, device))
        return open_store(default_disk_url(default_root))
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in REDIS_SCHEMES:  # its options are the Redis store's own business
        from .redis_store import RedisStore

        return RedisStore(url, quantize=_quantize(parse_qs(parsed.query)))
    if scheme == "tiered":
        return _open_tiered(url)
    q = parse_qs(parsed.query, keep_blank_values=True)
    if scheme in _OPTIONS:
        _check_options(scheme, url, q)
    if scheme == "memory":
        device = q.get("device", [None])[0]
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise StoreURLError(f"memory store on {device} but CUDA is not available: {url!r}")
        return MemoryStore(max_bytes=_int(q, "max_bytes", url), url=url, device=device)
    if scheme == "host":
        return HostStore(max_bytes=_int(q, "max_bytes", url), pin=_flag(q, "pin", url), url=url)
    if scheme == "disk":
        path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
        if not path:
            raise StoreError(f"disk store URL needs a path: {url!r} (e.g. disk:///var/cache/kvrag)")
        cap = q.get("max_bytes", [""])[0].lower()
        max_bytes = None if cap == "none" else (_int(q, "max_bytes", url) if cap else DEFAULT_MAX_BYTES)
        return DiskStore(
            path,
            url=url,
            max_bytes=max_bytes,
            quantize=_quantize(q),
            pin=_flag(q, "pin", url),
            threads=_int(q, "threads", url),
            read=_read_mode(q),
        )
    raise StoreError(
        f"unknown store URL scheme {scheme!r} in {redact_url(url)!r}; supported: memory://, host://, disk:///path, "
        "redis://host:port/db, rediss://, tiered://?tiers=..."
    )
