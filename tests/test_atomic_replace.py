"""Replace is whole or not at all, across the KV store and the retrieval index, and concurrent replaces
converge. A `POST /v1/chunks` with `replace: true` wrote the store's link before the index: with Chroma
stopped mid-request the client got `503 index_unavailable` (which says nothing changed) while replicas
answered by id with the new text and retrieval with the old; two replicas replacing one id at once left the
index with one text and the store with the other, for good. Real `chroma run`, real Redis, real HTTP;
a tiny random model (the mechanics)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from chroma_server import ChromaServer  # noqa: E402
from kvrag import KVRag  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from test_backends import REDIS, RedisServer  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")

OLD = {"id": "kiwi", "text": "Kiwis are flightless birds.", "title": "Kiwis"}
NEW = {**OLD, "text": "Kiwi fruit grows on woody vines in New Zealand, with a fuzzy brown skin."}


@pytest.fixture
def places(tmp_path):
    chroma, redis = ChromaServer(tmp_path / "chroma").start(), RedisServer()
    redis.start()
    try:
        yield chroma, redis
    finally:
        chroma.stop()
        redis.stop()


class Stopping:
    """The engine, whose precompute stops the index server once it is done: Chroma gone mid-request,
    after the conflict check and the KV, before the index write."""

    def __init__(self, rag: KVRag, chroma: ChromaServer) -> None:
        self._rag, self.chroma, self.armed = rag, chroma, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def precompute(self, *args: Any, **kwargs: Any) -> Any:
        report = self._rag.precompute(*args, **kwargs)
        if self.armed:
            self.chroma.kill()
        return report


def _by_id(http: httpx.Client, chunk_id: str) -> dict:
    r = http.post("/v1/chat/completions", json=chat("What is it?", kvrag={"chunk_ids": [chunk_id]}))
    assert r.status_code == 200, r.text
    return r.json()


def _tokens_of(http: httpx.Client, chunk: dict) -> int:
    return http.post("/v1/chat/completions", json=chat("What is it?", kvrag={"chunks": [chunk]})).json()["usage"]["prompt_tokens"]


def test_a_replace_refused_by_a_stopped_index_changes_nothing(places):
    chroma, redis = places
    engine = Stopping(tiny_rag(redis.url), chroma)
    index = ChunkIndex(url=chroma.url())
    with LiveServer(create_app(engine, SETTINGS, index)) as live, httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        assert http.post("/v1/chunks", json={"chunks": [OLD]}).status_code == 200
        old_tokens, new_tokens = _tokens_of(http, OLD), _tokens_of(http, NEW)
        assert old_tokens != new_tokens
        engine.armed = True
        r = http.post("/v1/chunks", json={"chunks": [NEW], "replace": True})
        assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable", r.text
        engine.armed = False
        chroma.start()
        assert _by_id(http, "kiwi")["usage"]["prompt_tokens"] == old_tokens  # by id: the old text, as the 503 said
        other = KVRag(engine.lm, store=redis.url)  # another replica over the same store
        assert OLD["text"] in other.repo.lookup(["kiwi"], None).chunks[0].text
        assert [c.text for c in index.get(["kiwi"])] == [OLD["text"]]
        assert http.post("/v1/chunks", json={"chunks": [NEW], "replace": True}).status_code == 200  # the retry does it all
        assert _by_id(http, "kiwi")["usage"]["prompt_tokens"] == new_tokens
        assert [c.text for c in index.get(["kiwi"])] == [NEW["text"]]


def test_two_replicas_replacing_one_id_at_once_converge(places):
    chroma, redis = places
    lm = tiny_rag().lm
    apps = [create_app(KVRag(lm, store=redis.url), SETTINGS, ChunkIndex(url=chroma.url())) for _ in range(2)]
    texts = [f"Variant {v}: kiwi " + "word " * (3 + v) for v in range(2)]
    with LiveServer(apps[0]) as a, LiveServer(apps[1]) as b:
        clients = [httpx.Client(base_url=s.url, timeout=120, trust_env=False) for s in (a, b)]
        assert clients[0].post("/v1/chunks", json={"chunks": [OLD]}).status_code == 200
        want = {t: _tokens_of(clients[0], {**OLD, "text": t}) for t in texts}
        index = ChunkIndex(url=chroma.url())
        for round_ in range(10):
            barrier = threading.Barrier(2)

            def replace(i: int) -> None:
                barrier.wait()
                r = clients[i].post("/v1/chunks", json={"chunks": [{**OLD, "text": texts[(i + round_) % 2]}], "replace": True})
                assert r.status_code == 200, r.text

            threads = [threading.Thread(target=replace, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            [indexed] = [c.text for c in index.get(["kiwi"])]
            for http in clients:  # one text in both places, whichever write landed last
                assert _by_id(http, "kiwi")["usage"]["prompt_tokens"] == want[indexed], round_
        for http in clients:
            http.close()
