"""Index entries signed with the store key, so that whoever can write to the retrieval index (a shared
`chroma run` has no authentication of its own) cannot choose what is answered or credited.

Why: retrieval hands the engine the index's text, title and source as they are. With `$KVRAG_STORE_KEY`
set, every entry kvrag writes carries in its metadata (MAC_FIELD) an HMAC-SHA256 under the key
(format.MacKey) over a canonical encoding of the id, the text, the title and both source fields (the
file's public name and its path: what answers are read from and credited to). A keyed reader skips an
entry whose MAC is missing or wrong: counted (`unverified_index_count`, /metrics) and its id logged
(never its text), never answered nor credited. Without a key nothing is signed or checked.

The vector an entry is found by is signed too: a copy of it (VECTOR_FIELD, float16) with a MAC over the
entry's MAC and that copy (VECTOR_MAC_FIELD), and the vector the index returns must lie within
VECTOR_MAX_DISTANCE of the copy (an index may re-normalise what it keeps, so its last bits are not
compared). Moving a signed entry's vector onto another question's made it retrieved first, credited and
answered. An entry signed before vectors were (no VECTOR_MAC_FIELD) is
checked by re-embedding its text instead (`ChunkIndex`), and signed whole when it is next written.

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

__all__ = ["MAC_FIELD", "VECTOR_FIELD", "VECTOR_MAC_FIELD", "count_unverified_index", "vector_mac", "vector_verdict", "entry_mac", "index_key", "signed_metadata", "unverified_index_count",
           "verified_entry"]

log = logging.getLogger("kvrag.ingest")

MAC_FIELD = "kvrag_mac"  # the metadata key an entry's MAC is kept under
VECTOR_FIELD = "kvrag_vec"  # the metadata key a signed copy of its vector is kept under (float16, base64)
VECTOR_MAC_FIELD = "kvrag_vmac"  # the metadata key that copy's MAC is kept under
VECTOR_MAX_DISTANCE = 1e-3  # cosine distance allowed between the signed copy and the vector the index holds
MAX_VECTOR_CHARS = 1 << 16
DOMAIN = b"kvrag-index-entry\x00"
VECTOR_DOMAIN = b"kvrag-index-vector\x00"
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


def _encode_vector(vector: Any) -> str:
    import base64

    import numpy as np

    return base64.b64encode(np.asarray(vector, dtype="<f2").tobytes()).decode("ascii")


def _decode_vector(text: Any) -> Any:
    import base64

    import numpy as np

    if not isinstance(text, str) or len(text) > MAX_VECTOR_CHARS:
        return None
    try:
        return np.frombuffer(base64.b64decode(text.encode("ascii"), validate=True), dtype="<f2").astype(np.float64)
    except (ValueError, UnicodeEncodeError):
        return None


def vector_mac(key: "MacKey", mac: str, encoded: str) -> str:
    """The MAC of an entry's signed vector copy (VECTOR_FIELD), bound to the entry's own MAC (so to its id,
    text, title and source)."""
    body = encoded.encode("ascii", "replace")
    return key.mac("", VECTOR_DOMAIN + mac.encode("utf-8", "surrogatepass") + len(body).to_bytes(8, "little") + body).hexdigest()


def signed_metadata(key: "MacKey | None", chunk_id: str, text: str, meta: dict[str, Any], vector: Any = None) -> dict[str, Any]:
    """`meta` with the entry's MAC under MAC_FIELD and, given its vector, the vector's under
    VECTOR_MAC_FIELD (as it is without a key)."""
    if key is None:
        return meta
    mac = entry_mac(key, chunk_id, text, meta)
    out = {**meta, MAC_FIELD: mac}
    if vector is not None:
        encoded = _encode_vector(vector)
        out[VECTOR_FIELD] = encoded
        out[VECTOR_MAC_FIELD] = vector_mac(key, mac, encoded)
    return out


def vector_verdict(key: "MacKey | None", meta: Mapping[str, Any] | None, vector: Any) -> str:
    """For an entry whose MAC verified: "ok" (the index finds it by the vector signed with it, within
    VECTOR_MAX_DISTANCE, or there is no key), "moved" (by another vector, or a vector copy not signed with
    it), "unsigned" (signed before vectors were: the caller re-embeds its text to check), "missing" (no
    vector came back to check)."""
    if key is None:
        return "ok"
    meta = meta or {}
    signed, encoded = meta.get(VECTOR_MAC_FIELD), meta.get(VECTOR_FIELD)
    if signed is None and encoded is None:
        return "unsigned"
    if vector is None:
        return "missing"
    if not (isinstance(signed, str) and isinstance(encoded, str) and hmac.compare_digest(
            signed.encode("utf-8", "surrogatepass"), vector_mac(key, str(meta.get(MAC_FIELD, "")), encoded).encode())):
        return "moved"
    import numpy as np

    copy, found = _decode_vector(encoded), np.asarray(vector, dtype=np.float64).ravel()
    if copy is None or copy.shape != found.shape:
        return "moved"
    denom = float(np.linalg.norm(copy) * np.linalg.norm(found)) or 1.0
    return "ok" if 1.0 - float(copy @ found) / denom <= VECTOR_MAX_DISTANCE else "moved"


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
