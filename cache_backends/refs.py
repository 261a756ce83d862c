"""Id refs: the node-id index's values (user id -> entry key), signed with the store key when there is one.

A ref is the entry key, or with a key (`$KVRAG_STORE_KEY`, format.MacKey) the entry key, a space and
an HMAC over (the digest of the namespaced id "<namespace>/<id>", the entry key). Why: the entries
are signed, but a ref names which entry an id answers with; without a MAC, copying another signed
entry's key into an id's ref made that id answer with the other entry's text. The MAC binds both the
id (through its SHA-256, which is what a disk ref's file name is, so `kvrag store sign` can sign a
ref without knowing its id) and the key, so neither a ref copied to another id nor a key pasted into
a ref verifies. A reader with a key serves only refs whose MAC verifies; an unsigned ref or one of
another key is a miss (counted, never deleted). Without a key, the MAC is ignored: refs written
without a key keep working without one, and signed refs read without a key as before.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .base import StoreError, check_key, user_id_digest
from .format import MacKey

MAX_REF_BYTES = 512  # a key (at most 128 hex digits), a space and a MAC (64): anything longer is not a ref
_DOMAIN = b"kvrag-id-ref\x00"  # an entry's MAC input starts with JSON's "{": the two never collide

OK, UNSIGNED, MISMATCH, MALFORMED = "ok", "unsigned", "mismatch", "malformed"


def ref_mac(key: MacKey, digest: str, entry_key: str) -> str:
    """The MAC of a ref from the id digest `digest` to `entry_key`."""
    return key.mac(entry_key, _DOMAIN + digest.encode("ascii")).hexdigest()


def ref_value(key: MacKey | None, user_id: str, entry_key: str) -> str:
    """What the index stores for `user_id` -> `entry_key`: the key, signed when there is a store key."""
    check_key(entry_key)
    return entry_key if key is None else f"{entry_key} {ref_mac(key, user_id_digest(user_id), entry_key)}"


@dataclass(frozen=True)
class RefCheck:
    """A ref read back: the entry key it names (None when malformed) and whether the store key vouches for it."""

    entry_key: str | None
    status: str  # OK (verified, or no key in use), UNSIGNED, MISMATCH (another key's, or forged), MALFORMED

    @property
    def served(self) -> str | None:
        """The entry key a reader may use: only an OK ref's."""
        return self.entry_key if self.status == OK else None


def check_ref(value: bytes | str | None, key: MacKey | None, digest: str) -> RefCheck:
    """Parse and verify a ref's value for the id digest `digest` (see the module docstring)."""
    try:
        text = value.decode("ascii") if isinstance(value, (bytes, bytearray)) else str(value)
    except UnicodeDecodeError:
        return RefCheck(None, MALFORMED)
    parts = text.split()
    if len(parts) not in (1, 2) or len(text) > MAX_REF_BYTES:
        return RefCheck(None, MALFORMED)
    try:
        entry_key = check_key(parts[0])
    except StoreError:
        return RefCheck(None, MALFORMED)
    if key is None:
        return RefCheck(entry_key, OK)
    if len(parts) == 1:
        return RefCheck(entry_key, UNSIGNED)
    good = hmac.compare_digest(parts[1].encode(), ref_mac(key, digest, entry_key).encode())
    return RefCheck(entry_key, OK if good else MISMATCH)
