"""A store whose faults never fail a request: every call that raises is logged and answered with a default."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvrag.cache_backends import KVEntry, KVStore

log = logging.getLogger(__name__)


class GuardedStore:
    """Wraps a KVStore: reads that fail are misses, writes that fail are skipped (both logged)."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def _call(self, name: str, *args: Any, default: Any) -> Any:
        try:
            return getattr(self.store, name)(*args)
        except Exception as exc:  # a store fault never fails a request
            log.warning("store %s failed (%s)", name, exc)
            return default

    def get(self, key: str) -> KVEntry | None:
        return self._call("get", key, default=None)

    def get_many(self, keys: Sequence[str]) -> list[KVEntry | None]:
        return self._call("get_many", list(keys), default=[None] * len(keys)) if keys else []

    def put(self, key: str, entry: KVEntry) -> None:
        self._call("put", key, entry, default=None)

    def contains(self, key: str) -> bool:
        return bool(self._call("contains", key, default=False))

    def delete(self, key: str) -> None:
        self._call("delete", key, default=None)

    def link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        self._call("link", list(user_ids), list(keys), default=None)

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self._call("resolve", list(user_ids), default=[None] * len(user_ids)) if user_ids else []

    def prefetch(self, keys: Sequence[str]) -> None:
        self._call("prefetch", list(keys), default=None)
