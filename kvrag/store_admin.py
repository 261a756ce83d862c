"""`kvrag store stats|ls|rm|gc`: look into a KV store and tidy it, without loading a model.

Works on `disk://` and `redis://` stores (and `memory://`, which in a fresh process is empty); a
`tiered://` URL is managed through its one persistent tier (disk or Redis). What it reads:

- entries, by their header only (safetensors JSON: `model` fingerprint, `layout`, `kind`,
  `tokens`, dtype, quantisation) -- no tensor is loaded, except by `gc`, which verifies checksums;
- each entry's age: time since it was last written or read (disk: the file's mtime, which a read
  refreshes at most once a minute; Redis: `OBJECT IDLETIME`);
- the node-id index (`"<namespace>/<id>" -> key`, namespace = content_key(fingerprint, layout)[:16]);
- temp files of writers (disk) and split-entry parts no manifest names (Redis).

The functions (`store_stats`, `list_entries`, `remove`, `gc`) return plain dicts, which the CLI
prints as text or, with `--json`, as JSON. `add_store_parser(subparsers)` and `cmd_store(args)` are
the CLI's hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qs, urlparse

import torch

from kvrag.cache_backends import DiskStore, MemoryStore, StoreError, content_key, open_store, tier_urls
from kvrag.cache_backends.base import CorruptEntryError, check_key
from kvrag.cache_backends.byte_store import decode_fetched
from kvrag.cache_backends.disk import _O_FLAGS, _SUFFIX, _TEMP, DEFAULT_MAX_BYTES, STALE_TEMP_S, read_entry
from kvrag.cache_backends.format import MAX_HEADER_BYTES, FORMAT_VERSION, StaleEntryError, header_length, parse_header
from kvrag.errors import KVRagError

HEAD_BYTES = 4096  # first read of an entry: a real header is well under this
_BATCH = 256  # Redis keys per pipeline

__all__ = ["EntryInfo", "StoreAdmin", "add_store_parser", "cmd_store", "gc", "list_entries", "namespace_of", "open_admin",
           "remove", "store_stats"]


def namespace_of(model: str, layout: str) -> str:
    """The node-id index namespace of a (model fingerprint, layout identity): the same formula as
    `KVRepository.namespace`, so ids can be resolved without loading the model."""
    return content_key(model, layout)[:16]


@dataclass
class EntryInfo:
    key: str
    nbytes: int
    age_s: float | None  # since last written or read; None where the store cannot tell
    meta: dict[str, str] = field(default_factory=dict)  # model, layout, kind, tokens, dtype, quant, format
    problem: str | None = None  # the header could not be read: "stale: ..." (older format) or "corrupt: ..."

    def row(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Link:
    user_id: str | None  # None on disk: the index file is named by the id's hash
    key: str | None  # what it points to; None when the value is not a store key
    handle: Any  # what unlink() needs
    age_s: float | None = None
    name: str = ""  # how to show it: the id, or the index file

    def __post_init__(self) -> None:
        self.name = self.name or self.user_id or str(self.handle)


@dataclass
class TempFile:
    name: str
    nbytes: int
    age_s: float


def _header_meta(buf: torch.Tensor) -> tuple[dict[str, str], str | None]:
    """The entry's metadata from its first bytes, or the problem with them."""
    try:
        header, _ = parse_header(buf)
    except StaleEntryError as exc:
        return {}, f"stale: {exc}"
    except CorruptEntryError as exc:
        return {}, f"corrupt: {exc}"
    meta = dict(header["__metadata__"])
    meta.pop("checksum", None)
    meta.pop("magic", None)
    return meta, None


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


class StoreAdmin:
    """What the admin commands need from one kind of store."""

    kind = ""

    def __init__(self, store: Any) -> None:
        self.store = store

    @property
    def url(self) -> str:
        return self.store.url

    def entries(self) -> Iterator[EntryInfo]:
        raise NotImplementedError

    def verify(self, key: str) -> str | None:
        """Read the whole entry and check it: None if sound, else the problem."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def exists(self, key: str) -> bool:
        return self.store.contains(key)

    def links(self) -> list[Link]:
        raise NotImplementedError

    def index_namespaces(self) -> set[str]:
        """Namespaces the index itself names (where ids are readable)."""
        return {lk.user_id.split("/", 1)[0] for lk in self.links() if lk.user_id and "/" in lk.user_id}

    def unlink(self, links: Sequence[Link]) -> None:
        raise NotImplementedError

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        raise NotImplementedError

    def resolve(self, user_ids: Sequence[str]) -> list[str | None]:
        return self.store.resolve(list(user_ids))

    def temp_files(self) -> list[TempFile]:
        return []

    def remove_temp(self, temp: TempFile) -> None:
        raise NotImplementedError

    def cap(self) -> dict[str, Any]:
        return {}


# -- disk ---------------------------------------------------------------------------------------
class DiskAdmin(StoreAdmin):
    kind = "disk"
    store: DiskStore

    def _entry_path(self, key: str) -> Path:
        return self.store._path(key)

    def entries(self) -> Iterator[EntryInfo]:
        now = time.time()
        for e in self.store._files():
            key = e.name[: -len(_SUFFIX)]
            try:
                check_key(key)
                st = e.stat()
                with open(e.path, "rb") as f:
                    head = f.read(HEAD_BYTES)
                    n = header_length(_as_tensor(head))
                    if n is not None and HEAD_BYTES < 8 + n <= 8 + MAX_HEADER_BYTES:
                        head += f.read(8 + n - len(head))
            except (StoreError, FileNotFoundError):
                continue  # not an entry name, or deleted while listed
            meta, problem = _header_meta(_as_tensor(head))
            yield EntryInfo(key, st.st_size, max(0.0, now - st.st_mtime), meta, problem)

    def verify(self, key: str) -> str | None:
        # Not DiskStore.get: that deletes what it finds damaged and refreshes the LRU time.
        try:
            fd = os.open(self._entry_path(key), _O_FLAGS)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            entry, _ = read_entry(fd, torch.empty(size, dtype=torch.uint8)) if size else (CorruptEntryError("empty file"), 0)
        finally:
            os.close(fd)
        if isinstance(entry, StaleEntryError):
            return f"stale: {entry}"
        if isinstance(entry, CorruptEntryError):
            return f"corrupt: {entry}"
        return None

    def links(self) -> list[Link]:
        out, now = [], time.time()
        index = self.store.root / "index"
        for d in sorted(index.iterdir()) if index.is_dir() else ():
            if not d.is_dir():
                continue
            for ref in d.glob("*.ref"):
                try:
                    text = ref.read_text(errors="replace").strip()
                    age = now - ref.stat().st_mtime
                except FileNotFoundError:
                    continue
                try:
                    key: str | None = check_key(text)
                except StoreError:
                    key = None
                out.append(Link(None, key, ref, max(0.0, age), f"{ref.relative_to(self.store.root)} -> {text[:16]}"))
        return out

    def index_namespaces(self) -> set[str]:
        return set()  # ids are hashed on disk: namespaces come from the entries' headers

    def unlink(self, links: Sequence[Link]) -> None:
        for lk in links:
            Path(lk.handle).unlink(missing_ok=True)

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        self.store.unlink(user_ids)

    def temp_files(self) -> list[TempFile]:
        out, now = [], time.time()
        for e in self.store._walk(temp=True):
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            out.append(TempFile(os.path.relpath(e.path, self.store.root), st.st_size, max(0.0, now - st.st_mtime)))
        return out

    def remove_temp(self, temp: TempFile) -> None:
        path = (self.store.root / temp.name).resolve()
        if not path.name.startswith(_TEMP) or self.store.root.resolve() not in path.parents:
            raise StoreError(f"refusing to delete {path}: not a temp file of this store")
        path.unlink(missing_ok=True)

    def cap(self) -> dict[str, Any]:
        return {"max_bytes": self.store.max_bytes, "root": str(self.store.root)}


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
        pipe.execute_command("CLIENT", "NO-TOUCH", "ON")  # Redis 7.2+: our reads leave LRU/LFU alone; older: ignored
        return pipe

    def _run(self, pipe) -> list[Any]:
        try:
            return pipe.execute(raise_on_error=False)[1:]
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

    def verify(self, key: str) -> str | None:
        # Not RedisStore.get: that deletes a malformed manifest itself, which --dry-run must not.
        head = self.client.get(self.rs.RedisStore._name(key))
        if head is None:
            return None
        data = head
        if head.startswith(self.rs._MANIFEST):
            try:
                data = self.store._read_parts(key, *self.rs.parse_manifest(head, self.store.options.max_entry_bytes))
            except CorruptEntryError as exc:
                return f"corrupt: {exc}"
            if data is None:
                return "corrupt: a part of this split entry is missing"
        entry, _ = decode_fetched(data)
        if isinstance(entry, StaleEntryError):
            return f"stale: {entry}"
        if isinstance(entry, CorruptEntryError):
            return f"corrupt: {entry}"
        return None

    def links(self) -> list[Link]:
        out = []
        for uid, value in self.client.hgetall(self.rs._INDEX).items():
            user_id = uid.decode("utf-8", "surrogatepass") if isinstance(uid, bytes) else uid
            out.append(Link(user_id, self.rs.RedisStore._as_key(value), uid))
        return out

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


# -- memory (a fresh process: empty; useful from Python with a live store) ---------------------
class MemoryAdmin(StoreAdmin):
    kind = "memory"
    store: MemoryStore

    def entries(self) -> Iterator[EntryInfo]:
        for key, e in list(self.store._items.items()):
            yield EntryInfo(key, e.nbytes, None, dict(e.meta), None)

    def verify(self, key: str) -> str | None:
        return None  # kept decoded: nothing to check

    def links(self) -> list[Link]:
        return [Link(u, k, u) for u, k in list(self.store._index.items())]

    def unlink(self, links: Sequence[Link]) -> None:
        for lk in links:
            self.store._index.pop(lk.handle, None)

    def unlink_ids(self, user_ids: Sequence[str]) -> None:
        for u in user_ids:
            self.store._index.pop(str(u), None)

    def cap(self) -> dict[str, Any]:
        return {"max_bytes": self.store.max_bytes}


def _open_disk(url: str) -> DiskStore:
    """A disk store that does not clean its temp files on open (so stats can show them and gc
    --dry-run deletes nothing); same URL rules as open_store."""
    from kvrag import cache_backends as cb

    parsed = urlparse(url)
    q = parse_qs(parsed.query, keep_blank_values=True)
    cb._check_options("disk", url, q)
    path = (parsed.netloc + parsed.path) if parsed.netloc else parsed.path
    if not path:
        raise StoreError(f"disk store URL needs a path: {url!r} (e.g. disk:///var/cache/kvrag)")
    if not Path(path).expanduser().is_dir():
        raise StoreError(f"no store at {path}: the folder does not exist")
    cap = q.get("max_bytes", [""])[0].lower()
    max_bytes = None if cap == "none" else (cb._int(q, "max_bytes", url) if cap else DEFAULT_MAX_BYTES)
    return DiskStore(path, url=url, max_bytes=max_bytes, threads=1, clean_temp=False)


def open_admin(store: str | Any) -> StoreAdmin:
    """The admin view of a store URL (or an open store). Only disk, Redis and memory stores; a
    tiered URL is managed through its one disk or Redis tier."""
    if not isinstance(store, str):
        for cls, name in ((DiskStore, "disk"), (MemoryStore, "memory")):
            if isinstance(store, cls):
                return DiskAdmin(store) if name == "disk" else MemoryAdmin(store)
        if type(store).__name__ == "RedisStore":
            return RedisAdmin(store)
        raise StoreError(f"store management works on disk, redis and memory stores, not {type(store).__name__}")
    url = store
    scheme = urlparse(url).scheme.lower()
    if scheme == "tiered":
        lower = [u for u in tier_urls(url) if urlparse(u).scheme.lower() in ("disk", "redis", "rediss")]
        if len(lower) != 1:
            raise StoreError(f"{url!r} has {len(lower)} persistent tiers; run `kvrag store` on one of them: {', '.join(lower) or 'none'}")
        print(f"kvrag store: managing the persistent tier of the tiered store: {lower[0]}", file=sys.stderr)
        return open_admin(lower[0])
    if scheme == "disk":
        return DiskAdmin(_open_disk(url))
    if scheme in ("redis", "rediss"):
        return RedisAdmin(open_store(url))
    if scheme == "memory":
        return MemoryAdmin(open_store(url))
    raise StoreError(
        f"`kvrag store` manages disk://, redis:// (rediss://) and memory:// stores (tiered:// through its "
        f"disk or redis tier), not {scheme or 'this'}:// ({url!r})"
    )


# -- the operations -----------------------------------------------------------------------------
def _group(infos: Sequence[EntryInfo], field_name: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for e in infos:
        name = e.meta.get(field_name) or ("?" if e.problem is None else "(unreadable)")
        g = out.setdefault(name, {"entries": 0, "bytes": 0})
        g["entries"] += 1
        g["bytes"] += e.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes"]))


def store_stats(admin: StoreAdmin) -> dict[str, Any]:
    infos = list(admin.entries())
    ages = [e.age_s for e in infos if e.age_s is not None]
    temps = admin.temp_files()
    links = admin.links()
    return {
        "store": admin.url,
        "backend": admin.kind,
        "entries": len(infos),
        "bytes": sum(e.nbytes for e in infos),
        "tokens": sum(int(e.meta.get("tokens", 0) or 0) for e in infos if e.meta.get("tokens", "").isdigit()),
        "oldest_age_s": max(ages) if ages else None,
        "newest_age_s": min(ages) if ages else None,
        "by_model": _group(infos, "model"),
        "by_layout": _group(infos, "layout"),
        "by_kind": _group(infos, "kind"),
        "by_namespace": {namespace_of(m, lay): n for (m, lay), n in
                         Counter((e.meta["model"], e.meta["layout"]) for e in infos if "model" in e.meta and "layout" in e.meta).items()},
        "stale_entries": sum(1 for e in infos if e.problem and e.problem.startswith("stale")),
        "unreadable_entries": sum(1 for e in infos if e.problem and e.problem.startswith("corrupt")),
        "index_links": len(links),
        "temp_files": len(temps),
        "temp_bytes": sum(t.nbytes for t in temps),
        "cap": admin.cap(),
        "format": FORMAT_VERSION,
    }


def list_entries(admin: StoreAdmin, model: str | None = None, kind: str | None = None, limit: int | None = None,
                 sort: str = "age") -> list[dict[str, Any]]:
    """Entries (newest first by default), filtered by model fingerprint prefix and kind."""
    infos = [e for e in admin.entries()
             if (model is None or e.meta.get("model", "").startswith(model)) and (kind is None or e.meta.get("kind") == kind)]
    if sort == "bytes":
        infos.sort(key=lambda e: -e.nbytes)
    elif sort == "key":
        infos.sort(key=lambda e: e.key)
    else:
        infos.sort(key=lambda e: (e.age_s is None, e.age_s or 0.0))
    return [e.row() for e in (infos if limit is None else infos[:limit])]


def _namespaces(admin: StoreAdmin, infos: Sequence[EntryInfo] | None = None) -> set[str]:
    infos = list(admin.entries()) if infos is None else infos
    return {namespace_of(e.meta["model"], e.meta["layout"]) for e in infos if "model" in e.meta and "layout" in e.meta} | admin.index_namespaces()


def _resolve_keys(admin: StoreAdmin, keys: Sequence[str], infos: list[EntryInfo]) -> tuple[list[str], list[str]]:
    """Full keys for full keys or unique prefixes (8+ hex digits); and what matched nothing."""
    out, missing = [], []
    known = [e.key for e in infos]
    for k in keys:
        k = k.strip().lower()
        if len(k) < 8 or any(c not in "0123456789abcdef" for c in k):
            raise StoreError(f"{k!r} is not a store key: give a key, or a prefix of 8+ hex digits as `kvrag store ls` shows")
        hits = [x for x in known if x.startswith(k)]
        if len(hits) > 1:
            raise StoreError(f"key prefix {k!r} matches {len(hits)} entries: give more digits")
        (out if hits else missing).append(hits[0] if hits else k)
    return out, missing


def remove(admin: StoreAdmin, keys: Sequence[str] = (), ids: Sequence[str] = (), namespace: str | None = None,
           dry_run: bool = False) -> dict[str, Any]:
    """Delete entries by key (or unique key prefix) and/or chunk id, and the index links to them.

    An id is resolved as `<namespace>/<id>` under `namespace`, or under every namespace the store
    holds (each model and layout that wrote entries): the KV of that id for every model."""
    infos = list(admin.entries())
    full, missing = _resolve_keys(admin, keys, infos)
    namespaces = sorted({namespace} if namespace else _namespaces(admin, infos))
    removed_ids: list[dict[str, Any]] = []
    unknown_ids: list[str] = []
    for cid in ids:
        names = [f"{ns}/{cid}" for ns in namespaces]
        found = [(n, k) for n, k in zip(names, admin.resolve(names) if names else []) if k]
        if not found:
            unknown_ids.append(cid)
        for n, k in found:
            removed_ids.append({"id": cid, "namespace": n.split("/", 1)[0], "key": k, "entry": admin.exists(k)})
    targets = list(dict.fromkeys(full + [r["key"] for r in removed_ids if r["entry"]]))
    sizes = {e.key: e.nbytes for e in infos}
    if not dry_run:
        for k in targets:
            admin.delete(k)
        admin.unlink_ids([f"{r['namespace']}/{r['id']}" for r in removed_ids])
    return {
        "store": admin.url,
        "dry_run": dry_run,
        "entries_deleted": targets,
        "bytes_freed": sum(sizes.get(k, 0) for k in targets),
        "links_removed": [f"{r['namespace']}/{r['id']}" for r in removed_ids],
        "keys_not_found": missing,
        "ids_not_found": unknown_ids,
        "namespaces_searched": namespaces,
    }


def gc(admin: StoreAdmin, dry_run: bool = False, min_age_s: float = STALE_TEMP_S, verify: bool = True) -> dict[str, Any]:
    """Delete (or, dry run, list) what no reader can use: temp files / orphan parts older than
    `min_age_s` (dead writers), entries of an older format or failing their checksum (`verify`:
    every entry is read whole; otherwise only headers), and index links whose entry is gone
    (links younger than `min_age_s` are kept where the store can tell: an ingest links ids first
    and writes their entries next)."""
    temps = [t for t in admin.temp_files() if t.age_s >= min_age_s]
    infos = list(admin.entries())
    bad: list[dict[str, Any]] = []
    for e in infos:
        problem = e.problem or (admin.verify(e.key) if verify else None)
        if problem:
            bad.append({"key": e.key, "bytes": e.nbytes, "problem": problem})
    bad_keys = {b["key"] for b in bad}
    dangling = [lk for lk in admin.links()
                if (lk.age_s is None or lk.age_s >= min_age_s)
                and (lk.key is None or lk.key in bad_keys or not admin.exists(lk.key))]
    if not dry_run:
        for t in temps:
            admin.remove_temp(t)
        for b in bad:
            admin.delete(b["key"])
        admin.unlink(dangling)
    return {
        "store": admin.url,
        "dry_run": dry_run,
        "temp_files": [asdict(t) for t in temps],
        "bad_entries": bad,
        "dangling_links": [lk.name for lk in dangling],
        "bytes_freed": sum(t.nbytes for t in temps) + sum(b["bytes"] for b in bad),
        "entries_checked": len(infos),
        "verified": verify,
    }


# -- text output --------------------------------------------------------------------------------
def _size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= span:
            return f"{s / span:.1f}{unit}"
    return f"{s:.0f}s"


def format_stats(st: dict[str, Any]) -> str:
    cap = st["cap"]
    cap_text = ", ".join(f"{k}={_size(v) if k in ('max_bytes', 'maxmemory') else v}" for k, v in cap.items() if k != "root")
    lines = [
        f"store      {st['store']} ({st['backend']})",
        f"entries    {st['entries']}  ({_size(st['bytes'])}, {st['tokens']} tokens; format {st['format']})",
        f"age        oldest {_age(st['oldest_age_s'])}, newest {_age(st['newest_age_s'])} (since last write or read)",
        f"cap        {cap_text or '-'}",
        f"index      {st['index_links']} id links; namespaces: {', '.join(sorted(st['by_namespace'])) or '-'}",
        f"temp       {st['temp_files']} ({_size(st['temp_bytes'])})",
    ]
    if st["stale_entries"] or st["unreadable_entries"]:
        lines.append(f"problems   {st['stale_entries']} of an older format, {st['unreadable_entries']} unreadable: `kvrag store gc` removes them")
    for title, name in (("by model", "by_model"), ("by layout", "by_layout"), ("by kind", "by_kind")):
        lines.append(f"{title}:")
        for value, g in st[name].items():
            lines.append(f"  {value[:16]:16s}  {g['entries']:6d} entries  {_size(g['bytes']):>10s}")
    return "\n".join(lines)


def format_ls(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'key':16s}  {'kind':10s}  {'tokens':>6s}  {'bytes':>10s}  {'age':>6s}  model"]
    for r in rows:
        m = r["meta"]
        kind = m.get("kind", "?") if not r["problem"] else r["problem"].split(":")[0]
        lines.append(f"{r['key'][:16]:16s}  {kind:10s}  {m.get('tokens', '-'):>6s}  {_size(r['nbytes']):>10s}  "
                     f"{_age(r['age_s']):>6s}  {m.get('model', '-')[:12]}")
    return "\n".join(lines)


# -- the CLI ------------------------------------------------------------------------------------
def _default_store() -> str:
    from kvrag.model import kvrag_home

    return os.environ.get("KVRAG_STORE") or f"disk://{kvrag_home() / 'kv'}"


def _nonneg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _limit(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def add_store_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`kvrag store stats|ls|rm|gc` on the given subparsers (of the `kvrag` parser)."""
    class Fmt(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """Defaults in every --help, and the epilog's examples one per line."""

    store = subparsers.add_parser(
        "store", help="inspect and tidy the KV store: stats, ls, rm, gc", formatter_class=Fmt,
        description="Inspect and tidy a KV store (disk:// or redis://; a tiered:// URL through its disk or Redis tier) "
                    "without loading a model.",
        epilog="examples:\n  kvrag store stats\n  kvrag store ls --kind chunk --limit 20\n"
               "  kvrag store rm --document notes.md\n  kvrag store gc --dry-run",
    )
    sub = store.add_subparsers(dest="store_command", required=True, metavar="{stats,ls,rm,gc}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", default=_default_store(), help="store URL ($KVRAG_STORE, else disk under $KVRAG_HOME/kv)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    st = sub.add_parser("stats", help="entries, bytes, ages, per model / layout / kind, cap, temp files", formatter_class=Fmt,
                        epilog="example: kvrag store stats --store redis://127.0.0.1:6379/0 --json")
    common(st)

    ls = sub.add_parser("ls", help="one line per entry (headers only, no tensor is read)", formatter_class=Fmt,
                        epilog="example: kvrag store ls --model 3fa2c1 --kind chunk --limit 20")
    common(ls)
    ls.add_argument("--model", default=None, help="only entries whose model fingerprint starts with this")
    ls.add_argument("--kind", default=None, choices=("chunk", "similarity", "prefix"), help="only entries of this kind")
    ls.add_argument("--limit", type=_limit, default=None, help="at most this many lines")
    ls.add_argument("--sort", default="age", choices=("age", "bytes", "key"), help="age: most recently used first")

    rm = sub.add_parser("rm", help="delete entries by key, by chunk id or by document (KV and index links only)", formatter_class=Fmt,
                        epilog="examples:\n  kvrag store rm 3fa2c1d0e4b5\n  kvrag store rm --id 9f2c41d07be35a18 --id my-node-id\n"
                               "  kvrag store rm --document notes.md --dry-run\n"
                               "`kvrag remove PATH` also removes a document's chunks from the retrieval index.")
    common(rm)
    rm.add_argument("keys", nargs="*", metavar="KEY", help="store keys, or unique prefixes of 8+ hex digits (as `ls` shows)")
    rm.add_argument("--id", dest="ids", action="append", default=[], metavar="ID", help="a chunk id (repeatable)")
    rm.add_argument("--document", action="append", default=[], metavar="PATH",
                    help="every chunk whose source is PATH in the retrieval index, as given to `kvrag ingest` (repeatable)")
    rm.add_argument("--namespace", default=None,
                    help="resolve ids in this namespace only (none: under every model and layout that wrote to the store)")
    rm.add_argument("--collection", default="kvrag_chunks", help="chroma collection under $KVRAG_HOME/chroma (for --document)")
    rm.add_argument("--dry-run", action="store_true", help="only list what would be deleted")

    g = sub.add_parser("gc", help="delete dead writers' temp files, corrupt or old-format entries, and dangling index links",
                       formatter_class=Fmt, epilog="example: kvrag store gc --dry-run")
    common(g)
    g.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    g.add_argument("--min-age", type=_nonneg, default=STALE_TEMP_S,
                   help="seconds: younger temp files (writers still running) and index links are kept")
    g.add_argument("--headers-only", action="store_true", help="skip reading every entry whole to verify its checksum")
    return store


def _document_ids(paths: Sequence[str], collection: str) -> tuple[list[str], dict[str, int]]:
    from kvrag.model import kvrag_home
    from kvrag.retrieval import ChunkIndex

    index = ChunkIndex(kvrag_home() / "chroma", collection=collection)
    ids: list[str] = []
    per: dict[str, int] = {}
    for p in paths:
        found = [c.id for c in index.by_source(str(p))]
        per[str(p)] = len(found)
        ids.extend(found)
    return ids, per


def cmd_store(args: argparse.Namespace) -> int:
    admin = open_admin(args.store)
    out = sys.stdout
    if args.store_command == "stats":
        st = store_stats(admin)
        print(json.dumps(st) if args.json else format_stats(st), file=out)
        return 0
    if args.store_command == "ls":
        rows = list_entries(admin, model=args.model, kind=args.kind, limit=args.limit, sort=args.sort)
        print(json.dumps(rows) if args.json else format_ls(rows), file=out)
        return 0
    if args.store_command == "rm":
        ids = list(args.ids)
        per_doc: dict[str, int] = {}
        if args.document:
            doc_ids, per_doc = _document_ids(args.document, args.collection)
            ids += doc_ids
        if not (args.keys or ids or args.document):
            raise KVRagError("give store keys, --id ID or --document PATH")
        res = remove(admin, keys=args.keys, ids=ids, namespace=args.namespace, dry_run=args.dry_run)
        res["documents"] = per_doc
        if args.json:
            print(json.dumps(res), file=out)
        else:
            verb = "would delete" if args.dry_run else "deleted"
            print(f"{verb} {len(res['entries_deleted'])} entries ({_size(res['bytes_freed'])}) and "
                  f"{len(res['links_removed'])} index links from {res['store']}", file=out)
            for k in res["entries_deleted"]:
                print(f"  entry {k}", file=out)
            for n in res["links_removed"]:
                print(f"  link  {n}", file=out)
            for p, n in per_doc.items():
                print(f"{p}: {n} chunks in the retrieval index" + ("" if n else " (give the path as given to `kvrag ingest`)"), file=out)
            if res["keys_not_found"] or res["ids_not_found"]:
                print(f"not found: {', '.join(res['keys_not_found'] + res['ids_not_found'])}", file=sys.stderr)
            if per_doc:
                print("the chunks stay in the retrieval index: `kvrag remove PATH` removes them there too "
                      "(and their KV, which is then recomputed if asked)", file=sys.stderr)
        return 0 if (res["entries_deleted"] or res["links_removed"]) else 1
    if args.store_command == "gc":
        res = gc(admin, dry_run=args.dry_run, min_age_s=args.min_age, verify=not args.headers_only)
        if args.json:
            print(json.dumps(res), file=out)
        else:
            verb = "would delete" if args.dry_run else "deleted"
            print(f"{verb} {len(res['temp_files'])} temp files, {len(res['bad_entries'])} bad entries "
                  f"({_size(res['bytes_freed'])} in all) and {len(res['dangling_links'])} dangling index links "
                  f"from {res['store']} ({res['entries_checked']} entries checked)", file=out)
            for t in res["temp_files"]:
                print(f"  temp  {t['name']}  {_size(t['nbytes'])}, {_age(t['age_s'])} old", file=out)
            for b in res["bad_entries"]:
                print(f"  entry {b['key']}  {b['problem']}", file=out)
            for n in res["dangling_links"]:
                print(f"  link  {n}", file=out)
        return 0
    raise KVRagError(f"unknown store command {args.store_command!r}")  # pragma: no cover - argparse refuses it
