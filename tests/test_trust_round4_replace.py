"""Issue 69, finding 4: Redis killed (SIGKILL) mid-replace left a split state for good: the POST got 503
`kv_not_stored`, and then the index held the old text while that replica answered the new text by id, even
after Redis came back empty. Now a write the store did not take whole is put back on a 503 (the registration
here, the store's links, the entries it computed: kvrag.server.write_undo), so once Redis is back every
replica answers by id and by retrieval from one version. Real `kvrag serve` processes, a real `chroma run`,
a real redis-server killed with SIGKILL; a tiny model (the mechanics)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from chroma_server import ChromaServer  # noqa: E402
from test_backends import REDIS, RedisServer  # noqa: E402
from test_replicas import READ_KEY, Replica, _by_id, _prompt_tokens_inline  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")

OLD = {"id": "kiwi", "text": "Kiwis are flightless birds of New Zealand.", "title": "Kiwis"}
NEW = {**OLD, "text": "Kiwi fruit grows on woody vines; it has a fuzzy brown skin, green flesh and rows of small black "
                      "seeds around a pale core."}


@pytest.fixture
def pair(tmp_path):
    chroma, redis = ChromaServer(tmp_path / "chroma").start(), RedisServer()
    redis.start()
    replicas = [Replica(redis.url, chroma.url(), tmp_path / f"home{i}") for i in range(2)]
    try:
        for r in replicas:
            r.wait()
        yield redis, replicas[0], replicas[1]
    finally:
        for r in replicas:
            r.stop()
        chroma.stop()
        redis.stop()


def _retrieved(replica: Replica) -> list[str]:
    r = replica.http("POST", "/v1/chat/completions", key=READ_KEY, json={
        "model": "kvrag", "messages": [{"role": "user", "content": "Tell me about kiwis."}], "max_tokens": 1})
    assert r.status_code == 200, r.text
    return [s["id"] for s in r.json()["kvrag_sources"]]


def _answered_by_id(replica: Replica, deadline_s: float = 30) -> int:
    """The prompt tokens of an answer by id, once the replica's store has come out of its back-off."""
    end = time.monotonic() + deadline_s
    while True:
        r = _by_id(replica, "kiwi")
        if r.status_code == 200 or time.monotonic() > end:
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        time.sleep(0.5)


def test_redis_killed_mid_replace_leaves_one_version(pair):
    redis, a, b = pair
    assert a.http("POST", "/v1/chunks", json={"chunks": [OLD]}).status_code == 200
    old_tokens, new_tokens = _prompt_tokens_inline(a, OLD), _prompt_tokens_inline(a, NEW)
    assert old_tokens != new_tokens and _answered_by_id(a) == old_tokens
    redis.stop()  # SIGKILL: the store is gone while the replace runs
    r = a.http("POST", "/v1/chunks", json={"chunks": [NEW], "replace": True})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] in ("kv_not_stored", "kv_store_unavailable")
    assert "kiwi" in r.json().get("not_stored", ["kiwi"])
    assert _answered_by_id(a) == old_tokens  # while Redis is down: the old text, as the index holds
    redis.start()  # back, empty (as after FLUSHALL)
    time.sleep(1)
    for replica in (a, b):
        assert _answered_by_id(replica) == old_tokens, replica.url  # by id: the one version the index holds
        assert "kiwi" in _retrieved(replica)
    # the write retried once the store is back lands whole, on both replicas
    end = time.monotonic() + 30
    while (r := a.http("POST", "/v1/chunks", json={"chunks": [NEW], "replace": True})).status_code == 503 and time.monotonic() < end:
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    for replica in (a, b):
        assert _answered_by_id(replica) == new_tokens


def test_a_two_replica_race_on_one_id_converges(pair):
    _, a, b = pair
    assert a.http("POST", "/v1/chunks", json={"chunks": [OLD]}).status_code == 200
    import threading

    texts = [{**OLD, "text": f"Kiwi version {i}: " + "a fruit of vines. " * (i + 1)} for i in range(4)]
    threads = [threading.Thread(target=lambda r=r, t=t: r.http("POST", "/v1/chunks", json={"chunks": [t], "replace": True}))
               for r, t in zip((a, b, a, b), texts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    by_a, by_b = _answered_by_id(a), _answered_by_id(b)
    assert by_a == by_b and by_a in {_prompt_tokens_inline(a, t) for t in texts}
