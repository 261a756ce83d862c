"""Reading and signing the calibration file as warily as a store entry: it lives in a model cache other
users or processes may be able to write, and it chooses every request's default setting.

Why each check (issue 69): a plain checksum anyone can recompute, so with `$KVRAG_STORE_KEY` set the
file carries an HMAC-SHA256 under the key (`file_mac`); without one a file writable by anyone but its
owner, or owned by another user, is refused (as ssh's StrictModes refuses such a key file). The file is
opened without following a symlink and without blocking (a FIFO at its path would hang the reader), read
only when it is a regular file of at most MAX_BYTES, and its JSON nesting is bounded before it is parsed
(200,000 nested brackets raised RecursionError, which stopped `kvrag serve` at start). Nothing here
imports torch: `kvrag methods` reads the file at once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import stat
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("kvrag.check.calibration_store")

KEY_ENV = "KVRAG_STORE_KEY"  # cache_backends.format.KEY_ENV: the key that signs store entries signs this too
MAX_BYTES = 4 << 20  # a calibration file is a few KiB; anything larger is not one
MAX_DEPTH = 32  # a calibration's JSON nests 4 deep; deeper is not one
DOMAIN = b"kvrag-calibration\x00"  # no store entry, id link or index entry MAC starts so: none replays as another
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(r"[\[\]{}]")

_lock = threading.Lock()
_told: set[tuple[str, str]] = set()


class Refused(ValueError):
    """A calibration file not read: what it is and why (logged once per file and reason)."""


def store_key() -> bytes | None:
    """The store key's secret as cache_backends.format.MacKey derives it (None without a key), here so
    that reading a calibration never imports torch."""
    raw = os.environ.get(KEY_ENV, "")
    if not raw:
        return None
    return hashlib.sha256(b"kvrag-store-key\x00" + raw.encode("utf-8", "surrogatepass")).digest()


def file_mac(secret: bytes, fingerprint: str, device: str, versions: dict[str, Any], result: Any) -> str:
    """The keyed MAC of one device's calibration: the model's fingerprint, the device type, the versions
    it was measured under and the whole result, canonically encoded."""
    body = json.dumps([fingerprint, device, versions, result], sort_keys=True, ensure_ascii=True, allow_nan=True)
    return hmac.new(secret, DOMAIN + body.encode(), hashlib.sha256).hexdigest()


def check_depth(text: str, limit: int = MAX_DEPTH) -> None:
    """ValueError when `text`'s arrays and objects nest deeper than `limit` (strings skipped): checked before
    json.loads, whose recursion a deep enough file exhausts."""
    depth = 0
    for m in _BRACKETS.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        if depth > limit:
            raise Refused(f"its JSON nests deeper than {limit}")


def parse(text: str) -> Any:
    """JSON of bounded depth (Refused, a ValueError, for anything else: never RecursionError)."""
    check_depth(text)
    try:
        return json.loads(text)
    except RecursionError:  # pragma: no cover - check_depth bounds it first
        raise Refused("its JSON nests too deep") from None


def read_text(path: Path, strict: bool) -> str:
    """The file's text, read only if it is a regular file (no symlink followed, no FIFO waited on) of at
    most MAX_BYTES. `strict` (no store key): also refused when another user owns it or anyone but its
    owner may write it. FileNotFoundError when there is none; Refused (or OSError) when it is not read."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        if path.is_symlink():
            raise Refused("it is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("it is not a regular file")
        if st.st_size > MAX_BYTES:
            raise Refused(f"it holds {st.st_size} bytes, more than {MAX_BYTES}")
        if strict and hasattr(os, "geteuid"):
            if st.st_uid != os.geteuid():
                raise Refused(f"it is owned by another user (uid {st.st_uid}), and no $KVRAG_STORE_KEY signs it")
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise Refused(f"others than its owner may write it (mode {stat.S_IMODE(st.st_mode):o}), and no "
                              "$KVRAG_STORE_KEY signs it")
        chunks, left = [], MAX_BYTES + 1
        while left > 0:
            part = os.read(fd, min(left, 1 << 16))
            if not part:
                break
            chunks.append(part)
            left -= len(part)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise Refused(f"it holds more than {MAX_BYTES} bytes")
    return data.decode("utf-8")


def read_json(path: Path, strict: bool = False) -> Any:
    """`read_text` then `parse`: the file's JSON, or an exception (FileNotFoundError, Refused, OSError,
    ValueError) saying why not."""
    return parse(read_text(path, strict))


def tell_once(path: Path, why: str, what: str = "calibrating again") -> None:
    """Log at warning level the first time a file is refused for a reason, then at debug level."""
    key = (str(path), why)
    with _lock:
        first = key not in _told
        if first:
            if len(_told) > 1024:
                _told.clear()
            _told.add(key)
    log.log(logging.WARNING if first else logging.DEBUG, "the calibration kept at %s is not used (%s): %s", path, why, what)
