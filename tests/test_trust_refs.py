"""Issue #53, part one: the id index is as hard as the entries (each test failed before the fix).

A FIFO at an id's ref file hung every reader (the server, `kvrag store stats`); a symlink to /dev/zero
there read without end; a symlinked shard folder under entries/ took writes outside the store, past
its cap. Refs are now read like entries (no symlink, non-blocking, regular files only, a size bound),
the admin commands never block on a special file, and writes refuse symlinked shard folders.
"""

import json
import logging
import os
import threading
import time
import tracemalloc

import pytest

from kvrag.cache_backends import KEY_ENV, DiskStore, content_key
from kvrag.cache_backends.base import user_id_digest
from kvrag.cache_backends.redis_store import RedisStore
from kvrag.cli.app import main
from test_backends import REDIS, RedisServer, entry

UID = "3fa2c1d0e4b5a697/doc-1"  # "<namespace>/<id>", as the engine links ids


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


HANG_GUARD_S = 120  # far above any run's time: only a call blocked for good (a FIFO or device opened blocking) reaches it


def not_hung(fn, *args):
    """fn(*args) in a thread, and its result. A hang guard, not a timing: a ref that blocks its reader
    (a FIFO with no writer) blocks forever, so the test fails instead of hanging the whole suite."""
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn(*args)), daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} blocked (a ref opened blocking?)")
    return box.get("r")


def ref_path(root, uid=UID):
    d = user_id_digest(uid)
    p = root / "index" / d[:2] / f"{d}.ref"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


@pytest.mark.parametrize("plant", ["fifo", "dev-zero", "sparse", "folder"])
def test_a_bad_ref_is_a_fast_logged_miss(tmp_path, caplog, plant):
    store = DiskStore(tmp_path)
    p = ref_path(tmp_path)
    if plant == "fifo":
        os.mkfifo(p)
    elif plant == "dev-zero":
        os.symlink("/dev/zero", p)
    elif plant == "sparse":
        with open(p, "wb") as f:
            f.truncate(1 << 30)  # 1 GiB of apparent size
    else:
        p.mkdir()
    tracemalloc.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert not_hung(store.resolve, [UID]) == [None]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - t0 < 1 and peak < 1 << 20
    assert "id ref" in caplog.text and store.stats().bad_refs == 1


def test_a_ref_in_a_symlinked_shard_folder_is_a_miss_and_links_are_refused_there(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = DiskStore(tmp_path / "kv")
    d = user_id_digest(UID)
    (outside / f"{d}.ref").write_text(content_key("x"))
    os.symlink(outside, tmp_path / "kv" / "index" / d[:2])
    assert store.resolve([UID]) == [None]
    with caplog.at_level(logging.WARNING):
        store.link([UID], [content_key("y")])
    assert "symlink" in caplog.text
    assert (outside / f"{d}.ref").read_text() == content_key("x")  # nothing written outside


def test_writes_refuse_a_symlinked_shard_folder_and_the_cap_holds(tmp_path, caplog):
    """40 entries, 5.3 MB went through a symlinked shard under a 200 kB cap, 0 evictions."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "kv"
    store = DiskStore(root, max_bytes=200_000)
    keys = [content_key(f"k{i}") for i in range(40)]
    for shard in {k[:2] for k in keys}:
        os.symlink(outside, root / "entries" / shard)
    with caplog.at_level(logging.WARNING):
        for k in keys:
            store.put(k, entry(tokens=600))  # ~130 kB each
    assert "write refused" in caplog.text
    assert not any(outside.rglob("*"))  # nothing landed outside the store
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink()) <= 200_000
    assert all(store.get(k) is None for k in keys[:3])


def test_the_admin_commands_never_block_on_special_files_and_gc_removes_them(tmp_path, capsys):
    store = DiskStore(tmp_path)
    key = content_key("a")
    store.put(key, entry())
    store.link(["ns/good"], [key])
    os.mkfifo(ref_path(tmp_path, "ns/fifo"))
    os.symlink("/dev/zero", ref_path(tmp_path, "ns/zero"))
    fake = content_key("fifo-entry")
    (tmp_path / "entries" / fake[:2] / fake[2:4]).mkdir(parents=True)
    os.mkfifo(tmp_path / "entries" / fake[:2] / fake[2:4] / f"{fake}.kv")
    url = f"disk://{tmp_path}"
    for cmd in (["store", "stats", "--json"], ["store", "ls", "--json"], ["store", "gc", "--dry-run", "--json"]):
        assert not_hung(main, [*cmd, "--store", url]) == 0
    out = capsys.readouterr().out.splitlines()
    stats, plan = json.loads(out[0]), json.loads(out[2])
    assert stats["bad_links"] == 2 and stats["entries"] == 1
    assert len(plan["dangling_links"]) == 2 and all("ref" in n for n in plan["dangling_links"])
    assert not_hung(main, ["store", "gc", "--store", url]) == 0
    assert not os.path.lexists(ref_path(tmp_path, "ns/fifo")) and not os.path.lexists(ref_path(tmp_path, "ns/zero"))
    assert os.path.exists("/dev/zero") and store.resolve(["ns/good"]) == [key]


def test_the_engine_answers_an_unknown_id_with_a_fifo_ref_quickly(tmp_path):
    from kvrag import KVRag, from_model
    from kvrag.errors import ChunkNotFoundError
    from tiny import tiny_model, tiny_tokenizer

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=f"disk://{tmp_path}")
    os.mkfifo(ref_path(tmp_path, f"{rag.repo.namespace}/elsewhere"))

    def ask():
        with pytest.raises(ChunkNotFoundError):
            rag.prefill("What?", ["elsewhere"], method="reuse")
        return True

    assert not_hung(ask)


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")
def test_a_redis_id_value_that_is_no_ref_is_a_counted_miss():
    server = RedisServer()
    server.start()
    try:
        store = RedisStore(server.url, key="")
        store.client.hset("kvrag:index", UID, b"x" * 10_000_000)
        store.client.hset("kvrag:index", "ns/junk", b"not a key")
        assert store.resolve([UID, "ns/junk"]) == [None, None]
        assert store.stats().bad_refs == 2
    finally:
        server.stop()
