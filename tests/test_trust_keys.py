"""Issue #53, part two: the store key covers the id index, and a key never costs data (each test
failed before the fix).

With `$KVRAG_STORE_KEY` set, copying another signed entry's key into an id's ref made that id answer
with the planted text (disk ref file and Redis id hash alike). And a keyed reader deleted entries
written without the key or with another key, leaving their ids unanswerable. Now every ref carries a
MAC over (id, entry key); a keyed reader serves neither an unverified ref nor an unverified entry,
counts them, warns once, and deletes nothing; `kvrag store sign` and `kvrag store gc --unverified`
act on them on purpose.
"""

import json
import logging
import os

import pytest

from kvrag.cache_backends import KEY_ENV, DiskStore, content_key
from kvrag.cache_backends.admin import gc, open_admin
from kvrag.cache_backends.admin.signing import sign
from kvrag.cache_backends.base import user_id_digest
from kvrag.cache_backends.redis_store import RedisStore
from kvrag.cache_backends.trust import unverified_counts
from kvrag.cli.app import main
from test_backends import entry, running_redis

SECRET, OTHER = "the deployment key", "another replica's key"
GOOD, EVIL = content_key("good"), content_key("evil")
KINDS = ["disk", "redis"]


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)


@pytest.fixture(scope="module")
def redis_url():
    with running_redis() as server:
        yield server.url


class Place:
    """One disk folder or Redis database, opened by separate 'processes' with their own keys."""

    def __init__(self, kind, tmp_path, redis_url):
        self.kind, self.root = kind, tmp_path / "kv"
        self.url = f"disk://{self.root}" if kind == "disk" else redis_url
        if kind == "redis":
            RedisStore(redis_url, key="").client.flushdb()

    def open(self, key=None):
        return DiskStore(self.root, key=key or "") if self.kind == "disk" else RedisStore(self.url, key=key or "")

    def raw_ref(self, uid):
        if self.kind == "redis":
            return self.open().client.hget("kvrag:index", uid)
        d = user_id_digest(uid)
        return (self.root / "index" / d[:2] / f"{d}.ref").read_bytes()

    def plant_ref(self, uid, value: bytes):
        if self.kind == "redis":
            self.open().client.hset("kvrag:index", uid, value)
        else:
            d = user_id_digest(uid)
            (self.root / "index" / d[:2] / f"{d}.ref").write_bytes(value)


@pytest.fixture(params=KINDS)
def place(request, tmp_path):
    return Place(request.param, tmp_path, request.getfixturevalue("redis_url") if request.param == "redis" else None)


def test_a_planted_ref_never_serves_under_a_key(place):
    honest = place.open(SECRET)
    honest.put(GOOD, entry(seed=1))
    honest.put(EVIL, entry(seed=2))  # e.g. an inline chunk: stored signed, so a signed carrier is easy to make
    honest.link(["ns/a", "ns/evil"], [GOOD, EVIL])
    assert honest.resolve(["ns/a"]) == [GOOD]
    place.plant_ref("ns/a", EVIL.encode())  # the attacker pastes the other entry's key
    assert place.open(SECRET).resolve(["ns/a"]) == [None]
    place.plant_ref("ns/a", place.raw_ref("ns/evil"))  # or copies the other id's signed ref whole
    reader = place.open(SECRET)
    assert reader.resolve(["ns/a"]) == [None]
    assert reader.stats().unverified_refs == 1
    assert place.open(OTHER).resolve(["ns/evil"]) == [None]  # another key's MAC does not verify either


def test_refs_written_without_a_key_keep_working_without_one(place):
    plain = place.open()
    plain.put(GOOD, entry())
    plain.link(["ns/a"], [GOOD])
    assert place.open().resolve(["ns/a"]) == [GOOD]
    place.open(SECRET).link(["ns/b"], [GOOD])
    assert place.open().resolve(["ns/b"]) == [GOOD]  # a signed ref reads without a key too


def test_a_key_never_costs_data_and_sign_makes_it_answerable(place, caplog):
    keyless, foreign = place.open(), place.open(OTHER)
    keyless.put(GOOD, entry(seed=1))
    keyless.link(["ns/a"], [GOOD])
    foreign.put(EVIL, entry(seed=2))
    foreign.link(["ns/b"], [EVIL])
    before = unverified_counts()
    with caplog.at_level(logging.WARNING):
        reader = place.open(SECRET)  # start-up: warns once that the store holds unsigned entries
        for _ in range(3):
            assert reader.get_many([GOOD, EVIL]) == [None, None]
            assert reader.resolve(["ns/a", "ns/b"]) == [None, None]
    assert reader.stats().unverified == 6 and reader.stats().unverified_refs == 6 and reader.stats().errors == 0
    assert unverified_counts()["entries"] - before["entries"] == 6
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("carry no MAC" in w for w in warnings) == 1
    assert sum("cannot verify" in w for w in warnings) == 2  # once for entries, once for refs, not per read
    assert reader.contains(GOOD) and reader.contains(EVIL)  # nothing deleted
    assert place.open().get(GOOD) is not None and place.open(OTHER).get(EVIL) is not None  # their owners still read them

    admin = open_admin(place.open(SECRET))
    plan = sign(admin)
    assert plan["entries_signed"] == [GOOD] and len(plan["links_signed"]) == 1
    assert [b["key"] for b in plan["entries_left"]] == [EVIL]  # another key's MAC: only --include-foreign
    reader = place.open(SECRET)
    assert reader.resolve(["ns/a"]) == [GOOD] and reader.get(GOOD) is not None
    sign(admin, include_foreign=True)
    assert reader.resolve(["ns/b"]) == [EVIL] and reader.get(EVIL) is not None
    assert place.open().get(GOOD) is not None  # still readable without a key


def test_gc_keeps_unverified_data_and_removes_it_only_when_asked(place, monkeypatch):
    place.open().put(GOOD, entry())
    place.open().link(["ns/a"], [GOOD])
    monkeypatch.setenv(KEY_ENV, SECRET)
    plan = gc(open_admin(place.url), dry_run=True)
    assert plan["bad_entries"] == [] and [b["key"] for b in plan["unverified_kept"]] == [GOOD]
    assert plan["dangling_links"] == [] and len(plan["unverified_links_kept"]) == 1
    gc(open_admin(place.url))
    assert place.open().get(GOOD) is not None and place.open().resolve(["ns/a"]) == [GOOD]
    gc(open_admin(place.url), unverified=True)
    assert place.open().get(GOOD) is None and place.open().resolve(["ns/a"]) == [None]


def test_a_damaged_signed_entry_is_still_removed_by_gc(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, key=SECRET)
    store.put(GOOD, entry())
    path = store._path(GOOD)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert store.get(GOOD) is None and path.exists()  # a reader cannot tell damage from another key: kept
    monkeypatch.setenv(KEY_ENV, SECRET)
    plan = gc(open_admin(f"disk://{tmp_path}"))
    assert [b["key"] for b in plan["bad_entries"]] == [GOOD] and "corrupt" in plan["bad_entries"][0]["problem"]
    assert not path.exists()


def test_the_cli_signs_and_collects_unverified_data(tmp_path, monkeypatch, capsys):
    DiskStore(tmp_path).put(GOOD, entry())
    url = f"disk://{tmp_path}"
    assert main(["store", "sign", "--store", url]) == 2  # no key: a clear error
    assert "KVRAG_STORE_KEY" in capsys.readouterr().err
    monkeypatch.setenv(KEY_ENV, SECRET)
    assert main(["store", "stats", "--json", "--store", url]) == 0
    assert json.loads(capsys.readouterr().out)["unsigned_entries"] == 1
    assert main(["store", "gc", "--store", url]) == 0
    assert "kept 1 entries" in capsys.readouterr().out and DiskStore(tmp_path, key="").get(GOOD) is not None
    assert main(["store", "sign", "--store", url]) == 0
    assert "signed 1 entries" in capsys.readouterr().out and DiskStore(tmp_path, key=SECRET).get(GOOD) is not None
    DiskStore(tmp_path, key="").put(EVIL, entry())
    assert main(["store", "gc", "--unverified", "--store", url]) == 0
    assert not DiskStore(tmp_path, key="").contains(EVIL) and DiskStore(tmp_path, key=SECRET).get(GOOD) is not None


def test_an_id_ingested_without_the_key_answers_after_sign(tmp_path, monkeypatch):
    """The issue's reproduction through the engine: an ingest from a shell without the key, then a keyed server."""
    from kvrag import Chunk, KVRag, from_model
    from kvrag.errors import ChunkNotFoundError
    from tiny import tiny_model, tiny_tokenizer

    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    url = f"disk://{tmp_path}"
    KVRag(lm, store=url).precompute([Chunk("doc-1", "Tickets are sold at the station.")], progress=False)
    monkeypatch.setenv(KEY_ENV, SECRET)
    files = sorted(p for p in (tmp_path / "entries").rglob("*.kv"))
    with pytest.raises(ChunkNotFoundError):
        KVRag(lm, store=url).prefill("Where?", ["doc-1"], method="reuse")
    assert sorted(p for p in (tmp_path / "entries").rglob("*.kv")) == files  # nothing deleted
    sign(open_admin(url))
    assert KVRag(lm, store=url).prefill("Where?", ["doc-1"], method="reuse").stats.cache_hits == 1


def test_metrics_show_the_unverified_reads(tmp_path):
    from kvrag.server.gate import RequestGate
    from kvrag.server.metrics import ServerMetrics

    def value(text: str, name: str) -> float:
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))

    metrics = ServerMetrics(RequestGate(1, 1))
    before = metrics.render().decode()
    DiskStore(tmp_path).put(GOOD, entry())
    DiskStore(tmp_path, key=SECRET).get(GOOD)
    after = metrics.render().decode()
    assert value(after, "kvrag_store_unverified_entries") == value(before, "kvrag_store_unverified_entries") + 1
    assert "kvrag_store_unverified_refs" in after
    assert os.path.exists(DiskStore(tmp_path)._path(GOOD))
