"""Redis store: binary values, pipelined multi-get, optional TTL, pooled connections, split large entries.

Keys carry a hash tag (`kvrag:{<key>}` and its parts `kvrag:{<key>}:p1`…) so an entry and its
parts live in one slot of a Redis Cluster; reads use a non-transactional pipeline of GETs, which
redis-py's cluster client routes per node. For a cluster, pass the client:
`RedisStore(client=redis.cluster.RedisCluster(host=..., port=...))`.

URL options (see redis_options.py): `socket_timeout` (default 0.5 s per read or write),
`connect_timeout` (default 1 s), `ttl`, `part_bytes`, `max_entry_bytes` (default 4 GiB - 1),
`quantize`; an unknown option or a malformed value is a ValueError. The URL is shown only
redacted (`redis://user:***@host:port/db`): in `.url`, the repr and every log line.

Faults: a connection error or a timeout marks the server down for a back-off period (doubling up
to 30 s); while down, reads are fast misses and writes are skipped, with one warning per outage,
so the engine computes chunks instead and keeps serving. Timeouts are never retried (a frozen
server costs one `socket_timeout`); a broken pooled connection is retried once, on a fresh one.
A command the server refuses (OOM under `maxmemory`, a key of the wrong type) is a logged skip or
a miss, without a back-off. Parts are written, and acknowledged, before the manifest that names
them, so a reader never sees an entry whose parts are missing. Every count and length read back is
bounded: a malformed manifest is a logged miss and is deleted, like a corrupt entry. Values are read
with GETRANGE up to the entry bound (`max_entry_bytes`, and the engine's `limit_entry_bytes`) plus one
byte, so a value larger than any entry this model writes costs at most that to find out, never its
whole length; parts likewise, up to the part size the manifest names.

`key=` (default `$KVRAG_STORE_KEY`): entries are signed and checked with it (see format.MacKey), and
so are the id hash's values (refs.py: the entry key and a MAC over the id and the key); with a key, a
value that does not verify is a counted miss, never served and never deleted.
"""

from __future__ import annotations

import logging
import struct
import time
from urllib.parse import unquote, urlsplit
from typing import Any, Callable, Sequence, TypeVar

from .base import CorruptEntryError, StoreError, user_id_digest
from .byte_store import ByteStore
from .format import MAX_HEADER_BYTES, MacKey, parse_header
from .refs import MAX_REF_BYTES, check_ref, ref_value
from .redis_options import CLUSTER_SCHEMES, RedisOptions, connection_url, redact_url, url_secrets

log = logging.getLogger(__name__)
T = TypeVar("T")

_PREFIX = "kvrag:"
_INDEX = "kvrag:index"
_MANIFEST = b"KVRAGPARTS"  # value of a split entry: magic + part count, total length, part size (uint32 each)
_MAX_PARTS = 1 << 16  # one entry is never split further; bounds a read whatever a manifest claims
_BATCH = 64  # parts fetched per round trip, so a read stops early at a missing part
_WARN_EVERY = 60.0  # seconds between two warnings about refused commands of one kind


def parse_manifest(value: bytes, max_entry_bytes: int) -> tuple[int, int, int | None]:
    """(part count, total length, part size or None for manifests older than the part size field).

    Raises CorruptEntryError unless the numbers agree with each other and the limits, so a damaged
    or hostile manifest never makes a read fetch more than max_entry_bytes or _MAX_PARTS parts."""
    body = value[len(_MANIFEST) :]
    if len(body) == 8:
        (count, total), part = struct.unpack("<II", body), None
    elif len(body) == 12:
        count, total, part = struct.unpack("<III", body)
    else:
        raise CorruptEntryError(f"split-entry manifest has {len(body)} bytes after its magic, expected 8 or 12")
    if not 0 < total <= max_entry_bytes:
        raise CorruptEntryError(f"manifest claims {total} bytes (max_entry_bytes={max_entry_bytes})")
    consistent = count == -(-total // part) if part else 1 <= count <= total
    if not consistent or count > _MAX_PARTS:
        raise CorruptEntryError(f"manifest claims {count} parts for {total} bytes in parts of {part or '?'}")
    return count, total, part


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The seed nodes of a `redis+cluster://[user:password@]host:port,host:port/` URL."""
    netloc = urlsplit(url).netloc.rsplit("@", 1)[-1]
    nodes = []
    for item in filter(None, netloc.split(",")):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise StoreError(f"Redis Cluster URL node {item!r} is not host:port (in {redact_url(url)})")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise StoreError(f"Redis Cluster URL names no node: {redact_url(url)} (e.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000/)")
    return nodes


def cluster_client(url: str, o: RedisOptions) -> Any:
    """redis-py's cluster client over the URL's seed nodes: it learns the rest of the cluster and routes
    each key to its shard's master (an entry and its parts share a slot by their hash tag)."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    parts = urlsplit(url)
    user = password = None
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        name, sep, secret = userinfo.partition(":")
        user, password = (unquote(name) or None, unquote(secret)) if sep else (None, unquote(name))
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in cluster_nodes(url)],
        username=user, password=password, ssl=parts.scheme.lower() == "rediss+cluster",
        socket_timeout=o.socket_timeout, socket_connect_timeout=o.connect_timeout,
        retry=Retry(NoBackoff(), 1),  # a dead shard is a miss soon, not rounds of reconnects
    )


def _head_meta(head: object) -> dict[str, str] | None:
    """An entry's metadata from its first bytes, if they hold its whole header."""
    if not isinstance(head, bytes) or len(head) < 8:
        return None
    import numpy as np

    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER_BYTES or 8 + n > len(head):
        return None
    try:
        return dict(parse_header(np.frombuffer(head, dtype=np.uint8))[0]["__metadata__"])
    except CorruptEntryError:
        return None


class RedisStore(ByteStore):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        client: Any = None,
        ttl: int | None = None,
        part_bytes: int | None = None,
        quantize: bool | None = None,
        socket_timeout: float | None = None,
        connect_timeout: float | None = None,
        max_entry_bytes: int | None = None,
        key: str | bytes | MacKey | None = None,
    ) -> None:
        """Options come from the URL; keyword arguments given (not None) override them. `key`: the
        secret entries are signed and checked with (default `$KVRAG_STORE_KEY`; see ByteStore)."""
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - the [redis] extra
            raise StoreError("the Redis store needs the redis package: pip install 'kvrag[redis]'") from exc
        o = RedisOptions.from_url(url, ttl=ttl, part_bytes=part_bytes, quantize=quantize,
                                  socket_timeout=socket_timeout, connect_timeout=connect_timeout,
                                  max_entry_bytes=max_entry_bytes)  # fmt: skip
        super().__init__(quantize=o.quantize, key=key)
        self.options, self.url, self.ttl, self.part_bytes = o, o.url, o.ttl, o.part_bytes
        self._secrets = url_secrets(url)
        self._down_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._refusals = (redis.exceptions.RedisError,)
        self.cluster = urlsplit(url).scheme.lower() in CLUSTER_SCHEMES or type(client).__name__ == "RedisCluster"
        if client is None and self.cluster:
            client = cluster_client(url, o)
        if client is None:
            client = redis.Redis.from_url(
                connection_url(url),
                socket_timeout=o.socket_timeout,
                socket_connect_timeout=o.connect_timeout,
                health_check_interval=30,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            )
        self.client = client
        # back-off while the server (or, on a cluster, one shard's master: keyed by node name) is down
        self._down_until: dict[str, float] = {}
        self._backoff: dict[str, float] = {}
        self._warned: set[str] = set()
        self._last_warning: dict[str, float] = {}
        self.warn_unsigned()

    # -- fault handling ---------------------------------------------------------------------------
    def _redact(self, text: object) -> str:
        """Exception texts may echo what was sent; no credential of the URL reaches a log line."""
        text = str(text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _node(self, name: str) -> str:
        """Which server a Redis key lives on, for the back-off: "" for a single server; on a cluster its
        shard's master ("host:port"), or "uncovered" when no live master serves its slot."""
        if not self.cluster:
            return ""
        try:
            return str(self.client.get_node_from_key(name).name)
        except Exception:  # the slot is not covered (its master died and nothing took over)
            return "uncovered"

    def _available(self, node: str = "") -> bool:
        return time.monotonic() >= self._down_until.get(node, 0.0)

    def _failed(self, exc: Exception, node: str = "") -> None:
        """Back off from this server (a cluster: this shard only, the others keep serving), doubling."""
        with self._lock:
            self._stats.errors += 1
            backoff = self._backoff.get(node, 0.5)
            self._down_until[node] = time.monotonic() + backoff
            self._backoff[node] = min(backoff * 2, 30.0)
            if node not in self._warned:
                self._warned.add(node)
                where = f"{self.url} (shard {node})" if node else self.url
                log.warning("Redis at %s unreachable (%s: %s); computing chunks instead until it is back",
                            where, type(exc).__name__, self._redact(exc))  # fmt: skip

    def _recovered(self, node: str = "") -> None:
        if node in self._warned or node in self._backoff:
            with self._lock:
                if node in self._warned:
                    log.warning("Redis at %s is back", f"{self.url} (shard {node})" if node else self.url)
                self._warned.discard(node)
                self._backoff.pop(node, None)

    def _refused(self, what: str, exc: Exception) -> None:
        """The server is up but refused a command: count it, warn now and then, no back-off."""
        now = time.monotonic()
        with self._lock:
            self._stats.errors += 1
            if now - self._last_warning.get(what, -_WARN_EVERY) < _WARN_EVERY:
                return
            self._last_warning[what] = now
        log.warning("Redis at %s refused a %s, skipped (%s: %s)", self.url, what, type(exc).__name__,
                    self._redact(exc)[:300])  # fmt: skip

    def _call(self, what: str, fn: Callable[[], T], default: T, node: str = "") -> T:
        """Run fn unless its server (`node`: a cluster's shard) is down; any Redis fault becomes
        `default`, never an exception."""
        if not self._available(node):
            return default
        try:
            result = fn()
        except self._down_errors as exc:
            self._failed(exc, node)
            return default
        except self._refusals as exc:
            self._refused(what, exc)
            return default
        self._recovered(node)
        return result

    # -- raw operations ---------------------------------------------------------------------------
    @staticmethod
    def _name(key: str, part: int = 0) -> str:
        return f"{_PREFIX}{{{key}}}" + (f":p{part}" if part else "")

    def _bound(self) -> int:
        """The most bytes an entry may have: `max_entry_bytes`, and the engine's entry limit."""
        limit = self.entry_limit
        return self.options.max_entry_bytes if limit is None else min(limit, self.options.max_entry_bytes)

    def _read_many(self, keys: Sequence[str]) -> list[bytes | CorruptEntryError | None]:
        """One pipeline per server: on a cluster, a dead shard's keys are misses and the others are read."""
        bound = self._bound()
        by_node: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            by_node.setdefault(self._node(self._name(k)), []).append(i)
        out: list[bytes | CorruptEntryError | None] = [None] * len(keys)
        for node, at in by_node.items():
            group = [keys[i] for i in at]

            def run(group: list[str] = group) -> list[bytes | CorruptEntryError | None]:
                pipe = self.client.pipeline(transaction=False)
                for k in group:
                    pipe.getrange(self._name(k), 0, bound)  # at most bound + 1 bytes, whatever is stored
                values = pipe.execute(raise_on_error=False)  # one refused key is a miss, not all of them
                return [self._join(k, v, bound) for k, v in zip(group, values)]

            for i, value in zip(at, self._call("read", run, [None] * len(group), node)):
                out[i] = value
        return out

    def _join(self, key: str, value: Any, bound: int) -> bytes | CorruptEntryError | None:
        """The entry's bytes from its value: as is, or gathered from the parts its manifest names."""
        if isinstance(value, Exception):
            self._refused("read", value)
            return None
        if not value:  # GETRANGE of a missing key (or of an empty value, which the next put replaces)
            return None
        if len(value) > bound:
            return CorruptEntryError(f"entry value of more than {bound} bytes is over this store's entry limit")
        if not value.startswith(_MANIFEST):
            return value
        try:
            return self._read_parts(key, *parse_manifest(value, bound))
        except CorruptEntryError as exc:
            log.warning("deleting corrupt cache entry %s…: %s", key[:12], exc)
            with self._lock:
                self._stats.errors += 1
            self.client.delete(self._name(key))  # its parts expire or are overwritten by the next put
            return None

    def _read_parts(self, key: str, count: int, total: int, part_bytes: int | None) -> bytes | None:
        """Parts in batches; None when one is missing (expired, evicted), corrupt when sizes disagree."""
        parts: list[bytes] = []
        size = 0
        for start in range(1, count + 1, _BATCH):
            pipe = self.client.pipeline(transaction=False)
            for i in range(start, min(start + _BATCH, count + 1)):
                pipe.getrange(self._name(key, i), 0, part_bytes or total)  # one byte over says "too long"
            for i, part in enumerate(pipe.execute(), start):
                if not part:  # missing (GETRANGE answers b"")
                    return None
                size += len(part)
                if size > total or (part_bytes and i < count and len(part) != part_bytes):
                    raise CorruptEntryError(f"part {i} of {count} has {len(part)} bytes, not what the manifest says")
                parts.append(part)
        if size != total:
            raise CorruptEntryError(f"parts hold {size} bytes, the manifest says {total}")
        return b"".join(parts)

    def _write(self, key: str, data: bytes) -> None:
        size, step = len(data), self.part_bytes
        if size > self.options.max_entry_bytes or -(-size // step) > _MAX_PARTS:
            log.warning("not storing entry %s… of %d bytes: over max_entry_bytes=%d or %d parts of part_bytes=%d",
                        key[:12], size, self.options.max_entry_bytes, _MAX_PARTS, step)  # fmt: skip
            with self._lock:
                self._stats.errors += 1
            return

        def run() -> None:
            if size <= step:
                self.client.set(self._name(key), data, ex=self.ttl)
                return
            pipe = self.client.pipeline(transaction=False)
            for i, start in enumerate(range(0, size, step), 1):
                pipe.set(self._name(key, i), data[start : start + step], ex=self.ttl)
            pipe.execute()  # raises on a refused part: then no manifest names it
            manifest = _MANIFEST + struct.pack("<III", -(-size // step), size, step)
            self.client.set(self._name(key), manifest, ex=self.ttl)

        self._call("write", run, None, self._node(self._name(key)))

    def _remove(self, key: str) -> None:
        def run() -> None:
            # a manifest is at most MAGIC + 12 bytes: one more says "not a manifest" without fetching a large value
            head = self.client.getrange(self._name(key), 0, len(_MANIFEST) + 12)
            names = [self._name(key)]
            if head is not None and head.startswith(_MANIFEST):
                try:
                    count = parse_manifest(head, self.options.max_entry_bytes)[0]
                except CorruptEntryError:
                    count = 0  # a bogus count names no parts worth asking for
                names += [self._name(key, i) for i in range(1, count + 1)]
            self.client.delete(*names)

        self._call("delete", run, None, self._node(self._name(key)))

    def _exists(self, key: str) -> bool:
        return bool(self._call("read", lambda: self.client.exists(self._name(key)), 0, self._node(self._name(key))))

    def _link(self, user_ids: Sequence[str], keys: Sequence[str]) -> None:
        """HSET recreates the index if it was lost (FLUSHALL, a restart, eviction). With a store key
        each value is signed (refs.py)."""
        if user_ids:
            mapping = {u: ref_value(self.mac_key, u, k) for u, k in zip(user_ids, keys)}
            self._call("index write", lambda: self.client.hset(_INDEX, mapping=mapping), None, self._node(_INDEX))

    def _resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        """A lost index, a lost id or a value that is not a ref resolves to None; with a store key, so
        does a value whose MAC does not verify (counted, kept)."""
        if not user_ids:
            return []
        values = self._call("index read", lambda: self.client.hmget(_INDEX, list(user_ids)), [None] * len(user_ids), self._node(_INDEX))
        out: list[str | None] = []
        for uid, value in zip(user_ids, values):
            if value is None:
                out.append(None)
                continue
            d = user_id_digest(uid)
            ref = check_ref(value, self.mac_key, d) if len(value) <= MAX_REF_BYTES else None
            if ref is None or ref.status == "malformed":
                self._bad_ref(f"{_INDEX}[{d[:12]}…]", "not a ref")
            elif ref.served is None:
                self._unverified_ref(d, ref.status)
            out.append(ref.served if ref is not None else None)
        return out

    def _sample_headers(self, limit: int) -> list[dict[str, str]]:
        """Up to `limit` entries' metadata from their first bytes (a split entry's first part); a
        fault is an empty look (the open never waits on a down server beyond its timeouts)."""

        def run() -> list[dict[str, str]]:
            names: list = []
            cursor = 0
            for _ in range(8):  # a few SCAN rounds at most: a large keyspace is not walked at start-up
                cursor, got = self.client.scan(cursor, match=_PREFIX + "{*}", count=1000)
                names += got
                if not cursor or len(names) >= limit:
                    break
            names = names[:limit]
            pipe = self.client.pipeline(transaction=False)
            for n in names:
                pipe.getrange(n, 0, 4095)
            out = []
            for n, head in zip(names, pipe.execute(raise_on_error=False)):
                if isinstance(head, bytes) and head.startswith(_MANIFEST):
                    name = n.decode() if isinstance(n, bytes) else n
                    head = self.client.getrange(name + ":p1", 0, 4095)
                meta = _head_meta(head)
                if meta is not None:
                    out.append(meta)
            return out

        return self._call("read", run, [], self._node(_INDEX)) if not self.cluster else []

    def unlink(self, user_ids: Sequence[str]) -> None:
        """Drop these ids from the node-id index (their entries stay)."""
        if user_ids:
            self._call("index write", lambda: self.client.hdel(_INDEX, *[str(u) for u in user_ids]), None, self._node(_INDEX))

    @property
    def available(self) -> bool:
        """False while the server is considered down (inside a back-off period); on a cluster, while
        any shard is (the others still serve their keys)."""
        return all(self._available(n) for n in list(self._down_until))

    def __repr__(self) -> str:
        return f"RedisStore({self.url}, ttl={self.ttl})"
