"""Index entries signed with the store key, so that whoever can write to the retrieval index (a shared
`chroma run` has no authentication of its own) cannot choose what is answered or credited.

Why: retrieval hands the engine the index's text, title and source as they are. With `$KVRAG_STORE_KEY`
set, every entry kvrag writes carries in its metadata (MAC_FIELD) an HMAC-SHA256 under the key
(format.MacKey) over a canonical encoding of the id, the text, the title and both source fields (the
file's public name and its path: what answers are read from and credited to). A keyed reader skips an
entry whose MAC is missing or wrong: counted (`unverified_index_count`, /metrics) and its id logged
(never its text), never answered nor credited. Without a key nothing is signed or checked.

The encoding: the domain DOMAIN, then each field in a fixed order as a type tag (absent, string, or a
JSON scalar) and a length-prefixed UTF-8 body. The store's own MACs start with an entry header's "{" or
the id links' "kvrag-id-ref\\0", so no index MAC can be replayed as theirs, nor theirs as one.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrag.cache_backends.format import MacKey

__all__ = ["MAC_FIELD", "count_unverified_index", "entry_mac", "index_key", "signed_metadata", "unverified_index_count",
           "verified_entry"]

log = logging.getLogger("kvrag.ingest")

MAC_FIELD = "kvrag_mac"  # the metadata key an entry's MAC is kept under
DOMAIN = b"kvrag-index-entry\x00"
_TITLE, _SOURCE_NAME, _SOURCE = "title", "source_name", "source"  # as kvrag.ingest.retrieval keeps them
KEY_ENV = "KVRAG_STORE_KEY"  # cache_backends.format.KEY_ENV, named here so a keyless index never imports torch
HINT = "re-run `kvrag ingest` (or POST /v1/chunks) with $KVRAG_STORE_KEY set to sign what kvrag wrote without it"

_lock = threading.Lock()
_count = 0
_named: set[str] = set()  # ids already named in the log at warning level (bounded: see _name_once)
_NAMED_MAX = 4096


def index_key(key: "str | bytes | MacKey | None" = None) -> "MacKey | None":
    """The key index entries are signed and checked with: `key` (an empty one: none), else
    `$KVRAG_STORE_KEY`, the store's own (cache_backends.format.mac_key). Torch is imported only when
    there is a key (format.py needs it), so an index without one opens as light as before."""
    if key is None:
        key = os.environ.get(KEY_ENV, "")
    if isinstance(key, (str, bytes)) and not key:
        return None
    from kvrag.cache_backends.format import mac_key

    return mac_key(key)


def _part(value: Any) -> bytes:
    if value is None:
        return b"-"
    if isinstance(value, str):
        body, tag = value.encode("utf-8", "surrogatepass"), b"s"
    else:  # a number or a bool, as Chroma stores it
        body, tag = json.dumps(value).encode(), b"j"
    return tag + len(body).to_bytes(8, "little") + body


def entry_mac(key: "MacKey", chunk_id: str, text: str | None, meta: Mapping[str, Any] | None) -> str:
    """The MAC of an index entry: its id, text, title and both source fields (see the module docstring)."""
    meta = meta or {}
    payload = DOMAIN + b"".join(_part(v) for v in (chunk_id, text, meta.get(_TITLE), meta.get(_SOURCE_NAME), meta.get(_SOURCE)))
    return key.mac("", payload).hexdigest()


def signed_metadata(key: "MacKey | None", chunk_id: str, text: str, meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the entry's MAC under MAC_FIELD (as it is without a key)."""
    if key is None:
        return meta
    return {**meta, MAC_FIELD: entry_mac(key, chunk_id, text, meta)}


def verified_entry(key: "MacKey | None", chunk_id: str, text: str | None, meta: Mapping[str, Any] | None) -> bool:
    """Whether a keyed reader may hand this entry to the engine (always, without a key). One that fails is
    counted and its id named in the log (at warning level the first time)."""
    if key is None:
        return True
    mac = (meta or {}).get(MAC_FIELD)
    if isinstance(mac, str) and hmac.compare_digest(mac.encode("utf-8", "surrogatepass"),
                                                    entry_mac(key, chunk_id, text, meta).encode()):
        return True
    count_unverified_index(1)
    _name_once(chunk_id, "missing" if mac is None else "wrong")
    return False


def _name_once(chunk_id: str, what: str) -> None:
    with _lock:
        first = chunk_id not in _named
        if first:
            if len(_named) >= _NAMED_MAX:  # many forged ids: name the new ones, forget the old
                _named.clear()
            _named.add(chunk_id)
    log.log(logging.WARNING if first else logging.DEBUG,
            "index entry %r: its MAC under the store key is %s, so its text, title and source are not trusted: skipped, "
            "never answered nor credited (%s)", chunk_id, what, HINT)


def count_unverified_index(n: int) -> None:
    """Add to the process's count of index entries the store key could not verify."""
    global _count
    with _lock:
        _count += n


def unverified_index_count() -> int:
    """Index entries skipped since the process started because the store key could not verify them."""
    with _lock:
        return _count
