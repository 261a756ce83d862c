"""`kvrag store ls`: which chunk and which document each entry holds (issue 70, item 6).

A store entry is named by a content hash; what a user knows is the chunk id and the file it came from. Both live
elsewhere: the ids in the store's id index (`<namespace>/<id>` -> entry key, the namespace being the writer's model
and layout), the documents in the retrieval index. So the retrieval index's ids are resolved through the store's id
index, under the namespace of every entry listed, and each entry found is labelled with its id and document.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

PAGE = 5000  # index rows read per call
RESOLVE_BATCH = 1000  # id names resolved per call to the store


def indexed_sources(collection: str) -> dict[str, str]:
    """Chunk id -> document (the path given to `kvrag ingest`) for every chunk in the retrieval index that
    `kvrag ingest` fills ($KVRAG_INDEX, else $KVRAG_HOME/chroma); {} when there is none yet (nothing is created)."""
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import ChunkIndex

    url = os.environ.get("KVRAG_INDEX") or None
    if url is None and not (kvrag_home() / "chroma").exists():
        return {}
    index = ChunkIndex(url=url, collection=collection) if url else ChunkIndex(kvrag_home() / "chroma", collection=collection)
    out: dict[str, str] = {}
    offset = 0
    while True:
        page = index._run(lambda coll: coll.get(include=["metadatas"], limit=PAGE, offset=offset))  # noqa: B023
        ids = page.get("ids") or []
        metas = page.get("metadatas") or [None] * len(ids)
        for cid, meta in zip(ids, metas):
            out[cid] = str((meta or {}).get("source") or "-")
        if len(ids) < PAGE:
            return out
        offset += PAGE


def entry_names(admin: Any, rows: Sequence[dict[str, Any]], sources: dict[str, str]) -> dict[str, tuple[str, str]]:
    """Entry key -> (chunk id, document), for the listed rows whose entry an indexed id resolves to."""
    from kvrag.cache_backends.admin.base import namespace_of

    wanted = {r["key"] for r in rows}
    namespaces = sorted({namespace_of(r["meta"]["model"], r["meta"]["layout"]) for r in rows
                         if "model" in r.get("meta", {}) and "layout" in r.get("meta", {})})
    ids = list(sources)
    found: dict[str, tuple[str, str]] = {}
    for ns in namespaces:
        for start in range(0, len(ids), RESOLVE_BATCH):
            batch = ids[start:start + RESOLVE_BATCH]
            for cid, key in zip(batch, admin.resolve([f"{ns}/{cid}" for cid in batch])):
                if key and key in wanted and key not in found:
                    found[key] = (cid, sources[cid])
    return found


def label_rows(admin: Any, rows: list[dict[str, Any]], collection: str) -> list[dict[str, Any]]:
    """The rows with `id` and `document` added (None where no indexed chunk resolves to the entry: a prefix or
    similarity entry, a chunk added through the API with no document, or one since removed from the index).
    An index that cannot be read is said on stderr; the listing goes on without names."""
    try:
        names = entry_names(admin, rows, indexed_sources(collection)) if rows else {}
    except Exception as exc:  # noqa: BLE001 - the names are extra: the listing itself must not fail on them
        print(f"kvrag: note: chunk ids and documents not shown: the retrieval index could not be read "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        names = {}
    for r in rows:
        r["id"], r["document"] = names.get(r["key"], (None, None))
    return rows


def format_named(table: str, rows: Sequence[dict[str, Any]]) -> str:
    """`format_ls`'s table with two columns more: the chunk id and its document."""
    lines = table.split("\n")
    width = max([len(lines[0])] + [len(line) for line in lines[1:]])
    out = [f"{lines[0]:{width}s}  {'chunk id':18s}  document"]
    for line, r in zip(lines[1:], rows):
        out.append(f"{line:{width}s}  {(r.get('id') or '-')[:18]:18s}  {r.get('document') or '-'}")
    return "\n".join(out)
