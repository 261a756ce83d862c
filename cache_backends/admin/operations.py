"""stats, ls, rm and gc over any store admin, and their text output."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any, Sequence


from kvrag.cache_backends import StoreError
from kvrag.cache_backends.disk import STALE_TEMP_S
from kvrag.cache_backends.format import FORMAT_VERSION
from kvrag.cache_backends.admin.base import EntryInfo, StoreAdmin, namespace_of



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
        "keyed": admin.mac_key is not None,
        # with a store key: entries whose header carries no MAC (written without the key; headers only,
        # so an entry of another key is found by `gc`, which reads each whole)
        "unsigned_entries": sum(1 for e in infos if e.problem is None and "mac" not in e.meta) if admin.mac_key is not None else 0,
        "unverified_links": sum(1 for lk in links if lk.unverified),
        "bad_links": sum(1 for lk in links if lk.bad),
        "foreign_folders": len(getattr(admin, "foreign_folders", list)()),
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


def gc(admin: StoreAdmin, dry_run: bool = False, min_age_s: float = STALE_TEMP_S, verify: bool = True,
       unverified: bool = False, include_foreign: bool = False) -> dict[str, Any]:
    """Delete (or, dry run, list) what no reader can use: temp files / orphan parts older than
    `min_age_s` (dead writers), entries of an older format or failing their checksum (`verify`:
    every entry is read whole; otherwise only headers), index links whose entry is gone (links
    younger than `min_age_s` are kept where the store can tell: an ingest links ids first and writes
    their entries next), and whatever stands where a ref should be and is none (a FIFO, a symlink, a
    device, an oversized file, a symlinked shard folder: the link, never its target).

    With a store key, entries and refs the key cannot verify but whose checksum is sound (written
    without the key, or with another) are someone's data: listed, and deleted only with `unverified`;
    those signed with another key (a replica with its own key: genuine data) only with `include_foreign`
    too, as `kvrag store sign` re-signs them."""
    temps = [t for t in admin.temp_files() if t.age_s >= min_age_s]
    infos = list(admin.entries())
    bad: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    for e in infos:
        problem = e.problem or (admin.verify(e.key) if verify else None)
        if problem and problem.startswith("unverified"):
            delete = unverified and (include_foreign or "mac" not in e.meta)
            (bad if delete else kept).append({"key": e.key, "bytes": e.nbytes, "problem": problem})
        elif problem:
            bad.append({"key": e.key, "bytes": e.nbytes, "problem": problem})
    bad_keys = {b["key"] for b in bad}
    links = admin.links()
    dangling = [lk for lk in links
                if lk.bad or ((lk.age_s is None or lk.age_s >= min_age_s) and (lk.key in bad_keys or not admin.exists(lk.key)))
                or (unverified and lk.unverified and (include_foreign or lk.status != "mismatch"))]  # fmt: skip
    gone = {id(lk) for lk in dangling}
    kept_links = [lk for lk in links if lk.unverified and id(lk) not in gone]
    folders = getattr(admin, "foreign_folders", list)()
    if not dry_run:
        for t in temps:
            admin.remove_temp(t)
        for b in bad:
            admin.delete(b["key"])
        admin.unlink(dangling)
        for f in folders:
            admin.remove_folder_link(f)  # type: ignore[attr-defined]
    return {
        "store": admin.url,
        "dry_run": dry_run,
        "temp_files": [asdict(t) for t in temps],
        "bad_entries": bad,
        "dangling_links": [lk.name for lk in dangling],
        "symlinked_folders": folders,
        "unverified_kept": kept,
        "unverified_links_kept": [lk.name for lk in kept_links],
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
    if st.get("bad_links") or st.get("foreign_folders"):
        lines.append(f"problems   {st['bad_links']} index files that are no ref (FIFO, symlink, device, oversized), "
                     f"{st['foreign_folders']} symlinked shard folders: `kvrag store gc` removes them (links only)")
    if st.get("unsigned_entries") or st.get("unverified_links"):
        lines.append(f"unverified {st['unsigned_entries']} entries without a MAC, {st['unverified_links']} id links the store key "
                     "cannot verify: misses for a keyed reader, kept; `kvrag store sign` re-signs them, "
                     "`kvrag store gc --unverified` removes them")
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
