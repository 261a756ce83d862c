"""`kvrag store sign`: vouch, with the store key, for a store written without it (entries and id refs).

Why: a keyed reader serves only what its key verifies and never deletes the rest, so a store filled
from a shell without `$KVRAG_STORE_KEY` (or by a replica with another key) stays unanswerable until
someone who holds the key says "this data is ours". Only entries whose unkeyed checksum is sound are
signed (the data bytes unchanged, the header given a MAC: format.sign_entry_bytes); by default only
unsigned ones, since an entry or ref carrying another key's MAC may be forged (`include_foreign`
signs those too, for replicas that ran with another key).
"""

from __future__ import annotations

from typing import Any

from kvrag.cache_backends import StoreError
from kvrag.cache_backends.base import CorruptEntryError
from kvrag.cache_backends.format import sign_entry_bytes
from kvrag.cache_backends.admin.base import StoreAdmin


def sign(admin: StoreAdmin, include_foreign: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Sign (or, dry run, list) the entries and id refs the store key cannot verify; returns what was
    signed and what was left (damaged, or of another key without `include_foreign`)."""
    key = admin.mac_key
    if key is None:
        raise StoreError("`kvrag store sign` signs with the store key: set $KVRAG_STORE_KEY (the key the readers use)")
    signed, left = [], []
    for e in admin.entries():
        if e.problem is not None:
            continue  # stale or unreadable: `kvrag store gc` removes it
        problem = admin.verify(e.key)
        if problem is None or not problem.startswith("unverified"):
            if problem:
                left.append({"key": e.key, "problem": problem})
            continue
        if "mac" in e.meta and not include_foreign:
            left.append({"key": e.key, "problem": "signed with another key (--include-foreign signs it)"})
            continue
        if not dry_run:
            data = admin.raw(e.key)
            if data is None:
                continue  # deleted meanwhile
            try:
                admin.rewrite(e.key, sign_entry_bytes(data, key, e.key))
            except CorruptEntryError as exc:
                left.append({"key": e.key, "problem": f"corrupt: {exc}"})
                continue
        signed.append(e.key)
    links_signed, links_left = [], []
    for lk in admin.links():
        if not lk.unverified:
            continue
        if lk.status == "mismatch" and not include_foreign:
            links_left.append(lk.name)
            continue
        if not dry_run:
            admin.sign_link(lk)
        links_signed.append(lk.name)
    return {"store": admin.url, "dry_run": dry_run, "entries_signed": signed, "entries_left": left,
            "links_signed": links_signed, "links_left": links_left}
