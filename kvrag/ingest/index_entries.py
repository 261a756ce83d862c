"""The retrieval index's collection and entries as Chroma keeps them: opening a collection with its embedding model
checked, and finding which chunks are not in it as they are (kvrag.ingest.retrieval.ChunkIndex uses both)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvrag.ingest.index_trust import VECTOR_FIELD, VECTOR_MAC_FIELD, vector_verdict
from kvrag.ingest.index_url import EmbeddingMismatchError, unavailable_as
from kvrag.types import Chunk

EMBEDDING_KEY = "kvrag_embedding"  # collection metadata: the model its vectors came from
EMBEDDING = "all-MiniLM-L6-v2/384/normalized"  # this build's embedding model, as the collection records it


def open_collection(client: Any, name: str, path: str, function: Any) -> Any:
    """The collection `name` (made where missing) whose vectors are this build's embedding model's; one made by an
    older kvrag has it recorded now; another model's is EmbeddingMismatchError (their vectors do not compare)."""
    with unavailable_as(path):
        coll = client.get_or_create_collection(name=name, embedding_function=function, metadata={EMBEDDING_KEY: EMBEDDING},
                                               configuration={"hnsw": {"space": "cosine"}})
        recorded = (coll.metadata or {}).get(EMBEDDING_KEY)
        if recorded is None:  # made by an older kvrag (the same model): record it now
            coll.modify(metadata={**(coll.metadata or {}), EMBEDDING_KEY: EMBEDDING})
        elif recorded != EMBEDDING:
            raise EmbeddingMismatchError(
                f"the index {path} holds vectors of the embedding model {recorded!r}, and this kvrag embeds with "
                f"{EMBEDDING!r}: their vectors do not compare. Use another collection (--index .../NAME), or re-ingest "
                "into a fresh one with one embedding model for every replica")
    return coll


def _rows(values: Any, n: int) -> list[Any]:
    return [None] * n if values is None else list(values)


def changed_entries(run: Callable[[Callable[[Any], Any]], Any], key: Any, items: list[Chunk], batch_size: int,
                    metadata: Callable[[Chunk], dict[str, Any]]) -> list[Chunk]:
    """Those of `items` not in the index as they are (text and `metadata(chunk)`, title included); with a key, an
    entry whose vector is unsigned or moved counts as changed (written whole again, signed). `run(op)` runs
    `op(collection)` as the index does (bounded, transport errors as IndexUnavailableError)."""
    stored: dict[str, tuple[Any, Any]] = {}
    include = ["documents", "metadatas", "embeddings"] if key else ["documents", "metadatas"]
    for start in range(0, len(items), batch_size):
        ids = [c.id for c in items[start : start + batch_size]]
        result = run(lambda coll: coll.get(ids=ids, include=include))
        docs = result.get("documents") or [None] * len(result["ids"])
        metas = result.get("metadatas") or [None] * len(result["ids"])
        vecs = _rows(result.get("embeddings"), len(result["ids"]))
        for i, d, m, v in zip(result["ids"], docs, metas, vecs):
            m = dict(m or {})
            if vector_verdict(key, m, v) != "ok":
                continue
            m.pop(VECTOR_FIELD, None)
            m.pop(VECTOR_MAC_FIELD, None)
            stored[i] = (d, m)
    return [c for c in items if stored.get(c.id) != (c.text, metadata(c))]
