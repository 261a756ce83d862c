"""Issue #35 item 3: the KV store over a real local Redis Cluster (3 masters on loopback ports).

Entries spread over the shards (an entry and its parts share a slot by their hash tag), the chunk-id
index stays one hash, `kvrag store stats/ls/gc` work on it, and a killed master is a miss and a
recompute, never a wrong answer or a crash."""

from __future__ import annotations

import pytest

from kvrag import Chunk, KVRag, from_model
from kvrag.cache_backends import StoreError, content_key, open_store
from kvrag.cache_backends.admin import gc, list_entries, open_admin, store_stats
from kvrag.cache_backends.redis_store import RedisStore, cluster_nodes
from redis_cluster import CLUSTER_OK, RedisClusterProcess
from test_store_integrity import chunk_entry, same
from tiny import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.skipif(not CLUSTER_OK, reason="redis-server and redis-cli are needed for a local Redis Cluster")

CHUNKS = [Chunk(f"c{i}", f"Fact number {i}: the lighthouse on island {i} was lit in {1800 + i}.") for i in range(12)]
QUESTION = "When was the lighthouse on island 3 lit?"


@pytest.fixture(scope="module")
def cluster():
    c = RedisClusterProcess().start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_model("llama"), tiny_tokenizer())


def test_cluster_urls_name_their_nodes_and_refuse_malformed_ones():
    assert cluster_nodes("redis+cluster://a:7000,b:7001/") == [("a", 7000), ("b", 7001)]
    assert cluster_nodes("redis+cluster://user:secret@10.0.0.1:7000/?ttl=60") == [("10.0.0.1", 7000)]
    for bad in ("redis+cluster:///", "redis+cluster://host/", "redis+cluster://h:port/"):
        with pytest.raises(StoreError):
            cluster_nodes(bad)


def test_entries_spread_over_the_shards_and_read_back(cluster):
    store = open_store(cluster.url + "?part_bytes=4096")
    assert isinstance(store, RedisStore) and store.cluster
    keys = [content_key("spread", str(i)) for i in range(24)]
    for i, k in enumerate(keys):
        store.put(k, chunk_entry(i, list(range(100, 140))))  # ~60 KB each: split into parts of 4 KB
    got = store.get_many(keys)
    assert all(g is not None and same(g, chunk_entry(i, list(range(100, 140)))) for i, g in enumerate(got))
    counts = [cluster.keys_on(p) for p in cluster.ports]
    assert all(n > 0 for n in counts), counts  # every shard holds some
    store.link(["ns/a", "ns/b"], keys[:2])
    assert open_store(cluster.url).resolve(["ns/a", "ns/b", "ns/none"]) == [keys[0], keys[1], None]


def test_the_engine_answers_from_the_cluster_and_the_admin_works_on_it(cluster, lm):
    url = cluster.url
    rag = KVRag(lm, store=url, check=False)
    rag.precompute(CHUNKS, progress=False)
    first = rag.answer(QUESTION, [c.id for c in CHUNKS[:6]], method="reuse", max_new_tokens=6)
    again = KVRag(lm, store=url, check=False).answer(QUESTION, [c.id for c in CHUNKS[:6]], method="reuse", max_new_tokens=6)
    assert again.text == first.text and again.stats.cache_hits == 6  # another engine finds them by id
    st = store_stats(open_admin(url))
    assert st["backend"] == "redis" and st["by_kind"]["chunk"]["entries"] >= len(CHUNKS) and st["index_links"] >= len(CHUNKS)
    assert len(list_entries(open_admin(url), kind="chunk")) >= len(CHUNKS)
    plan = gc(open_admin(url), dry_run=True)
    assert plan["bad_entries"] == [] and plan["entries_checked"] >= len(CHUNKS)


def test_a_killed_master_is_a_miss_and_a_recompute_never_a_wrong_answer(lm, caplog):
    c = RedisClusterProcess().start()
    try:
        url = c.url + "?socket_timeout=0.5&connect_timeout=0.5"
        rag = KVRag(lm, store=url, check=False)
        rag.precompute(CHUNKS, progress=False)
        ids = [ch.id for ch in CHUNKS[:8]]
        want = KVRag(lm, store="memory://", check=False)
        want.precompute(CHUNKS, progress=False)
        reference = want.answer(QUESTION, ids, method="reuse", max_new_tokens=6).text
        assert rag.answer(QUESTION, ids, method="reuse", max_new_tokens=6).text == reference
        c.kill(c.ports[1])  # one master gone, with its third of the slots
        fresh = KVRag(lm, store=url, check=False)
        fresh.register(CHUNKS)
        out = fresh.answer(QUESTION, ids, method="reuse", max_new_tokens=6)
        assert out.text == reference  # what it could not read it computed
        assert out.stats.cache_misses >= 1
        # the back-off is the dead shard's alone: the live shards' entries are read, now and right after
        assert out.stats.cache_hits >= 1, out.stats
        again = fresh.answer(QUESTION, ids, method="reuse", max_new_tokens=6)
        assert again.text == reference and again.stats.cache_hits >= 1
    finally:
        c.stop()
