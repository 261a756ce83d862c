"""Redis store hardening (issue #18): bounded manifests, redacted secrets, strict URL options and
short timeouts, a lost index, and server-side rejections, each against a real redis-server."""

import logging
import os
import signal
import struct
import subprocess
import time

import pytest
import torch

from kvrag.cache_backends import content_key, open_store
from test_backends import REDIS, RedisServer, entry, free_port, needs_redis

pytestmark = needs_redis
MAGIC = b"KVRAGPARTS"


@pytest.fixture
def server():
    s = RedisServer()
    s.start()
    yield s
    if s.proc is not None and s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)  # never leave a frozen server behind
    s.stop()


def head(key: str) -> str:
    return f"kvrag:{{{key}}}"


# -- 1. manifests: every count and length bounded, a malformed one is a logged miss ----------------
BAD_MANIFESTS = {
    "truncated": MAGIC + b"\x01\x00\x00",
    "million_parts": MAGIC + struct.pack("<II", 1_000_000, 1000),
    "zero_parts": MAGIC + struct.pack("<II", 0, 0),
    "count_vs_part_bytes": MAGIC + struct.pack("<III", 5, 1000, 300),  # 1000 bytes in 300-byte parts is 4
    "huge_total": MAGIC + struct.pack("<III", 2, 3000, 2000),  # over max_entry_bytes=2000
    "trailing_junk": MAGIC + struct.pack("<III", 4, 1000, 300) + b"xx",
}


@pytest.mark.parametrize("name", sorted(BAD_MANIFESTS))
def test_malformed_manifest_is_a_fast_logged_miss_and_removed(server, caplog, name):
    store = open_store(server.url + "?part_bytes=300&max_entry_bytes=2000")
    key = content_key(name)
    store.client.set(head(key), BAD_MANIFESTS[name])
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert store.get(key) is None
    assert time.monotonic() - t0 < 1.0
    assert "corrupt" in caplog.text
    assert store.client.exists(head(key)) == 0  # removed, so the next put replaces it
    assert store.stats().errors == 1 and store.available
    store.delete(key)  # deleting a corrupt entry neither raises nor asks for a million parts


def test_parts_of_the_wrong_size_are_a_miss(server):
    store = open_store(server.url + "?part_bytes=300")
    key = content_key("sizes")
    store.put(key, entry(tokens=20))
    store.client.set(head(key) + ":p2", b"x" * 299)  # same total could never come back from this
    store.client.set(head(key) + ":p3", b"x" * 301)
    assert store.get(key) is None


def test_legacy_manifest_without_part_size_still_reads(server):
    store = open_store(server.url + "?part_bytes=300")
    key = content_key("legacy")
    e = entry(tokens=20)
    store.put(key, e)
    value = store.client.get(head(key))
    store.client.set(head(key), value[: len(MAGIC) + 8])  # what older versions wrote
    got = store.get(key)
    assert got is not None and torch.equal(got.keys, e.keys)


def test_entry_over_max_entry_bytes_is_a_logged_skip(server, caplog):
    store = open_store(server.url + "?max_entry_bytes=1000")
    key = content_key("too-big")
    with caplog.at_level(logging.WARNING):
        store.put(key, entry(tokens=20))
    assert "max_entry_bytes" in caplog.text
    assert store.client.keys("kvrag:*") == [] and store.get(key) is None


# -- 2. credentials never printed -----------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "redis://alice:S3cretPw@127.0.0.1:{port}/0",
        "redis://:S3cretPw@127.0.0.1:{port}/0?ttl=5",
        "redis://127.0.0.1:{port}/0?password=S3cretPw",
        "redis://S3cretPw@127.0.0.1:{port}/0",
    ],
)
def test_password_never_appears_in_logs_repr_or_url(caplog, url):
    url = url.format(port=free_port())  # nothing listens there
    with caplog.at_level(logging.DEBUG):
        store = open_store(url)
        assert store.get(content_key("x")) is None
        store.put(content_key("x"), entry())
    assert "unreachable" in caplog.text
    shown = caplog.text + repr(store) + str(store.url) + str(vars(store.options))
    assert "S3cretPw" not in shown and "***" in store.url
    with pytest.raises(ValueError) as err:
        open_store(url + ("&" if "?" in url else "?") + "bogus=1")
    assert "S3cretPw" not in str(err.value)


def test_password_still_authenticates(caplog):
    port = free_port()
    proc = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--requirepass", "S3cretPw"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.3)
        with caplog.at_level(logging.DEBUG):
            good = open_store(f"redis://:S3cretPw@127.0.0.1:{port}/0")
            good.put(content_key("a"), entry())
            assert good.get(content_key("a")) is not None
            assert open_store(f"redis://127.0.0.1:{port}/0?password=S3cretPw").get(content_key("a")) is not None
            wrong = open_store(f"redis://:Wr0ngPw@127.0.0.1:{port}/0")
            assert wrong.get(content_key("a")) is None
        assert "S3cretPw" not in caplog.text and "Wr0ngPw" not in caplog.text
    finally:
        proc.kill()
        proc.wait()


# -- 3. URL options: strict, with short timeouts ---------------------------------------------------
@pytest.mark.parametrize(
    "query, words",
    [
        ("socket_timout=1", ["socket_timout", "socket_timeout", "connect_timeout", "max_entry_bytes"]),
        ("socket_timeout=abc", ["socket_timeout", "abc"]),
        ("socket_timeout=-1", ["socket_timeout", "-1"]),
        ("connect_timeout=0", ["connect_timeout"]),
        ("ttl=-5", ["ttl"]),
        ("part_bytes=0", ["part_bytes"]),
        ("max_entry_bytes=1e99x", ["max_entry_bytes"]),
        ("ttl=1&ttl=2", ["ttl"]),
    ],
)
def test_bad_url_options_are_clear_errors(query, words):
    with pytest.raises(ValueError) as err:
        open_store(f"redis://127.0.0.1:1/0?{query}")
    assert all(w in str(err.value) for w in words), str(err.value)


def test_timeouts_default_short_and_come_from_the_url():
    from kvrag.cache_backends.redis_store import RedisStore

    store = RedisStore("redis://127.0.0.1:1/0")
    assert store.options.socket_timeout == 0.5 and store.options.connect_timeout == 1.0
    kw = store.client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 0.5 and kw["socket_connect_timeout"] == 1.0
    store = open_store("redis://127.0.0.1:1/0?socket_timeout=0.2&connect_timeout=0.3&ttl=9&part_bytes=1024")
    kw = store.client.connection_pool.connection_kwargs
    assert kw["socket_timeout"] == 0.2 and kw["socket_connect_timeout"] == 0.3
    assert store.ttl == 9 and store.part_bytes == 1024


def test_frozen_server_is_a_miss_within_the_read_timeout_then_recovers(server, caplog):
    store = open_store(server.url + "?socket_timeout=0.3")
    key = content_key("frozen")
    store.put(key, entry())
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING):
            t0 = time.monotonic()
            assert store.get(key) is None
            assert time.monotonic() - t0 < 0.3 + 0.7
            t0 = time.monotonic()
            assert store.get(key) is None and not store.available  # inside the back-off: no wait at all
            store.put(key, entry())
            assert time.monotonic() - t0 < 0.1
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert sum("unreachable" in r.message for r in caplog.records) == 1
    time.sleep(0.6)  # past the first back-off (0.5 s)
    got = store.get(key)
    assert got is not None and torch.equal(got.keys, entry().keys) and store.available


# -- 4. the chunk-id index survives losing its key -------------------------------------------------
def test_index_lost_to_flushall_resolves_none_then_relinks(server):
    store = open_store(server.url)
    a = content_key("a")
    store.link(["ns/node-1"], [a])
    assert store.resolve(["ns/node-1"]) == [a]
    store.client.flushall()
    assert store.resolve(["ns/node-1", "ns/other"]) == [None, None]
    store.link(["ns/node-1"], [a])
    assert store.resolve(["ns/node-1"]) == [a]


def test_index_on_a_server_restarted_empty(server):
    store = open_store(server.url)
    a = content_key("a")
    store.link(["ns/node-1"], [a])
    server.stop()
    server.start()  # same port, no data
    assert store.resolve(["ns/node-1"]) == [None]  # the stale pooled connection is replaced, no outage
    assert store.available
    store.link(["ns/node-1"], [a])
    assert store.resolve(["ns/node-1"]) == [a]


# -- 5. server-side rejections: a logged skip for writes, a miss for reads -------------------------
def test_oom_write_is_a_logged_skip_and_reads_keep_working(server, caplog):
    store = open_store(server.url + "?part_bytes=400000")
    small = content_key("small")
    store.put(small, entry())
    store.client.config_set("maxmemory-policy", "noeviction")
    store.client.config_set("maxmemory", "1mb")
    big = content_key("big")
    with caplog.at_level(logging.WARNING):
        store.put(big, entry(tokens=4000))  # ~1.5 MB in 4 parts
        store.put(big, entry(tokens=4000))
    assert "maxmemory" in caplog.text  # redis-py turns the OOM reply into OutOfMemoryError
    assert store.client.exists(head(big)) == 0  # no manifest naming parts that were refused
    assert store.get(big) is None
    assert store.get(small) is not None and store.available  # a refusal is not an outage
    assert store.stats().errors >= 1
    store.client.config_set("maxmemory", "0")
    store.put(big, entry(tokens=4000))
    assert store.get(big) is not None


def test_wrong_type_value_is_a_miss_not_an_exception(server):
    store = open_store(server.url)
    key = content_key("hash")
    store.client.hset(head(key), mapping={"a": "b"})
    assert store.get(key) is None and store.get_many([key, content_key("x")]) == [None, None]
    assert not store.contains(content_key("nope"))
    store.client.set("kvrag:index", "not a hash")
    assert store.resolve(["a"]) == [None]
    store.link(["a"], [content_key("a")])  # skipped with a warning, never raised


def test_tiered_and_unknown_store_urls_never_show_a_password():
    from kvrag.cache_backends import open_store

    store = open_store("tiered://?tiers=memory://|redis://:sekret@127.0.0.1:1/0")
    assert "sekret" not in store.url and store.url.startswith("tiered://?tiers=memory://|redis://")
    with pytest.raises(Exception) as info:
        open_store("bogus://user:sekret@host/")
    assert "sekret" not in str(info.value)
