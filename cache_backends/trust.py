"""What a keyed store met and could not verify: counts for the whole process (for `/metrics`) and a
warning once per store, never one per read.

Why a count and not a deletion: an entry or id ref without a MAC, or with another key's, may be a
genuine writer's (an ingest run from a shell without `$KVRAG_STORE_KEY`, a replica configured with
another key). A keyed reader refuses to serve it but leaves it: `kvrag store sign` re-signs a store
written without the key, `kvrag store gc --unverified` removes such data on purpose.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("kvrag.cache_backends")

_lock = threading.Lock()
_counts = {"entries": 0, "refs": 0}

HINT = "`kvrag store sign` re-signs data written without the key; `kvrag store gc --unverified` removes it"


def count_unverified(entries: int = 0, refs: int = 0) -> None:
    """Add to the process's counts of reads the store key could not verify."""
    with _lock:
        _counts["entries"] += entries
        _counts["refs"] += refs


def unverified_counts() -> dict[str, int]:
    """Reads refused since the process started because the store key could not verify them:
    {"entries": ..., "refs": ...} over every keyed store in the process."""
    with _lock:
        return dict(_counts)


class WarnOnce:
    """A warning logged the first time only (later ones at debug level), per store."""

    def __init__(self) -> None:
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, topic: str, msg: str, *args: object) -> None:
        with self._lock:
            first = topic not in self._done
            self._done.add(topic)
        log.log(logging.WARNING if first else logging.DEBUG, msg, *args)
