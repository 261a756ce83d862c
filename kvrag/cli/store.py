"""`kvrag store stats|ls|rm|gc|sign`: the parser and the command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence


from kvrag.cli.args import HelpFormatter, nonneg_float, positive_int
from kvrag.defaults import STALE_TEMP_S
from kvrag.errors import KVRagError




# -- the CLI ------------------------------------------------------------------------------------
def _default_store() -> str:
    from kvrag.defaults import kvrag_home

    from kvrag.defaults import DEFAULT_DISK_PRECISION  # the string of cache_backends.default_disk_url, without torch

    return os.environ.get("KVRAG_STORE") or f"disk://{(kvrag_home() / 'kv').expanduser().absolute()}?quantize={DEFAULT_DISK_PRECISION}"


def add_store_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`kvrag store stats|ls|rm|gc` on the given subparsers (of the `kvrag` parser)."""
    Fmt = HelpFormatter
    store = subparsers.add_parser(
        "store", help="inspect and tidy the KV store: stats, ls, rm, gc", formatter_class=Fmt,
        description="Inspect and tidy a KV store (disk:// or redis://; a tiered:// URL through its disk or Redis tier) "
                    "without loading a model.",
        epilog="examples:\n  kvrag store stats\n  kvrag store ls --kind chunk --limit 20\n"
               "  kvrag store rm --document notes.md\n  kvrag store gc --dry-run\n  KVRAG_STORE_KEY=... kvrag store sign",
    )
    sub = store.add_subparsers(dest="store_command", required=True, metavar="{stats,ls,rm,gc,sign}")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", default=_default_store(), help="store URL ($KVRAG_STORE, else disk under $KVRAG_HOME/kv)")
        p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    st = sub.add_parser("stats", help="entries, bytes, ages, per model / layout / kind, cap, temp files", formatter_class=Fmt,
                        epilog="example: kvrag store stats --store redis://127.0.0.1:6379/0 --json")
    common(st)
    st.add_argument("--project", nargs="+", default=None, metavar="PATH",
                    help="also project the KV these files or folders will take once ingested, at each storage precision "
                         "(chunked and tokenised as `kvrag ingest` does; the model's configuration only, no weights)")
    st.add_argument("--model", default=os.environ.get("KVRAG_MODEL"),
                    help="with --project: HF model id, folder or .gguf (default: $KVRAG_MODEL, else the bundled SmolLM2)")

    ls = sub.add_parser("ls", help="one line per entry, with its chunk id and document (headers only, no tensor is read)",
                        formatter_class=Fmt,
                        epilog="example: kvrag store ls --model 3fa2c1 --kind chunk --limit 20")
    common(ls)
    ls.add_argument("--model", default=None, help="only entries whose model fingerprint starts with this")
    ls.add_argument("--kind", default=None, choices=("chunk", "similarity", "prefix"), help="only entries of this kind")
    ls.add_argument("--limit", type=positive_int, default=None, help="at most this many lines")
    ls.add_argument("--sort", default="age", choices=("age", "bytes", "key"), help="age: most recently used first")
    ls.add_argument("--collection", default="kvrag_chunks",
                    help="the retrieval index's collection whose chunk ids and documents label the entries "
                         "($KVRAG_INDEX, else under $KVRAG_HOME/chroma)")

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
    g.add_argument("--min-age", type=nonneg_float, default=STALE_TEMP_S,
                   help="seconds: younger temp files (writers still running) and index links are kept")
    g.add_argument("--headers-only", action="store_true", help="skip reading every entry whole to verify its checksum")
    g.add_argument("--unverified", action="store_true",
                   help="with $KVRAG_STORE_KEY: also delete the sound entries and id links written without the key, which "
                        "are otherwise kept and listed (those signed with another key too only with --include-foreign)")
    g.add_argument("--include-foreign", action="store_true",
                   help="with --unverified: also delete entries and id links signed with another key (another replica's "
                        "genuine data: kept by default)")

    sg = sub.add_parser("sign", help="sign with $KVRAG_STORE_KEY a store written without it (entries and id links)",
                        formatter_class=Fmt, epilog="example: KVRAG_STORE_KEY=... kvrag store sign --dry-run")
    common(sg)
    sg.add_argument("--dry-run", action="store_true", help="only list what would be signed")
    sg.add_argument("--include-foreign", action="store_true",
                    help="also re-sign entries and links signed with another key (e.g. a replica configured with another key)")
    store.set_defaults(func=cmd_store)
    return store


def _document_ids(paths: Sequence[str], collection: str) -> tuple[list[str], dict[str, int]]:
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import ChunkIndex

    index = ChunkIndex(kvrag_home() / "chroma", collection=collection)
    ids: list[str] = []
    per: dict[str, int] = {}
    for p in paths:
        found = [c.id for c in index.by_source(str(p))]
        per[str(p)] = len(found)
        ids.extend(found)
    return ids, per


def _precision_of(url: str) -> str | None:
    """The storage precision a disk:// or redis:// URL asks for (None for a tiered one: per tier)."""
    from urllib.parse import parse_qs, urlparse

    from kvrag.cache_backends.format import storage_of

    parsed = urlparse(url)
    if parsed.scheme == "tiered":
        return None
    try:
        return storage_of(parse_qs(parsed.query).get("quantize", ["none"])[0])
    except ValueError:
        return None


def cmd_store(args: argparse.Namespace) -> int:
    """`kvrag store ...`; a store that cannot be reached or refuses (a Redis db out of range, a
    password it rejects) is a one-line error, not a traceback."""
    try:
        return _store_command(args)
    except Exception as exc:  # noqa: BLE001 - narrowed below: only the store's own failures become one line
        if not _is_store_failure(exc):
            raise
        from kvrag.cache_backends.tiered import redact_tiers

        where = redact_tiers(args.store) if args.store else "(default)"
        raise KVRagError(f"store {where}: {type(exc).__name__}: {exc}") from None


def _is_store_failure(exc: BaseException) -> bool:
    """A failure of the store's client library; StoreError is a KVRagError already (one line as it is)."""
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    try:
        from redis.exceptions import RedisError
    except ImportError:  # pragma: no cover - no redis client: no Redis store either
        return False
    return isinstance(exc, RedisError)


def _store_command(args: argparse.Namespace) -> int:
    from kvrag.cache_backends.admin.opening import open_admin  # the store (and torch) only once a command runs
    from kvrag.cache_backends.admin.operations import _age, _size, format_ls, format_stats, gc, list_entries, remove, store_stats

    admin = open_admin(args.store)
    out = sys.stdout
    if args.store_command == "stats":
        st = store_stats(admin)
        if args.project:
            from kvrag.kv.projection import format_projection, project

            projection = project(args.project, args.model)
            st["projection"] = projection.as_dict()
            if not args.json:
                print(format_projection(projection, _precision_of(args.store)), file=out)
        print(json.dumps(st) if args.json else format_stats(st), file=out)
        return 0
    if args.store_command == "ls":
        from kvrag.cli.store_names import format_named, label_rows

        rows = label_rows(admin, list_entries(admin, model=args.model, kind=args.kind, limit=args.limit, sort=args.sort),
                          args.collection)
        print(json.dumps(rows) if args.json else format_named(format_ls(rows), rows), file=out)
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
        if args.include_foreign and not args.unverified:
            raise KVRagError("--include-foreign widens --unverified: give both")
        res = gc(admin, dry_run=args.dry_run, min_age_s=args.min_age, verify=not args.headers_only, unverified=args.unverified,
                 include_foreign=args.include_foreign)
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
            for n in res["symlinked_folders"]:
                print(f"  link  {n} (a symlinked shard folder: the link only)", file=out)
            if res["unverified_kept"] or res["unverified_links_kept"]:
                print(f"kept {len(res['unverified_kept'])} entries and {len(res['unverified_links_kept'])} id links the store key "
                      "cannot verify (sound, written without the key or with another): `kvrag store sign` re-signs them, "
                      "`kvrag store gc --unverified` deletes those written without a key (--include-foreign: with another too)",
                      file=out)
        return 0
    if args.store_command == "sign":
        from kvrag.cache_backends.admin.signing import sign

        res = sign(admin, include_foreign=args.include_foreign, dry_run=args.dry_run)
        if args.json:
            print(json.dumps(res), file=out)
        else:
            verb = "would sign" if args.dry_run else "signed"
            print(f"{verb} {len(res['entries_signed'])} entries and {len(res['links_signed'])} id links in {res['store']}", file=out)
            for b in res["entries_left"]:
                print(f"  left  entry {b['key']}  {b['problem']}", file=out)
            for n in res["links_left"]:
                print(f"  left  link  {n}  signed with another key (--include-foreign signs it)", file=out)
        return 0
    raise KVRagError(f"unknown store command {args.store_command!r}")  # pragma: no cover - argparse refuses it
