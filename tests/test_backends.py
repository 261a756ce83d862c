"""Cache backends against real servers and real files: round trips, int8 bound, faults, concurrency."""

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import time
from typing import Iterator

import pytest
import torch

from kvrag import Chunk, ChunkNotFoundError, KVRag, from_model
from kvrag.cache_backends import DiskStore, KVEntry, TieredStore, content_key, open_store
from kvrag.cache_backends.format import decode_entry, encode_entry
from tiny import tiny_model, tiny_tokenizer

REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real redis-server on loopback and a random port, which a test can kill and restart."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A started redis-server, stopped on leaving; skips the test where none is installed. Why: a test
    module's fixture shares one server between its tests without repeating the start and stop."""
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def entry(dtype=torch.float32, tokens=7, seed=0, with_ids=True, head_dim=8):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(3, 2, tokens, head_dim, generator=g) * 3).to(dtype)
    v = torch.randn(3, 2, tokens, head_dim, generator=g).to(dtype)
    ids = torch.arange(tokens, dtype=torch.int64) if with_ids else None
    return KVEntry(k, v, meta={"kind": "chunk"}, token_ids=ids)


STORES = ["memory", "disk", "tiered-disk", "redis", "tiered-redis"]


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    if "redis" in request.param:
        if REDIS is None:
            pytest.skip("redis-server is not installed")
        server = request.getfixturevalue("redis_server")
        lower = server.url
    else:
        lower = f"disk://{tmp_path}/kv"
    url = {"memory": "memory://", "disk": lower, "redis": lower}.get(request.param, f"tiered://?lower={lower}")
    return open_store(url)


def test_round_trip_is_bit_exact_in_every_store(store):
    for dtype in (torch.float32, torch.bfloat16):
        e = entry(dtype)
        key = content_key(str(dtype))
        store.put(key, e)
        got = store.get(key)
        assert got.keys.dtype == dtype and torch.equal(got.keys, e.keys) and torch.equal(got.values, e.values)
        assert torch.equal(got.token_ids, e.token_ids)
    keys = [content_key(str(torch.float32)), content_key("absent"), content_key(str(torch.bfloat16))]
    many = store.get_many(keys)
    assert many[1] is None and many[0] is not None and many[2] is not None
    assert store.contains(keys[0]) and not store.contains(keys[1])
    store.delete(keys[0])
    assert store.get(keys[0]) is None
    assert store.stats().hits >= 3 and store.stats().misses >= 2


def test_node_index_maps_user_ids_to_content_keys(store):
    a, b = content_key("a"), content_key("b")
    store.link(["node-1", "doc/../../x"], [a, b])
    assert store.resolve(["node-1", "doc/../../x", "nope"]) == [a, b, None]
    store.link(["node-1"], [b])  # the text behind node-1 changed: it now names another entry
    assert store.resolve(["node-1"]) == [b]


def test_int8_storage_is_within_its_bound_and_halves_bf16_bytes():
    e = entry(torch.bfloat16, tokens=64, head_dim=64)  # a real model's head size
    plain, packed = encode_entry(e), encode_entry(e, quantize=True)
    assert len(packed) < 0.6 * len(plain)
    back = decode_entry(packed)
    assert back.keys.dtype == torch.bfloat16
    k, v = e.keys.float(), e.values.float()
    # keys per channel (over tokens), values per token (over channels): |err| <= max|group| / 254
    k_bound = k.abs().amax(dim=2, keepdim=True) / 254
    v_bound = v.abs().amax(dim=3, keepdim=True) / 254
    slack = 1e-2 * k.abs().amax()  # the final rounding back to bf16
    assert ((back.keys.float() - k).abs() <= k_bound + slack).all()
    assert ((back.values.float() - v).abs() <= v_bound + slack).all()
    assert (back.keys.float() - k).abs().max() > 0  # it is lossy, as documented


def test_disk_int8_url_flag(tmp_path):
    store = open_store(f"disk://{tmp_path}?quantize=int8")
    store.put(content_key("q"), entry())
    assert (store.get(content_key("q")).keys - entry().keys).abs().max() < 0.1


@needs_redis
def test_redis_splits_large_entries(redis_server):
    store = open_store(redis_server.url + "?part_bytes=300")
    e = entry(tokens=20)
    key = content_key("big")
    store.put(key, e)
    raw = store.client.keys(f"kvrag:{{{key}}}*")
    assert len(raw) > 3  # manifest + several parts
    got = store.get(key)
    assert torch.equal(got.keys, e.keys) and torch.equal(got.values, e.values)
    store.client.delete(f"kvrag:{{{key}}}:p2")  # a lost part is a miss, never a wrong entry
    assert store.get(key) is None
    store.delete(key)
    assert store.client.keys(f"kvrag:{{{key}}}*") == []


@needs_redis
def test_redis_ttl(redis_server):
    store = open_store(redis_server.url + "?ttl=1")
    store.put(content_key("t"), entry())
    assert store.get(content_key("t")) is not None
    time.sleep(1.3)
    assert store.get(content_key("t")) is None


@needs_redis
def test_redis_down_is_a_fast_miss_then_recovers(redis_server, caplog):
    store = open_store(redis_server.url)
    key = content_key("k")
    store.put(key, entry())
    redis_server.stop()
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
        store.put(key, entry())  # skipped, no exception
        assert store.get(key) is None
    assert sum("unreachable" in r.message for r in caplog.records) == 1  # warned once per outage
    assert not store.available
    redis_server.start()
    time.sleep(1.1)  # past the first back-off
    store.put(key, entry())
    assert store.get(key) is not None


def _writer(root, seed):
    store = DiskStore(root)
    for i in range(20):
        store.put(content_key("shared"), entry(seed=0))
        store.put(content_key(f"own-{seed}-{i}"), entry(seed=seed))


def test_disk_concurrent_writers(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s)) for s in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)  # spawned processes import torch: slow on a loaded machine
        assert p.exitcode == 0
    store = DiskStore(tmp_path)
    assert torch.equal(store.get(content_key("shared")).keys, entry(seed=0).keys)
    for s in range(4):
        for i in range(20):
            assert torch.equal(store.get(content_key(f"own-{s}-{i}")).values, entry(seed=s).values)
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # no temp files left behind
    assert store.stats().errors == 0


def test_disk_truncated_and_garbage_files_are_misses_and_deleted(tmp_path):
    store = DiskStore(tmp_path)
    for name, mangle in [("trunc", lambda b: b[: len(b) // 2]), ("garbage", lambda b: os.urandom(len(b)))]:
        key = content_key(name)
        store.put(key, entry())
        path = store._path(key)
        path.write_bytes(mangle(path.read_bytes()))
        assert store.get(key) is None
        assert not path.exists()
    assert store.stats().errors == 2


def test_disk_size_cap_evicts_least_recently_used(tmp_path):
    one = len(encode_entry(entry()))
    store = DiskStore(tmp_path, max_bytes=int(3.5 * one))
    keys = [content_key(str(i)) for i in range(5)]
    for i, k in enumerate(keys[:3]):
        store.put(k, entry())
        t = time.time() - 100 + i
        os.utime(store._path(k), (t, t))
    store.get(keys[0])  # used recently: kept
    store.put(keys[3], entry())
    store.put(keys[4], entry())
    assert store.contains(keys[0]) and store.contains(keys[4])
    assert not store.contains(keys[1])
    assert store._scan_size() <= 3.5 * one and store.stats().evictions >= 1


def test_tiered_prefetch_loads_in_the_background(tmp_path):
    lower = DiskStore(tmp_path)
    keys = [content_key(str(i)) for i in range(4)]
    for k in keys:
        lower.put(k, entry())
    tiered = TieredStore(lower)
    tiered.prefetch(keys)
    deadline = time.time() + 5
    while not all(tiered.upper.contains(k) for k in keys) and time.time() < deadline:
        time.sleep(0.01)
    assert all(tiered.upper.contains(k) for k in keys)
    reads = lower.stats().hits
    got = tiered.get_many(keys)
    assert all(torch.equal(g.keys, entry().keys) for g in got)
    assert lower.stats().hits == reads  # served from memory
    assert tiered.stats().prefetched == 4


# -- the engine over real stores ------------------------------------------------------------------
CHUNKS = [Chunk("a", "The cat sat on the mat."), Chunk("b", "Volcanoes erupt lava and ash.")]


def tiny_rag(store):
    return KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=store)


@needs_redis
def test_engine_keeps_serving_when_redis_dies_mid_run(redis_server):
    rag = tiny_rag(redis_server.url)
    rag.precompute(CHUNKS, progress=False)
    ok = rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert ok.stats.cache_hits == 2
    redis_server.stop()
    down = rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert down.stats.cache_misses == 2 and down.stats.chunk_prefill_tokens > 0
    assert down.text == ok.text
    redis_server.start()  # an empty server: the next answers refill it
    time.sleep(1.1)
    rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    again = rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert again.stats.cache_hits == 2 and again.text == ok.text


def test_engine_recomputes_a_corrupt_entry(tmp_path):
    rag = tiny_rag(f"disk://{tmp_path}")
    rag.precompute(CHUNKS, progress=False)
    key = rag._resolve(CHUNKS[:1]).keys[0]
    path = rag.store._path(key)
    path.write_bytes(path.read_bytes()[:-10])
    out = rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=2)
    assert out.stats.cache_misses == 1 and out.stats.cache_hits == 1
    assert rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=2).stats.cache_hits == 2


def test_ids_resolve_through_the_store_and_changed_text_is_a_miss(tmp_path):
    url = f"disk://{tmp_path}"
    first = tiny_rag(url)
    first.precompute(CHUNKS, progress=False)
    ref = first.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    other = tiny_rag(url)  # another worker: knows no chunk texts, only the shared store
    out = other.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert out.stats.cache_hits == 2 and out.stats.chunk_prefill_tokens == 0 and out.text == ref.text
    first.register([Chunk("a", "The dog slept by the fire.")])  # new text under the same id
    with pytest.raises(ChunkNotFoundError):  # the other worker never gets the stale KV
        other.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    changed = first.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert changed.stats.cache_misses == 1 and changed.stats.cache_hits == 1
    now = other.answer("What did the cat do?", ["a", "b"], max_new_tokens=3)
    assert now.stats.cache_hits == 2 and "dog" in other.prefill("Q?", ["a"]).chunks[0].text
