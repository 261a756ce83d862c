"""Redis store: binary values, pipelined multi-get, optional TTL, pooled connections, split large entries.

Keys carry a hash tag (`kvrag:{<key>}` and its parts `kvrag:{<key>}:p1`…) so an entry and its
parts live in one slot of a Redis Cluster; reads use a non-transactional pipeline of GETs, which
redis-py's cluster client routes per node. For a cluster, pass the client:
`RedisStore(client=redis.cluster.RedisCluster(host=..., port=...))`.

Faults: a connection error marks the server down for a back-off period (doubling up to 30 s);
while down, reads are fast misses and writes are skipped, with one warning per outage, so the
engine computes chunks instead and keeps serving. Parts are written before the manifest that
names them, so a reader never sees an entry whose parts are missing.
"""

from __future__ import annotations

import logging
import struct
import time
from typing import Any, Sequence
from urllib.parse import parse_qs, urlparse

from .base import ByteStore, StoreError

log = logging.getLogger(__name__)

_PREFIX = "kvrag:"
_INDEX = "kvrag:index"
_MANIFEST = b"KVRAGPARTS"  # value of a split entry: magic + part count + total length


class RedisStore(ByteStore):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        client: Any = None,
        ttl: int | None = None,
        part_bytes: int = 32 << 20,
        quantize: bool = False,
        socket_timeout: float = 5.0,
    ) -> None:
        super().__init__(quantize=quantize)
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - the [redis] extra
            raise StoreError("the Redis store needs the redis package: pip install 'kvrag[redis]'") from exc
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.url = url
        q = parse_qs(urlparse(url).query)
        self.ttl = ttl if ttl is not None else (int(q["ttl"][0]) if "ttl" in q else None)
        self.part_bytes = int(q["part_bytes"][0]) if "part_bytes" in q else part_bytes
        if client is None:
            clean = url.split("?", 1)[0]
            client = redis.Redis.from_url(
                clean, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout, health_check_interval=30
            )
        self.client = client
        self._down_until = 0.0
        self._backoff = 0.5
        self._warned = False

    # -- fault handling ---------------------------------------------------------------------------
    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self._stats.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            if not self._warned:
                self._warned = True
                log.warning("Redis at %s unreachable (%s); computing chunks instead until it is back", self.url, exc)

    def _recovered(self) -> None:
        if self._warned or self._backoff != 0.5:
            with self._lock:
                if self._warned:
                    log.warning("Redis at %s is back", self.url)
                self._warned = False
                self._backoff = 0.5

    def _call(self, fn, default):
        if not self._available():
            return default
        try:
            result = fn()
        except self._errors as exc:
            self._failed(exc)
            return default
        self._recovered()
        return result

    # -- raw operations ---------------------------------------------------------------------------
    @staticmethod
    def _name(key: str, part: int = 0) -> str:
        return f"{_PREFIX}{{{key}}}" + (f":p{part}" if part else "")

    def _read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        def run() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.get(self._name(k))
            values = pipe.execute()
            return [self._join(k, v) for k, v in zip(keys, values)]

        return self._call(run, [None] * len(keys))

    def _join(self, key: str, value: bytes | None) -> bytes | None:
        if value is None or not value.startswith(_MANIFEST):
            return value
        count, total = struct.unpack("<II", value[len(_MANIFEST) : len(_MANIFEST) + 8])
        pipe = self.client.pipeline(transaction=False)
        for i in range(1, count + 1):
            pipe.get(self._name(key, i))
        parts = pipe.execute()
        if any(p is None for p in parts):
            return None  # a part expired or was evicted: a miss
        data = b"".join(parts)
        return data if len(data) == total else None

    def _write(self, key: str, data: bytes) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            if len(data) <= self.part_bytes:
                pipe.set(self._name(key), data, ex=self.ttl)
            else:
                parts = [data[i : i + self.part_bytes] for i in range(0, len(data), self.part_bytes)]
                for i, part in enumerate(parts, 1):
                    pipe.set(self._name(key, i), part, ex=self.ttl)
                manifest = _MANIFEST + struct.pack("<II", len(parts), len(data))
                pipe.set(self._name(key), manifest, ex=self.ttl)  # after its parts
            pipe.execute()

        self._call(run, None)

    def _remove(self, key: str) -> None:
        def run() -> None:
            head = self.client.get(self._name(key))
            names = [self._name(key)]
            if head is not None and head.startswith(_MANIFEST):
                count = struct.unpack("<I", head[len(_MANIFEST) : len(_MANIFEST) + 4])[0]
                names += [self._name(key, i) for i in range(1, count + 1)]
            self.client.delete(*names)

        self._call(run, None)

    def _exists(self, key: str) -> bool:
        return bool(self._call(lambda: self.client.exists(self._name(key)), 0))

    def _link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        if user_ids:
            self._call(lambda: self.client.hset(_INDEX, mapping=dict(zip(user_ids, keys))), None)

    def _resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        if not user_ids:
            return []
        values = self._call(lambda: self.client.hmget(_INDEX, list(user_ids)), [None] * len(user_ids))
        return [v.decode() if isinstance(v, bytes) else v for v in values]

    @property
    def available(self) -> bool:
        """False while the server is considered down (inside a back-off period)."""
        return self._available()

    def __repr__(self) -> str:
        return f"RedisStore({self.url.split('@')[-1]}, ttl={self.ttl})"
