"""An index no one can forge. With `KVRAG_STORE_KEY` set, whoever could write to Chroma still chose what
was answered and credited: `col.update(ids=[id], documents=[...])` made the replicas answer the new text
crediting the real file, and a forged entry with `source_name: "quillon.md"` was credited as that file.
Now every entry kvrag writes carries a MAC under the key over its id, text, title and source, and an
entry that fails it is skipped, counted in /metrics and named in the log (its id, never its text).
Real `chroma run`, real HTTP; a tiny random model (the mechanics)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from chroma_server import ChromaServer  # noqa: E402
from kvrag.cache_backends import KEY_ENV  # noqa: E402
from kvrag.ingest.index_trust import KEY_ENV as INDEX_KEY_ENV, MAC_FIELD, entry_mac, index_key  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from kvrag.types import Chunk  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

QUESTION = "When did the Quillon Bridge open?"
BRIDGE = {"id": "bridge", "text": "The Quillon Bridge opened in 1887, built by the city.", "title": "Quillon Bridge",
          "source": "/srv/docs/bridges.md", "source_name": "bridges.md"}
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}
FORGED = "The Quillon Bridge opened in 1492, built by pirates."


@pytest.fixture
def chroma(tmp_path):
    server = ChromaServer(tmp_path / "chroma").start()
    try:
        yield server
    finally:
        server.stop()


def _served(chroma: ChromaServer):
    index = ChunkIndex(url=chroma.url())
    live = LiveServer(create_app(tiny_rag(), SETTINGS, index))
    return index, live


def _forge(index: ChunkIndex) -> None:
    """The issue's two edits, made straight on the Chroma collection: the genuine entry's text replaced, and
    a new entry claiming a file of its own."""
    coll = index._collection
    vector = list(coll.get(ids=["bridge"], include=["embeddings"])["embeddings"][0])
    coll.update(ids=["bridge"], documents=[FORGED], embeddings=[vector])
    coll.upsert(ids=["quillon"], embeddings=[vector], documents=[FORGED],
                metadatas=[{"title": "Quillon Bridge", "source_name": "quillon.md"}])


def _asked(http: httpx.Client, question: str = QUESTION) -> dict:
    r = http.post("/v1/chat/completions", json=chat(question, kvrag={"cite": True}))
    assert r.status_code == 200, r.text
    return r.json()


def _unverified(http: httpx.Client) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("kvrag_index_unverified_entries "))
    return float(line.split()[1])


def test_a_forged_or_edited_entry_is_never_answered_nor_credited_with_a_key(chroma, monkeypatch, caplog):
    monkeypatch.setenv(KEY_ENV, "index-key-A")
    index, live = _served(chroma)
    with live, httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        assert http.post("/v1/chunks", json={"chunks": [BRIDGE, OWL]}).status_code == 200
        assert {s["id"] for s in _asked(http)["kvrag_sources"]} == {"bridge", "owl"}
        assert all(m.get(MAC_FIELD) for m in index._collection.get(include=["metadatas"])["metadatas"])
        before = _unverified(http)
        _forge(index)
        with caplog.at_level(logging.DEBUG, logger="kvrag.ingest"):
            body = _asked(http)
        assert [s["id"] for s in body["kvrag_sources"]] == ["owl"]  # the genuine entry still answers
        text = body["choices"][0]["message"]["content"]
        assert "quillon.md" not in text and "bridges.md" not in text  # nothing forged is credited
        assert _unverified(http) >= before + 2
        assert "'bridge'" in caplog.text and "'quillon'" in caplog.text and FORGED not in caplog.text
        assert [c.id for c in index.get(["bridge", "quillon", "owl"])] == ["owl"]  # by id (what recovery reads) too
        # the writer re-posts its text: the edited entry is written again, signed, and answers again
        assert http.post("/v1/chunks", json={"chunks": [BRIDGE]}).json()["indexed"] == 1
        assert {s["id"] for s in _asked(http)["kvrag_sources"]} == {"bridge", "owl"}
        # deleting the forged id removes it from the index, though it is never answered
        assert http.delete("/v1/chunks/quillon").json()["unindexed"] is True


def test_without_a_key_the_index_is_answered_as_it_is(chroma, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    index, live = _served(chroma)
    with live, httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        assert http.post("/v1/chunks", json={"chunks": [BRIDGE, OWL]}).status_code == 200
        assert not any(MAC_FIELD in (m or {}) for m in index._collection.get(include=["metadatas"])["metadatas"])
        before = _unverified(http)
        _forge(index)
        body = _asked(http)
        assert {s["id"] for s in body["kvrag_sources"]} == {"bridge", "owl", "quillon"}  # as before: the index is trusted
        assert _unverified(http) == before


def test_entries_written_without_the_key_are_skipped_until_ingested_again(tmp_path):
    chunk = Chunk(id="c1", text="Kiwis are flightless birds.", title="Kiwis", metadata={"source": "/d/kiwi.md", "source_name": "kiwi.md"})
    ChunkIndex(tmp_path / "idx", key="").add([chunk])
    keyed = ChunkIndex(tmp_path / "idx", key="key A")
    assert keyed.get(["c1"]) == [] and keyed.query("kiwi", k=3) == []
    assert ChunkIndex(tmp_path / "idx", key="key B").get(["c1"]) == []
    assert keyed.add([chunk], skip_unchanged=True) == 1  # re-ingest with the key: signed now
    assert keyed.add([chunk], skip_unchanged=True) == 0  # and then unchanged
    [back] = keyed.get(["c1"])
    assert (back.text, back.title, back.metadata.get("source_name")) == (chunk.text, chunk.title, "kiwi.md")
    assert MAC_FIELD not in back.metadata  # the MAC is the index's, never handed on as the chunk's metadata
    assert ChunkIndex(tmp_path / "idx", key="key B").get(["c1"]) == []  # another key's MAC is not this one's
    assert ChunkIndex(tmp_path / "idx", key="").get(["c1"]) == [back]  # a keyless reader reads it as before


def test_the_mac_covers_each_field_unambiguously():
    key = index_key("k")
    base = entry_mac(key, "id", "ab", {"title": "c", "source_name": "n.md", "source": "/p/n.md"})
    for chunk_id, text, meta in [
        ("id", "a", {"title": "bc", "source_name": "n.md", "source": "/p/n.md"}),  # a boundary moved
        ("id", "ab", {"title": "c", "source_name": "m.md", "source": "/p/n.md"}),  # the credited name
        ("id", "ab", {"title": "c", "source_name": "n.md", "source": "/p/m.md"}),  # the path
        ("id", "ab", {"title": "c", "source_name": "n.md"}),  # a field absent, not empty
        ("id2", "ab", {"title": "c", "source_name": "n.md", "source": "/p/n.md"}),  # another id
    ]:
        assert entry_mac(key, chunk_id, text, meta) != base
    assert entry_mac(key, "id", "ab", {"title": "c", "source_name": "n.md", "source": "/p/n.md", "other": 1}) == base
    assert INDEX_KEY_ENV == KEY_ENV
