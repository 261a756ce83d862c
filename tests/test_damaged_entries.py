"""A damaged or lost KV entry is a miss recomputed from the index's text, never an unknown id.

A newcomer's truncated `.kv` entry made the next question by id fail with `ChunkNotFoundError: unknown chunk
id(s)` (and the entry was deleted), though the id and its text were still in the index `kvrag ingest` fills.
After a Redis FLUSHALL the replica that ingested an id answered it while the other said chunk_not_found.
Now the text is read back from the index (only when it hashes to the entry the id is linked to), the log
names the entry, the answer comes, and the id answers again from its stored KV.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvrag import KVRag
from kvrag.errors import ChunkNotFoundError
from kvrag.ingest.retrieval import ChunkIndex
from kvrag.types import Chunk
from test_server import tiny_rag
from tiny import THREE_CHUNKS, THREE_Q


def _entry_file(rag: KVRag, root: Path, chunk: Chunk) -> Path:
    key = rag.repo.key("chunk", rag.repo.layout.chunk_ids(chunk))
    [path] = list(root.rglob(f"{key}*.kv"))
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def damaged(tmp_path, monkeypatch):
    """Chunks ingested as `kvrag ingest` does (the default index under $KVRAG_HOME and a disk store), then
    chunk "a"'s entry truncated; a fresh engine (another process) over the same store."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    ChunkIndex(tmp_path / "home" / "chroma").add(THREE_CHUNKS)
    store = f"disk://{tmp_path / 'kv'}"
    first = tiny_rag(store)
    first.precompute(THREE_CHUNKS, progress=False)
    path = _entry_file(first, tmp_path / "kv", THREE_CHUNKS[0])
    _truncate(path)
    return KVRag(first.lm, store=store), path


def test_a_truncated_entry_is_recomputed_from_the_default_index_and_the_id_stays_answerable(damaged, caplog):
    rag, path = damaged
    with caplog.at_level(logging.WARNING):
        out = rag.answer(THREE_Q, chunk_ids=["a", "b"], max_new_tokens=2)
    assert out.stats.cache_misses == 1 and out.stats.cache_hits == 1  # "a" recomputed, "b" from the store
    assert any("'a'" in r.getMessage() and path.name[:12] in r.getMessage() for r in caplog.records), caplog.text
    again = KVRag(rag.lm, store=rag.store).answer(THREE_Q, chunk_ids=["a"], max_new_tokens=2)  # another process, later
    assert again.stats.cache_hits == 1 and again.stats.cache_misses == 0 and again.text == rag.answer(THREE_Q, chunk_ids=["a"], max_new_tokens=2).text


def test_without_an_index_the_error_says_the_entry_is_damaged_not_that_the_id_is_unknown(damaged):
    rag, _ = damaged
    rag.recover_from(None)
    with pytest.raises(ChunkNotFoundError, match="damaged or gone"):
        rag.answer(THREE_Q, chunk_ids=["a"], max_new_tokens=2)


def test_an_index_text_that_is_not_the_linked_one_is_never_answered(damaged, caplog):
    rag, _ = damaged
    rag.recover_from(lambda ids: [Chunk("a", "The cat was never on any mat at all.")])
    with caplog.at_level(logging.WARNING), pytest.raises(ChunkNotFoundError):
        rag.answer(THREE_Q, chunk_ids=["a"], max_new_tokens=2)
    assert "not the text the store linked" in caplog.text


# -- two replicas after the store lost its id index ----------------------------------------------------
@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two `kvrag serve` over one Redis and one `chroma run` (tests/test_replicas.py's), and the Redis."""
    from chroma_server import ChromaServer
    from test_backends import REDIS, RedisServer
    from test_replicas import Replica

    if REDIS is None:
        pytest.skip("redis-server is not installed")
    root = tmp_path_factory.mktemp("lost-links")
    chroma, redis = ChromaServer(root / "chroma").start(), RedisServer()
    redis.start()
    both = [Replica(redis.url, chroma.url(), root / f"home{i}") for i in range(2)]
    try:
        for r in both:
            r.wait()
        yield both, redis
    finally:
        for r in both:
            r.stop()
        chroma.stop()
        redis.stop()


def test_both_replicas_answer_an_id_after_the_store_lost_its_links(replicas):
    from kvrag.cache_backends.redis_store import RedisStore
    from test_replicas import _by_id

    (a, b), redis = replicas
    plum = {"id": "plum", "text": "Plum trees flower early in spring.", "title": "Plums"}
    assert a.http("POST", "/v1/chunks", json={"chunks": [plum]}).status_code == 200
    RedisStore(redis.url, key="").client.flushall()  # links and entries gone; the index still holds the chunk
    answers = []
    for replica in (a, b, b, a):
        r = _by_id(replica, "plum")
        assert r.status_code == 200, r.text
        answers.append(r.json()["usage"]["prompt_tokens"])
    assert len(set(answers)) == 1
    assert _by_id(a, "plum").json()["kvrag_stats"]["cache_hits"] == 1  # recomputed once, stored again, linked again
