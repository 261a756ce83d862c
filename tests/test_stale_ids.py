"""An id another process rebinds or removes is seen at once by a process that holds it in its own table
(kvrag.kv.registry: `ChunkRegistry._still_bound`). Two engines over one store stand for two replicas over one
Redis (or `kvrag ingest` and `kvrag serve` over one disk store): real stores, a tiny model. The two-process
version, over a real Redis and chroma, is in test_replicas.py."""

from __future__ import annotations

import threading
import time

import pytest

import httpx

from kvrag import Chunk, KVRag, from_model
from kvrag.cache_backends.memory import MemoryStore
from kvrag.errors import ChunkNotFoundError
from kvrag.kv.registry import removed_ids_by
from kvrag.server import create_app
from test_backends import RedisServer, needs_redis
from test_server import SETTINGS, LiveServer
from tiny import tiny_model, tiny_tokenizer

OLD = Chunk("kiwi", "Kiwis are flightless birds.", title="Kiwis")
NEW = Chunk("kiwi", "Kiwi fruit grows on woody vines and has a fuzzy brown skin.", title="Kiwis")


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_model("llama"), tiny_tokenizer())


def two(lm, store) -> tuple[KVRag, KVRag]:
    """Two engines, one store: what each registers is its own table, what the store links is shared."""
    return KVRag(lm, store=store), KVRag(lm, store=store)


def tokens(rag: KVRag, chunk_id: str) -> list[int]:
    return rag.repo.lookup([chunk_id], None).token_ids[0]


def test_an_id_rebound_elsewhere_is_answered_from_the_new_text(lm):
    a, b = two(lm, MemoryStore())
    b.precompute([OLD], progress=False)
    assert tokens(b, "kiwi") == b.layout.chunk_ids(OLD)
    a.precompute([NEW], progress=False)  # "kiwi" now names other text, for every process sharing the store
    assert tokens(b, "kiwi") == a.layout.chunk_ids(NEW)
    assert "kiwi" not in b.repo.chunks  # its old text is gone from b's table, not merely bypassed once
    assert b.answer("What is it?", chunk_ids=["kiwi"], max_new_tokens=1).stats.cache_hits == 1  # a's KV of the new text


def test_an_id_removed_elsewhere_is_not_found_where_the_judge_says_removed(lm):
    a, b = two(lm, MemoryStore())
    fig = Chunk("fig", "Fig trees are pollinated by tiny wasps.")
    b.precompute([fig], progress=False)
    a.repo.forget_report(a.repo.lookup(["fig"], None))  # what DELETE /v1/chunks/fig does on another replica
    with removed_ids_by(lambda ids: []):  # the judge says it survived (a store that lost its id index)
        assert tokens(b, "fig") == b.layout.chunk_ids(fig)
    with removed_ids_by(lambda ids: ids), pytest.raises(ChunkNotFoundError):  # the judge says deleted (the server's)
        b.answer("What is it?", chunk_ids=["fig"], max_new_tokens=1)
    assert "fig" not in b.repo.chunks
    b.precompute([fig], progress=False)  # ingested again: answered again, by both
    assert tokens(a, "fig") == tokens(b, "fig") == b.layout.chunk_ids(fig)


def test_a_lookup_beside_replaces_sees_one_text_or_the_other_and_the_last_once_done(lm):
    a, b = two(lm, MemoryStore())
    b.precompute([OLD], progress=False)
    texts = {tuple(b.layout.chunk_ids(OLD)), tuple(b.layout.chunk_ids(NEW))}
    seen: list[tuple[int, ...]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.append(tuple(tokens(b, "kiwi")))
            except BaseException as exc:  # noqa: BLE001 - any failure is the test's answer
                errors.append(exc)
                return

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(11):  # the last write is NEW
            a.precompute([NEW if i % 2 == 0 else OLD], progress=False)
    finally:
        done.set()
        reader.join(30)
    assert not errors and seen and set(seen) <= texts
    assert tokens(b, "kiwi") == a.layout.chunk_ids(NEW)  # the last write, once it has returned


@needs_redis
def test_a_store_that_cannot_be_read_or_lost_its_index_leaves_this_process_table_answering(lm):
    redis = RedisServer()
    redis.start()
    try:
        a, b = two(lm, redis.url)
        b.precompute([OLD], progress=False)
        redis.stop()  # the store cannot say whether the id is still bound: b's own table answers, as before
        assert tokens(b, "kiwi") == b.layout.chunk_ids(OLD)
        redis.start()  # back, empty (no persistence): an unlink and a lost index look alike, and the library
        time.sleep(1.2)  # (no judge: kvrag.kv.registry.removed_ids_by) keeps serving what it holds
        assert tokens(b, "kiwi") == b.layout.chunk_ids(OLD)
        with pytest.raises(ChunkNotFoundError):
            tokens(a, "kiwi")  # never knew it
    finally:
        redis.stop()


# -- the server's judge: without a retrieval index the store decides, with one the index does -------------------
def _by_id(url: str, chunk_id: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60, trust_env=False, json={
        "model": "kvrag", "messages": [{"role": "user", "content": "What is it?"}], "max_tokens": 1,
        "kvrag": {"chunk_ids": [chunk_id]}})


def test_replicas_without_an_index_refuse_an_id_deleted_through_either(lm):
    store = MemoryStore()  # one store, two servers: replicas over one Redis, in one process
    fig = {"id": "fig", "text": "Fig trees are pollinated by tiny wasps."}
    with LiveServer(create_app(KVRag(lm, store=store), SETTINGS)) as a, LiveServer(create_app(KVRag(lm, store=store), SETTINGS)) as b:
        assert httpx.post(f"{b.url}/v1/chunks", json={"chunks": [fig]}, trust_env=False, timeout=60).status_code == 200
        assert _by_id(b.url, "fig").status_code == 200
        assert httpx.delete(f"{a.url}/v1/chunks/fig", trust_env=False, timeout=60).status_code == 200
        for url in (a.url, b.url):
            gone = _by_id(url, "fig")
            assert gone.status_code == 400 and gone.json()["error"]["code"] == "chunk_not_found", gone.text
        again = httpx.post(f"{b.url}/v1/chunks", json={"chunks": [{**fig, "text": "Figs grow on trees."}]}, trust_env=False, timeout=60)
        assert again.status_code == 200, again.text  # deleted: free for new text, no 409 from b's old copy
        assert _by_id(a.url, "fig").status_code == 200


@needs_redis
def test_with_an_index_an_id_it_holds_survives_a_store_restarted_empty(lm, tmp_path):
    from kvrag.ingest.retrieval import ChunkIndex

    redis = RedisServer()
    redis.start()
    try:
        rag = KVRag(lm, store=redis.url)
        with LiveServer(create_app(rag, SETTINGS, ChunkIndex(tmp_path / "chroma"))) as live:
            chunk = {"id": "kiwi", "text": OLD.text, "title": OLD.title}
            assert httpx.post(f"{live.url}/v1/chunks", json={"chunks": [chunk]}, trust_env=False, timeout=60).status_code == 200
            redis.stop()
            redis.start()  # empty: the store's id index is lost, the retrieval index still holds "kiwi"
            time.sleep(0.2)
            r = _by_id(live.url, "kiwi")
            assert r.status_code == 200 and r.json()["kvrag_stats"]["cache_misses"] == 1, r.text  # recomputed from its text
            assert httpx.delete(f"{live.url}/v1/chunks/kiwi", trust_env=False, timeout=60).status_code == 200
            assert _by_id(live.url, "kiwi").json()["error"]["code"] == "chunk_not_found"
    finally:
        redis.stop()


def _delete(url: str, chunk_id: str) -> httpx.Response:
    return httpx.delete(f"{url}/v1/chunks/{chunk_id}", trust_env=False, timeout=60)


@needs_redis
def test_a_delete_while_the_stores_id_index_is_unreachable_is_a_503_that_changes_nothing(lm, tmp_path):
    """A DELETE is whole or not at all: with the store frozen its link cannot be dropped, so nothing is (the
    retrieval entry and this replica's copy stay, and another replica, here `other`, still resolves the id); a
    retry once the store is back deletes it everywhere."""
    import os
    import signal

    from kvrag.ingest.retrieval import ChunkIndex

    redis = RedisServer()
    redis.start()
    try:
        rag, other, index = KVRag(lm, store=redis.url), KVRag(lm, store=redis.url), ChunkIndex(tmp_path / "chroma")
        with LiveServer(create_app(rag, SETTINGS, index)) as live:
            chunk = {"id": "kiwi", "text": OLD.text, "title": OLD.title}
            assert httpx.post(f"{live.url}/v1/chunks", json={"chunks": [chunk]}, trust_env=False, timeout=60).status_code == 200
            os.kill(redis.proc.pid, signal.SIGSTOP)  # unreachable (reads time out), its data kept
            try:
                refused = _delete(live.url, "kiwi")
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)
            assert refused.status_code == 503 and refused.headers["retry-after"] == str(SETTINGS.retry_after_s), refused.text
            error = refused.json()["error"]
            assert error["code"] == "kv_store_unavailable" and error["type"] == "server_error" and "not deleted" in error["message"]
            assert [c.id for c in index.get(["kiwi"])] == ["kiwi"] and "kiwi" in rag.repo.chunks  # nothing changed
            assert tokens(other, "kiwi") == other.layout.chunk_ids(OLD)  # the link stands: resolved by another replica
            deadline = time.monotonic() + 30
            while (done := _delete(live.url, "kiwi")).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)  # the server's store waits out its back-off before it reads Redis again
            assert done.status_code == 200, done.text
            assert done.json()["unlinked"] is True and done.json()["unindexed"] is True
        assert index.get(["kiwi"]) == [] and "kiwi" not in rag.repo.chunks
        assert other.repo.store_links(["kiwi"]) == [None]
        with pytest.raises(ChunkNotFoundError):
            KVRag(lm, store=redis.url).repo.lookup(["kiwi"], None)  # a replica that never held it: unknown
    finally:
        redis.stop()


def test_chunk_by_id_reads_what_the_stores_link_binds_not_this_process_old_text(lm):
    a, b = two(lm, MemoryStore())
    fig = Chunk("fig", "Fig trees are pollinated by tiny wasps.")
    b.precompute([OLD, fig], progress=False)
    assert b.chunk("kiwi") == OLD  # bound here and in the store alike: this process's chunk, title and all
    a.precompute([NEW], progress=False)  # replaced through another replica
    now = b.chunk("kiwi")
    assert OLD.text not in now.text and NEW.text in now.text and now.metadata == {"source": "store"}
    a.repo.forget_report(a.repo.lookup(["fig"], None))  # deleted through another replica
    with removed_ids_by(lambda ids: ids), pytest.raises(ChunkNotFoundError):  # the judge (the server's) says deleted
        b.chunk("fig")
    with pytest.raises(ChunkNotFoundError):
        b.chunk("fig")  # dropped from b's table: unknown from now on, judge or not
    with pytest.raises(ChunkNotFoundError):
        b.chunk("never-ingested")


@needs_redis
def test_the_library_forgets_nothing_while_the_stores_id_index_is_unreachable(lm):
    """`KVRag.forget` is whole or not at all, as DELETE is: StoreUnavailableError with the id still registered
    here and bound in the store (another engine resolves it); once Redis is back it forgets the id everywhere."""
    import os
    import signal

    from kvrag.errors import StoreUnavailableError

    redis = RedisServer()
    redis.start()
    try:
        url = f"{redis.url}?connect_timeout=0.3&socket_timeout=0.3"
        rag, other = KVRag(lm, store=url), KVRag(lm, store=url)
        rag.precompute([OLD], progress=False)
        os.kill(redis.proc.pid, signal.SIGSTOP)  # unreachable (reads time out), its data kept
        try:
            with pytest.raises(StoreUnavailableError):
                rag.forget([OLD])
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert "kiwi" in rag.repo.chunks and tokens(other, "kiwi") == other.layout.chunk_ids(OLD)  # nothing changed
        deadline = time.monotonic() + 30
        while True:  # the engine's store waits out its back-off before it reads Redis again
            try:
                rag.forget([OLD])
                break
            except StoreUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert "kiwi" not in rag.repo.chunks and other.repo.store_links(["kiwi"]) == [None]
    finally:
        redis.stop()
