"""The store admin over Redis: entries, parts no manifest names, the id-link hash."""

from __future__ import annotations

from typing import Any, Iterator, Sequence


from kvrag.cache_backends import StoreError
from kvrag.cache_backends.base import CorruptEntryError, check_key, user_id_digest
from kvrag.cache_backends.byte_store import decode_fetched
from kvrag.cache_backends.format import MAX_HEADER_BYTES, header_length
from kvrag.cache_backends.refs import MAX_REF_BYTES, check_ref, ref_value
from kvrag.cache_backends.admin.base import EntryInfo, Link, StoreAdmin, TempFile, damage_of, unverified_or_damaged
from kvrag.cache_backends.admin.base import _BATCH, HEAD_BYTES, _as_tensor, _header_meta



# -- Redis --------------------------------------------------------------------------------------
class RedisAdmin(StoreAdmin):
    kind = "redis"

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        from kvrag.cache_backends import redis_store

        self.rs = redis_store
        self.client = store.client

    def _pipe(self):
        pipe = self.client.pipeline(transaction=False)
        if not self.store.cluster:  # a connection-wide command has no slot to be routed by in a cluster
            pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # Redis 7.2+: our reads leave LRU/LFU alone; older: ignored
        return pipe

    def _run(self, pipe) -> list[Any]:
        try:
            return pipe.execute(raise_on_error=False)[0 if self.store.cluster else 1 :]
        except self.store._down_errors as exc:
            raise StoreError(f"Redis at {self.url} is unreachable: {self.store._redact(exc)}") from None

    def _names(self) -> tuple[list[str], list[tuple[str, int]]]:
        """Entry keys and (key, part) of every part, from one SCAN of `kvrag:{*`."""
        heads, parts = [], []
        try:
            names = list(self.client.scan_iter(match=self.rs._PREFIX + "{*", count=1000))
        except self.store._down_errors as exc:
            raise StoreError(f"Redis at {self.url} is unreachable: {self.store._redact(exc)}") from None
        for raw in names:
            name = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
            body = name[len(self.rs._PREFIX) :]
            if not body.startswith("{") or "}" not in body:
                continue
            key, _, rest = body[1:].partition("}")
            try:
                check_key(key)
            except StoreError:
                continue
            if not rest:
                heads.append(key)
            elif rest.startswith(":p") and rest[2:].isdigit():
                parts.append((key, int(rest[2:])))
        return heads, parts

    def entries(self) -> Iterator[EntryInfo]:
        heads, _ = self._names()
        for start in range(0, len(heads), _BATCH):
            batch = heads[start : start + _BATCH]
            pipe = self._pipe()
            for k in batch:
                name = self.rs.RedisStore._name(k)
                pipe.execute_command("OBJECT", "IDLETIME", name)  # before any read resets it
                pipe.strlen(name)
                pipe.getrange(name, 0, HEAD_BYTES - 1)
            values = self._run(pipe)
            for i, key in enumerate(batch):
                idle, size, head = values[3 * i : 3 * i + 3]
                if isinstance(head, Exception) or head is None or (isinstance(size, int) and size == 0):
                    continue  # expired or refused since the scan
                age = float(idle) if isinstance(idle, int) else None
                nbytes = int(size) if isinstance(size, int) else 0
                first = head
                if head.startswith(self.rs._MANIFEST):
                    try:
                        _, nbytes, _ = self.rs.parse_manifest(self.client.get(self.rs.RedisStore._name(key)) or b"",
                                                               self.store.options.max_entry_bytes)
                    except CorruptEntryError as exc:
                        yield EntryInfo(key, nbytes, age, {}, f"corrupt: {exc}")
                        continue
                    first = self.client.getrange(self.rs.RedisStore._name(key, 1), 0, HEAD_BYTES - 1) or b""
                    part = 1
                else:
                    part = 0
                n = header_length(_as_tensor(first))
                if n is not None and HEAD_BYTES < 8 + n <= 8 + MAX_HEADER_BYTES:
                    first = self.client.getrange(self.rs.RedisStore._name(key, part), 0, 8 + n - 1) or first
                meta, problem = _header_meta(_as_tensor(first))
                yield EntryInfo(key, nbytes, age, meta, problem)

    def _bytes(self, key: str) -> bytes | str | None:
        """The entry's bytes (parts gathered), None when gone, or the problem ("corrupt: …")."""
        head = self.client.get(self.rs.RedisStore._name(key))
        if head is None or not head.startswith(self.rs._MANIFEST):
            return head
        try:
            data = self.store._read_parts(key, *self.rs.parse_manifest(head, self.store.options.max_entry_bytes))
        except CorruptEntryError as exc:
            return f"corrupt: {exc}"
        return "corrupt: a part of this split entry is missing" if data is None else data

    def verify(self, key: str) -> str | None:
        # Not RedisStore.get: that deletes a malformed manifest itself, which --dry-run must not.
        data = self._bytes(key)
        if data is None or isinstance(data, str):
            return data
        keyed = damage_of(decode_fetched(data, self.store.mac_key, key)[0])
        return unverified_or_damaged(keyed, lambda: decode_fetched(data, None, key)[0])

    def raw(self, key: str) -> bytes | None:
        data = self._bytes(key)
        return data if isinstance(data, bytes) else None

    def links(self) -> list[Link]:
        out = []
        for uid, value in self.client.hgetall(self.rs._INDEX).items():
            user_id = uid.decode("utf-8", "surrogatepass") if isinstance(uid, bytes) else uid
            digest = user_id_digest(user_id)
            if len(value) > MAX_REF_BYTES:
                out.append(Link(user_id, None, uid, status=f"bad: {len(value)} bytes, over the {MAX_REF_BYTES}-byte bound"))
                continue
            ref = check_ref(value, self.store.mac_key, digest)
            out.append(Link(user_id, ref.entry_key, uid, status=ref.status, digest=digest))
        return out

    def sign_link(self, link: Link) -> None:
        if self.store.mac_key is not None and link.key is not None and link.user_id is not None:
            self.client.hset(self.rs._INDEX, link.handle, ref_value(self.store.mac_key, link.user_id, link.key))

    def unlink(self, links: Sequence[Link]) -> None:
        if links:
            self.client.hdel(self.rs._INDEX, *[lk.handle for lk in links])

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        self.store.unlink(user_ids)

    def orphan_parts(self) -> list[TempFile]:
        """Parts whose entry has no manifest naming them: a writer died between parts and manifest,
        or a corrupt manifest was deleted (parts have no TTL of their own unless the store has one)."""
        heads, parts = self._names()
        counts: dict[str, int] = {}
        pipe = self._pipe()
        for k in heads:
            pipe.getrange(self.rs.RedisStore._name(k), 0, len(self.rs._MANIFEST) + 11)
        for k, head in zip(heads, self._run(pipe)):
            if isinstance(head, bytes) and head.startswith(self.rs._MANIFEST):
                try:
                    counts[k] = self.rs.parse_manifest(head, self.store.options.max_entry_bytes)[0]
                except CorruptEntryError:
                    pass
        orphans = [(k, p) for k, p in parts if p > counts.get(k, 0)]
        pipe = self._pipe()
        for k, p in orphans:
            name = self.rs.RedisStore._name(k, p)
            pipe.execute_command("OBJECT", "IDLETIME", name)
            pipe.strlen(name)
        values = self._run(pipe)
        out = []
        for i, (k, p) in enumerate(orphans):
            idle, size = values[2 * i : 2 * i + 2]
            if isinstance(idle, int):
                out.append(TempFile(self.rs.RedisStore._name(k, p), int(size) if isinstance(size, int) else 0, float(idle)))
        return out

    def temp_files(self) -> list[TempFile]:
        return self.orphan_parts()

    def remove_temp(self, temp: TempFile) -> None:
        if not temp.name.startswith(self.rs._PREFIX + "{") or ":p" not in temp.name:
            raise StoreError(f"refusing to delete {temp.name!r}: not a part of a kvrag entry")
        self.client.delete(temp.name)

    def cap(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ttl_s": self.store.ttl}
        try:
            cfg = self.client.config_get("maxmemory")
            out["maxmemory"] = int(cfg.get("maxmemory", 0)) or None
            out["maxmemory_policy"] = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except Exception:  # managed servers may refuse CONFIG
            pass
        return out
