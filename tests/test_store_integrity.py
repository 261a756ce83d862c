"""Issue #37 items 3 and 9: keyed entries and a per-model bound on an entry's size (each test failed
before the fix).

Item 3: the entry checksum is unkeyed, so whoever can write the disk folder or the Redis can relabel
chunk d2's KV with chunk d1's token ids, let the store compute a valid checksum, and have the engine
answer from "d1" with d2's facts. With `$KVRAG_STORE_KEY` (or `key=`) every entry carries a MAC,
and an entry without a valid one is a logged miss. Item 9: a sparse file of huge apparent size at an
entry's path cost gigabytes and seconds per read; the engine now bounds entries by its model's
largest, checked on the file's size (or the Redis value's) before anything is allocated or mapped.
"""

import logging
import os
import resource
import time
import tracemalloc

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.cache_backends import KEY_ENV, DiskStore, KVEntry, MacKey, MemoryStore, TieredStore, content_key, entry_bytes_bound, open_store
from kvrag.cache_backends.disk_read import ReadBatch
from kvrag.cache_backends.format import encode_entry
from kvrag.cache_backends.redis_store import RedisStore
from kvrag.kv.entry_check import kv_shape
from test_backends import running_redis
from tiny import tiny_model, tiny_tokenizer

SECRET = "a deployment secret"
D1, D2 = content_key("d1"), content_key("d2")
KINDS = ["disk-map", "disk-copy", "tiered-disk", "redis", "tiered-redis"]


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1000 bytes: the copy path's MAC is fed an entry in many pieces, by several threads."""
    monkeypatch.setattr(ReadBatch.__init__, "__defaults__", (1000,))


@pytest.fixture(scope="module")
def redis_url():
    with running_redis() as server:
        yield server.url


def chunk_entry(seed: int, ids: list[int]) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(3, 2, len(ids), 16, generator=g)
    v = torch.randn(3, 2, len(ids), 16, generator=g)
    return KVEntry(k, v, meta={"kind": "chunk", "model": "m"}, token_ids=torch.tensor(ids, dtype=torch.int64))


IDS1, IDS2 = list(range(100, 140)), list(range(200, 240))


def d1() -> KVEntry:
    return chunk_entry(1, IDS1)


def d2() -> KVEntry:
    return chunk_entry(2, IDS2)


def forged() -> KVEntry:
    """d2's KV relabelled with d1's token ids: what the engine's token-id check cannot tell from d1."""
    e = d2()
    return KVEntry(e.keys, e.values, meta=dict(d1().meta), token_ids=d1().token_ids)


class Stores:
    """Opens stores of one kind over one shared folder or Redis database, each with its own key,
    the way separate processes (the engine, an attacker with write access) would."""

    def __init__(self, kind: str, tmp_path, redis_url: str | None, monkeypatch) -> None:
        self.kind, self.root, self.redis_url, self.mp = kind, tmp_path / "kv", redis_url, monkeypatch
        if "redis" in kind:
            RedisStore(redis_url).client.flushdb()

    def open(self, key: str | None):
        """`key=None`: no key; tiered stores get theirs from the environment, like the engine's."""
        if self.kind.startswith("tiered"):
            if key is None:
                self.mp.delenv(KEY_ENV, raising=False)
            else:
                self.mp.setenv(KEY_ENV, key)
            lower = f"disk://{self.root}" if "disk" in self.kind else self.redis_url
            store = open_store(f"tiered://?tiers=memory|{lower}")
            self.mp.delenv(KEY_ENV, raising=False)
            return store
        if self.kind == "redis":
            return RedisStore(self.redis_url, key=key or "")
        return DiskStore(self.root, read=self.kind.split("-")[1], threads=2, key=key or "")

    def byte_tier(self, store):
        return store.lower if isinstance(store, TieredStore) else store


@pytest.fixture(params=KINDS)
def stores(request, tmp_path, monkeypatch, small_pieces):
    url = request.getfixturevalue("redis_url") if "redis" in request.param else None
    return Stores(request.param, tmp_path, url, monkeypatch)


def same(a: KVEntry, b: KVEntry) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.token_ids, b.token_ids)


# -- item 3: keyed integrity ------------------------------------------------------------------------
def test_a_forged_entry_is_served_without_a_key_and_a_logged_miss_with_one(stores, caplog):
    honest = stores.open(SECRET)
    honest.put(D1, d1())
    honest.put(D2, d2())
    stores.open(None).put(D1, forged())  # an attacker with write access: the store computes the checksum
    assert same(stores.open(None).get(D1), forged())  # today's behaviour without a key: d2's facts as d1's
    reader = stores.open(SECRET)
    with caplog.at_level(logging.WARNING):
        assert reader.get(D1) is None
    assert "MAC" in caplog.text
    assert stores.byte_tier(reader).stats().unverified == 1  # issue #53: counted, not an error
    assert stores.byte_tier(reader).contains(D1)  # and kept (it may be a keyless writer's): the engine's recompute replaces it
    assert same(reader.get(D2), d2())  # genuine entries still serve
    reader.put(D1, d1())  # the engine's rewrite
    assert same(stores.open(SECRET).get(D1), d1())


def test_an_entry_written_with_the_key_is_a_hit_and_other_keys_miss(stores):
    stores.open(SECRET).put(D1, d1())
    got = stores.open(SECRET).get_many([D1, D2])
    assert same(got[0], d1()) and got[1] is None
    assert stores.open("another secret").get(D1) is None


def test_a_key_on_read_refuses_entries_written_without_one(stores, caplog):
    stores.open(None).put(D1, d1())
    with caplog.at_level(logging.WARNING):
        assert stores.open(SECRET).get(D1) is None
    assert "no MAC" in caplog.text


def test_no_key_anywhere_behaves_as_today_and_keyed_entries_still_read_without_one(stores):
    plain = stores.open(None)
    plain.put(D1, d1())
    assert same(stores.open(None).get(D1), d1())
    stores.open(SECRET).put(D2, d2())
    assert same(stores.open(None).get(D2), d2())  # its checksum covers the MAC field: still a valid entry


def test_a_genuine_entry_copied_under_another_key_is_refused(tmp_path, redis_url):
    """The MAC binds the store key an entry was written under, so replaying one elsewhere fails."""
    disk = DiskStore(tmp_path / "kv", key=SECRET)
    disk.put(D2, d2())
    disk._path(D1).parent.mkdir(parents=True, exist_ok=True)
    disk._path(D1).write_bytes(disk._path(D2).read_bytes())
    assert disk.get(D1) is None and same(disk.get(D2), d2())
    redis = RedisStore(redis_url, key=SECRET)
    redis.client.flushdb()
    redis.put(D2, d2())
    redis.client.set(redis._name(D1), redis.client.get(redis._name(D2)))
    assert redis.get(D1) is None and same(redis.get(D2), d2())


def test_unkeyed_entries_carry_no_mac_and_keyed_ones_a_small_one():
    data = encode_entry(d1())
    signed = encode_entry(d1(), key=MacKey(SECRET), name=D1)
    assert b'"mac"' not in data and b'"mac"' in signed and len(signed) - len(data) <= 128


def test_keyed_mapped_reads_share_the_entries_among_the_reader_threads(tmp_path, monkeypatch):
    """A MAC pass is ~15x an xxh3 pass and releases the GIL: a keyed request is verified on several threads."""
    import threading

    from kvrag.cache_backends import disk

    store = DiskStore(tmp_path, read="map", threads=2, key=SECRET)
    keys = [content_key("spread", str(i)) for i in range(5)]
    for i, k in enumerate(keys):
        store.put(k, chunk_entry(i, IDS1))
    seen, real = set(), disk.map_entry
    monkeypatch.setattr(disk, "map_entry", lambda *a: seen.add(threading.current_thread().name) or real(*a))
    got = store.get_many(keys)
    assert all(same(g, chunk_entry(i, IDS1)) for i, g in enumerate(got))  # in request order
    assert len(seen) == 2 and threading.current_thread().name in seen


def test_the_key_comes_from_the_environment_and_never_shows(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    store = open_store(f"disk://{tmp_path}")
    assert store.mac_key is not None and SECRET not in repr(store) + repr(store.mac_key) + repr(vars(store))
    assert DiskStore(tmp_path, key="").mac_key is None  # an explicit empty key: none
    monkeypatch.setenv(KEY_ENV, "")
    assert open_store(f"disk://{tmp_path}").mac_key is None


# -- the engine end to end (a tiny random model) ---------------------------------------------------
A = Chunk("a", "The cat sat on the mat and purred all afternoon long.")
B = Chunk("b", "Lava, ash and gas erupt from deep below the crust.".rjust(len(A.text)))  # as many bytes (tokens)
Q = "What did the cat do?"


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_model("llama"), tiny_tokenizer())


@pytest.mark.parametrize("keyed", [True, False])
def test_the_engine_recomputes_a_forged_entry_only_with_a_key(lm, tmp_path, monkeypatch, caplog, keyed):
    url = f"disk://{tmp_path}/kv"
    if keyed:
        monkeypatch.setenv(KEY_ENV, SECRET)
    rag = KVRag(lm, store=url)
    rag.precompute([A, B], progress=False)
    res = rag._resolve([A, B])
    assert len(res.token_ids[0]) == len(res.token_ids[1])  # same length: d2's KV fits d1's shape check
    real_b = rag.store.get(res.keys[1])
    DiskStore(tmp_path / "kv", key="").put(  # the attacker holds no key
        res.keys[0], KVEntry(real_b.keys.clone(), real_b.values.clone(), dict(real_b.meta), torch.tensor(res.token_ids[0]))
    )
    with caplog.at_level(logging.WARNING):
        out = KVRag(lm, store=url).prefill(Q, chunks=[A], method="reuse")
    if keyed:
        assert out.stats.cache_hits == 0 and out.stats.cache_misses == 1 and "MAC" in caplog.text
        assert KVRag(lm, store=url).prefill(Q, chunks=[A], method="reuse").stats.cache_hits == 1  # rewritten, signed
    else:
        assert out.stats.cache_hits == 1  # served: what the unkeyed checksum cannot stop


# -- item 9: a bound on an entry's size --------------------------------------------------------------
def sparse_entry_file(store: DiskStore, key: str, size: int = 2 << 30) -> str:
    """A genuine entry's first bytes (a valid header) followed by a hole: 4 KB on disk, `size` apparent."""
    path = store._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_entry(d1())[:4096])
    os.truncate(path, size)
    return str(path)


@pytest.mark.parametrize("read", ["map", "copy"])
def test_a_sparse_file_over_the_entry_limit_is_a_fast_miss_without_allocating(tmp_path, read, caplog):
    store = DiskStore(tmp_path / "kv", read=read, max_bytes=None)
    store.limit_entry_bytes(4 << 20)
    path = sparse_entry_file(store, D1)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING):
        assert store.get(D1) is None
    assert time.perf_counter() - t0 < 0.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100_000  # KiB: nothing near 2 GB
    assert "larger than any valid entry" in caplog.text and not os.path.exists(path)
    store.put(D1, d1())  # a real entry is well under the limit
    assert same(store.get(D1), d1())


def test_the_entry_limit_reaches_the_disk_tier_through_a_tiered_store(tmp_path):
    store = TieredStore([MemoryStore(), DiskStore(tmp_path / "kv", max_bytes=None)])
    store.limit_entry_bytes(4 << 20)
    assert store.lower.entry_limit == 4 << 20
    sparse_entry_file(store.lower, D1)
    t0 = time.perf_counter()
    assert store.get(D1) is None and time.perf_counter() - t0 < 0.5


def test_the_limit_is_the_largest_asked_for_and_none_lifts_it(tmp_path):
    store = DiskStore(tmp_path)
    assert store.entry_limit is None
    store.limit_entry_bytes(10 << 20)
    store.limit_entry_bytes(5 << 20)  # another engine, a smaller model, on the same store
    assert store.entry_limit == 10 << 20 and store._entry_bound() == 10 << 20
    store.limit_entry_bytes(None)
    assert store.entry_limit is None


def test_a_redis_value_over_the_limit_is_a_miss_fetched_only_up_to_the_limit(redis_url, caplog):
    store = RedisStore(redis_url)
    store.client.flushdb()
    store.limit_entry_bytes(1 << 20)
    store.client.set(store._name(D1), encode_entry(d1())[:4096] + b"\0" * (24 << 20))  # a planted 24 MB value
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING):
            assert store.get(D1) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the value's first MiB, not its 24
    assert "entry limit" in caplog.text and store.client.exists(store._name(D1)) == 0
    store.put(D1, d1())
    assert same(store.get(D1), d1())


def test_a_split_redis_entry_over_the_limit_is_a_miss_before_its_parts_are_read(redis_url):
    store = RedisStore(redis_url + "?part_bytes=1000")
    store.client.flushdb()
    store.put(D1, d1())  # ~8 KB in parts of 1000 bytes
    assert same(store.get(D1), d1())
    store.limit_entry_bytes(4000)
    assert store.get(D1) is None and store.client.exists(store._name(D1)) == 0


def test_the_engine_bounds_its_store_by_its_models_largest_entry(lm, tmp_path):
    rag = KVRag(lm, store=f"tiered://?tiers=memory|disk://{tmp_path}/kv")
    want = entry_bytes_bound(lm.max_context, *kv_shape(lm), lm.dtype.itemsize)
    assert rag.store.lower.entry_limit == want
    rag.precompute([A], progress=False)
    size = rag.store.lower._path(rag._resolve([A]).keys[0]).stat().st_size
    assert size < want
    layers, heads, dim = kv_shape(lm)
    assert want >= lm.max_context * layers * 2 * heads * dim * lm.dtype.itemsize  # a full-context entry fits


# -- `kvrag store gc` checks the MAC when the store has a key -------------------------------------
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_gc_with_a_key_lists_an_unsigned_entry_and_removes_it_only_when_asked(kind, tmp_path, redis_url, monkeypatch):
    """gc read entries with the unkeyed checksum only, so it kept forged entries a keyed reader refuses;
    issue #53: an unsigned entry may be a keyless writer's genuine data, so plain gc lists it and keeps
    it, and `gc --unverified` removes it."""
    from kvrag.cache_backends.admin import gc, open_admin

    monkeypatch.setenv(KEY_ENV, SECRET)
    url = f"disk://{tmp_path}" if kind == "disk" else redis_url
    signed = open_store(url)
    if kind == "redis":
        signed.client.flushdb()
    signed.put(D2, d2())
    forger = DiskStore(tmp_path, key="") if kind == "disk" else RedisStore(redis_url, key="")
    forger.put(D1, d1())  # a sound checksum, no MAC
    plan = gc(open_admin(url), dry_run=True)
    assert plan["bad_entries"] == []
    assert [(b["key"], "MAC" in b["problem"]) for b in plan["unverified_kept"]] == [(D1, True)]
    gc(open_admin(url))
    assert signed.contains(D1) and signed.get(D1) is None  # kept, never served
    gc(open_admin(url), unverified=True)
    assert not signed.contains(D1) and same(signed.get(D2), d2())
    monkeypatch.delenv(KEY_ENV)
    assert gc(open_admin(url), dry_run=True)["bad_entries"] == []  # without a key, the signed entry is sound
