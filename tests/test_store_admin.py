"""`kvrag store stats|ls|rm|gc` on real stores: a temporary disk store and a real redis-server,
filled by a tiny engine, then inspected, pruned and repaired without loading any model."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import time
from pathlib import Path

import pytest

from kvrag import Chunk, KVRag
from kvrag.cache_backends import DiskStore, StoreError, content_key, open_store
from kvrag.errors import ChunkNotFoundError
from kvrag.model.loading import from_model
from kvrag.cache_backends.admin import gc, list_entries, namespace_of, open_admin, remove, store_stats
from kvrag.cli.store import add_store_parser, cmd_store
from test_backends import REDIS, RedisServer, entry, needs_redis
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [Chunk("a", "The cat sat on the mat."), Chunk("b", "Volcanoes erupt lava and ash.")]
OLD = time.time() - 7200  # older than the default --min-age of an hour


@pytest.fixture(scope="module")
def lm():
    return from_model(tiny_model("llama"), tiny_tokenizer())


def filled(lm, url: str) -> KVRag:
    rag = KVRag(lm, store=url)
    rag.precompute(CHUNKS, progress=False)
    return rag


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrag")
    add_store_parser(p.add_subparsers(dest="command"))
    return p


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cmd_store(parser().parse_args(["store", *argv]))
    out = capsys.readouterr()
    return code, out.out, out.err


# -- disk ---------------------------------------------------------------------------------------
def test_stats_and_ls_read_headers_of_what_the_engine_wrote(lm, tmp_path, capsys):
    url = f"disk://{tmp_path}?max_bytes=1e9"
    rag = filled(lm, url)
    st = store_stats(open_admin(url))
    assert st["entries"] == 3 and st["by_kind"].keys() == {"chunk", "prefix"}  # two chunks and the system prefix
    assert st["by_kind"]["chunk"]["entries"] == 2
    assert list(st["by_model"]) == [lm.fingerprint] and list(st["by_layout"]) == [rag.layout.identity]
    assert list(st["by_namespace"]) == [rag.repo.namespace] == [namespace_of(lm.fingerprint, rag.layout.identity)]
    files = list((tmp_path / "entries").rglob("*.kv"))
    assert st["bytes"] == sum(f.stat().st_size for f in files)
    assert st["cap"]["max_bytes"] == 10**9 and st["index_links"] == 2 and st["temp_files"] == 0
    assert 0 <= st["newest_age_s"] <= st["oldest_age_s"] < 600

    rows = list_entries(open_admin(url), kind="chunk")
    keys = set(rag._resolve(CHUNKS).keys)
    assert {r["key"] for r in rows} == keys
    assert sorted(int(r["meta"]["tokens"]) for r in rows) == sorted(len(rag.layout.chunk_ids(c)) for c in CHUNKS)
    assert len(list_entries(open_admin(url), limit=1)) == 1
    assert list_entries(open_admin(url), model="ffff" if not lm.fingerprint.startswith("ffff") else "0000") == []

    code, out, _ = run(capsys, "ls", "--store", url, "--kind", "chunk")
    assert code == 0 and len(out.strip().splitlines()) == 3 and all(k[:16] in out for k in keys)
    code, out, _ = run(capsys, "stats", "--store", url, "--json")
    assert json.loads(out)["entries"] == 3
    code, out, _ = run(capsys, "stats", "--store", url)
    assert "entries    3" in out and "prefix" in out and rag.repo.namespace in out


def test_rm_by_id_key_and_dry_run(lm, tmp_path, capsys):
    url = f"disk://{tmp_path}"
    rag = filled(lm, url)
    key_a, key_b = rag._resolve(CHUNKS).keys
    dry = remove(open_admin(url), ids=["a"], dry_run=True)
    assert dry["entries_deleted"] == [key_a] and dry["links_removed"] == [f"{rag.repo.namespace}/a"]
    assert rag.store.contains(key_a) and rag.store.resolve([f"{rag.repo.namespace}/a"]) == [key_a]

    code, out, _ = run(capsys, "rm", "--store", url, "--id", "a", "--id", "nope")
    assert code == 0 and "deleted 1 entries" in out
    assert not rag.store.contains(key_a) and rag.store.resolve([f"{rag.repo.namespace}/a"]) == [None]
    other = KVRag(lm, store=url)  # a worker that knows ids only through the store
    with pytest.raises(ChunkNotFoundError):
        other.answer("What?", ["a"], max_new_tokens=1)
    assert other.answer("What?", ["b"], max_new_tokens=1).stats.cache_hits == 1

    code, _, err = run(capsys, "rm", "--store", url, key_b[:12])  # a unique key prefix, as `ls` shows it
    assert code == 0 and not rag.store.contains(key_b)
    code, _, err = run(capsys, "rm", "--store", url, "--id", "a")
    assert code == 1 and "not found: a" in err
    with pytest.raises(StoreError, match="8\\+ hex"):
        remove(open_admin(url), keys=["abc"])


def test_rm_id_in_every_namespace_or_one(lm, tmp_path):
    url = f"disk://{tmp_path}"
    first = filled(lm, url)
    second = KVRag(lm, store=url, system_prompt="Answer in one word.")  # another layout: another namespace
    second.precompute(CHUNKS[:1], progress=False)
    assert first.repo.namespace != second.repo.namespace
    only = remove(open_admin(url), ids=["a"], namespace=second.repo.namespace)
    assert only["links_removed"] == [f"{second.repo.namespace}/a"]
    assert first.store.resolve([f"{first.repo.namespace}/a"]) != [None]
    both = remove(open_admin(url), ids=["a", "b"])
    assert set(both["namespaces_searched"]) == {first.repo.namespace, second.repo.namespace}
    assert both["links_removed"] == [f"{first.repo.namespace}/a", f"{first.repo.namespace}/b"]


def _stale_copy(data: bytes) -> bytes:
    assert data.count(b'"format":"3"') == 1
    return data.replace(b'"format":"3"', b'"format":"2"')


def test_gc_temp_files_bad_entries_and_dangling_links(lm, tmp_path, capsys):
    url = f"disk://{tmp_path}"
    rag = filled(lm, url)
    store: DiskStore = rag.store
    key_a, key_b = rag._resolve(CHUNKS).keys
    shard = store._path(key_a).parent
    stale_tmp, fresh_tmp = shard / ".tmp-dead", shard / ".tmp-live"
    stale_tmp.write_bytes(b"x" * 100)
    os.utime(stale_tmp, (OLD, OLD))
    fresh_tmp.write_bytes(b"y" * 10)
    # a flipped data byte (only a checksum finds it), an old-format entry, a dangling link
    path_b = store._path(key_b)
    data = bytearray(path_b.read_bytes())
    data[-3] ^= 0xFF
    path_b.write_bytes(bytes(data))
    old_key = content_key("old-format")
    store._path(old_key).parent.mkdir(parents=True, exist_ok=True)
    store._path(old_key).write_bytes(_stale_copy(store._path(key_a).read_bytes()))
    store.link(["ns/gone"], [content_key("never written")])
    for ref in (tmp_path / "index").rglob("*.ref"):
        os.utime(ref, (OLD, OLD))

    st = store_stats(open_admin(url))  # opening for admin leaves the stale temp file for gc to report
    assert st["temp_files"] == 2 and st["stale_entries"] == 1 and stale_tmp.exists()
    headers_only = gc(open_admin(url), dry_run=True, verify=False)
    assert [b["key"] for b in headers_only["bad_entries"]] == [old_key]

    code, out, _ = run(capsys, "gc", "--store", url, "--dry-run", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["dry_run"]
    assert [Path(t["name"]).name for t in plan["temp_files"]] == [".tmp-dead"]
    assert {b["key"]: b["problem"].split(":")[0] for b in plan["bad_entries"]} == {key_b: "corrupt", old_key: "stale"}
    assert len(plan["dangling_links"]) == 2  # "ns/gone", and "<ns>/b" whose entry is corrupt
    assert stale_tmp.exists() and path_b.exists() and store._path(old_key).exists()

    code, out, _ = run(capsys, "gc", "--store", url)
    assert code == 0 and "deleted 1 temp files, 2 bad entries" in out
    assert not stale_tmp.exists() and fresh_tmp.exists() and not path_b.exists() and store._path(old_key).exists() is False
    assert store.resolve(["ns/gone", f"{rag.repo.namespace}/b"]) == [None, None]
    assert store.resolve([f"{rag.repo.namespace}/a"]) == [key_a]
    again = gc(open_admin(url))
    assert not (again["temp_files"] or again["bad_entries"] or again["dangling_links"])
    out = rag.answer("What did the cat do?", ["a", "b"], max_new_tokens=2)  # b is recomputed and stored again
    assert out.stats.cache_hits == 1 and out.stats.cache_misses == 1 and store.contains(key_b)


def test_young_links_survive_gc(lm, tmp_path):
    """An ingest links ids before it writes their entries: gc keeps links younger than --min-age."""
    store = DiskStore(tmp_path)
    store.link(["ns/fresh"], [content_key("being computed")])
    assert gc(open_admin(f"disk://{tmp_path}"))["dangling_links"] == []
    assert gc(open_admin(f"disk://{tmp_path}"), min_age_s=0)["dangling_links"] != []
    assert store.resolve(["ns/fresh"]) == [None]


def test_disk_store_primitives(tmp_path):
    old = tmp_path / "entries" / "ab" / "cd" / ".tmp-x"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"z")
    os.utime(old, (OLD, OLD))
    assert DiskStore(tmp_path, clean_temp=False).temp_cleaned == 0 and old.exists()
    store = DiskStore(tmp_path)
    assert store.temp_cleaned == 1 and not old.exists()
    store.link(["x", "y"], [content_key("1"), content_key("2")])
    store.unlink(["x", "never linked"])
    assert store.resolve(["x", "y"]) == [None, content_key("2")]


def test_rm_document_uses_the_retrieval_index(lm, tmp_path, monkeypatch, capsys):
    from kvrag.ingest.retrieval import ChunkIndex

    home = tmp_path / "home"
    monkeypatch.setenv("KVRAG_HOME", str(home))
    chunks = [Chunk(c.id, c.text, metadata={"source": "notes.md"}) for c in CHUNKS] + [Chunk("c", "Other text.", metadata={"source": "x.md"})]
    ChunkIndex().add(chunks)
    url = f"disk://{tmp_path / 'kv'}"
    rag = KVRag(lm, store=url)
    rag.precompute(chunks, progress=False)
    keys = rag._resolve(chunks).keys
    code, out, err = run(capsys, "rm", "--store", url, "--document", "notes.md")
    assert code == 0 and "deleted 2 entries" in out and "notes.md: 2 chunks" in out and "kvrag remove" in err
    assert [rag.store.contains(k) for k in keys] == [False, False, True]
    assert len(ChunkIndex().get(["a", "b", "c"])) == 3  # the retrieval index is left alone
    code, out, _ = run(capsys, "rm", "--store", url, "--document", "missing.md")
    assert code == 1 and "missing.md: 0 chunks" in out


# -- which stores -------------------------------------------------------------------------------
def test_other_schemes_are_a_clear_error_and_tiered_uses_its_disk_tier(lm, tmp_path, capsys):
    with pytest.raises(StoreError, match="disk://, redis://"):
        open_admin("host://")
    with pytest.raises(StoreError, match="does not exist"):
        open_admin(f"disk://{tmp_path / 'nothing here'}")
    assert not (tmp_path / "nothing here").exists()
    with pytest.raises(ValueError, match="unknown option"):
        open_admin(f"disk://{tmp_path}?colour=red")
    filled(lm, f"disk://{tmp_path}")
    admin = open_admin(f"tiered://?tiers=memory://|disk://{tmp_path}")
    assert store_stats(admin)["entries"] == 3
    assert "persistent tier" in capsys.readouterr().err
    with pytest.raises(StoreError):  # the kvrag CLI prints it as `kvrag: error: ...` (exit 2)
        run(capsys, "stats", "--store", "host://")


def test_memory_store_object(lm):
    rag = filled(lm, "memory://")
    st = store_stats(open_admin(rag.store))
    assert st["entries"] == 3 and st["index_links"] == 2 and st["by_namespace"] == {rag.repo.namespace: 3}
    res = remove(open_admin(rag.store), ids=["a"])
    assert len(res["entries_deleted"]) == 1 and rag.store.resolve([f"{rag.repo.namespace}/a"]) == [None]
    assert store_stats(open_admin("memory://"))["entries"] == 0  # a fresh process: empty


# -- the CLI's help and the README's commands ------------------------------------------------
@pytest.mark.parametrize("cmd", ["stats", "ls", "rm", "gc"])
def test_help_shows_defaults_and_an_example(cmd, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["store", cmd, "--help"])
    text = capsys.readouterr().out
    assert "(default:" in text and "example" in text and "kvrag store " + cmd in text


def test_readme_store_commands_parse():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [ln.split("#")[0].strip() for ln in re.findall(r"^kvrag store .*$", readme, re.M)]
    assert len(lines) >= 4
    for ln in lines:
        args = parser().parse_args(shlex.split(ln)[1:])
        assert args.store_command in ("stats", "ls", "rm", "gc")


# -- Redis ---------------------------------------------------------------------------------------
@pytest.fixture
def redis_url():
    if REDIS is None:
        pytest.skip("redis-server is not installed")
    s = RedisServer()
    s.start()
    yield s.url
    s.stop()


@needs_redis
def test_redis_stats_ls_rm(lm, redis_url, capsys):
    url = redis_url + "?part_bytes=8192"  # the prefix entry and chunk entries are split into parts
    rag = filled(lm, url)
    key_a, key_b = rag._resolve(CHUNKS).keys
    st = store_stats(open_admin(url))
    assert st["entries"] == 3 and st["by_kind"]["chunk"]["entries"] == 2 and st["index_links"] == 2
    assert st["by_namespace"] == {rag.repo.namespace: 3} and st["temp_files"] == 0
    assert st["unreadable_entries"] == 0 and st["oldest_age_s"] is not None
    rows = {r["key"]: r for r in list_entries(open_admin(url))}
    assert {key_a, key_b} <= set(rows)
    assert rows[key_a]["nbytes"] > 8192 and rows[key_a]["meta"]["model"] == lm.fingerprint  # read from part 1
    code, out, _ = run(capsys, "rm", "--store", url, "--id", "a", "--json")
    res = json.loads(out)
    assert code == 0 and res["entries_deleted"] == [key_a] and res["links_removed"] == [f"{rag.repo.namespace}/a"]
    assert not rag.store.contains(key_a) and rag.store.client.hget("kvrag:index", f"{rag.repo.namespace}/a") is None
    assert not rag.store.client.keys(f"kvrag:{{{key_a}}}*")  # parts deleted with their manifest


@needs_redis
def test_redis_gc(lm, redis_url, capsys):
    url = redis_url + "?part_bytes=8192"
    rag = filled(lm, url)
    client = rag.store.client
    key_a, key_b = rag._resolve(CHUNKS).keys
    orphan = f"kvrag:{{{content_key('dead writer')}}}:p1"
    client.set(orphan, b"q" * 50)
    bad_manifest = content_key("bad manifest")
    client.set(f"kvrag:{{{bad_manifest}}}", b"KVRAGPARTS\x01\x00")
    data = rag.store._read_many([key_b])[0]
    rag.store.delete(key_b)
    client.set(f"kvrag:{{{key_b}}}", data[:-1] + bytes([data[-1] ^ 1]))  # whole, flipped: only a checksum finds it
    client.hset("kvrag:index", "ns/gone", content_key("never written"))

    plan = gc(open_admin(url), dry_run=True, min_age_s=0)
    assert [t["name"] for t in plan["temp_files"]] == [orphan]
    assert {b["key"] for b in plan["bad_entries"]} == {bad_manifest, key_b}
    assert set(plan["dangling_links"]) == {"ns/gone", f"{rag.repo.namespace}/b"}
    assert client.exists(orphan, f"kvrag:{{{bad_manifest}}}", f"kvrag:{{{key_b}}}") == 3  # a dry run deletes nothing
    assert gc(open_admin(url), dry_run=True)["temp_files"] == []  # young parts may be a writer in flight

    code, out, _ = run(capsys, "gc", "--store", url, "--min-age", "0")
    assert code == 0 and "deleted 1 temp files, 2 bad entries" in out
    assert client.exists(orphan, f"kvrag:{{{bad_manifest}}}", f"kvrag:{{{key_b}}}") == 0
    assert set(client.hkeys("kvrag:index")) == {f"{rag.repo.namespace}/a".encode()}
    assert rag.store.contains(key_a)


@needs_redis
def test_redis_down_is_a_clear_error(redis_url):
    s_url = redis_url.rsplit(":", 1)[0] + ":1/0"  # nothing listens on port 1
    with pytest.raises(StoreError, match="unreachable"):
        store_stats(open_admin(s_url))


@needs_redis
def test_redis_unlink_primitive(redis_url):
    store = open_store(redis_url)
    store.link(["x", "y"], [content_key("1"), content_key("2")])
    store.unlink(["x"])
    assert store.resolve(["x", "y"]) == [None, content_key("2")]
    store.put(content_key("e"), entry())
    assert store_stats(open_admin(redis_url))["entries"] == 1


@needs_redis
def test_a_redis_db_out_of_range_is_one_line_with_the_password_hidden(redis_url, capsys):
    """Issue #37: `kvrag store stats` on db 99 printed a 58-line traceback."""
    from kvrag.cli.app import main

    host = redis_url.split("://", 1)[1].split("/", 1)[0]
    assert main(["store", "stats", "--store", f"redis://:secret@{host}/99"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "out of range" in err and "secret" not in err and "Traceback" not in err
