"""Issue 69, findings 2 and 3: a Chroma writer without the store key could replay old signed entries
(after a replace, re-adding the old entry made retrieval answer the old text; after a delete it brought the
chunk back) and steer without forging (a signed entry's vector moved onto another question's was
retrieved first; five unsigned decoys at the question's vector took top-k slots and were not replaced).
Now, with a key, an entry is answered only where the store binds its id to its text, its vector must be the
one signed with it, and skipped entries are replaced by the next-ranked good ones. Real `chroma run`, real
HTTP; a tiny random model (the mechanics)."""

from __future__ import annotations


import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from chroma_server import ChromaServer  # noqa: E402
from kvrag.cache_backends import KEY_ENV  # noqa: E402
from kvrag.ingest import index_guard  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex, query_vector  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from kvrag.server import bindings  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

QUESTION = "When did the Quillon Bridge open?"
OLD = {"id": "bridge", "text": "The Quillon Bridge opened in 1893, built by the city.", "title": "Quillon Bridge"}
NEW = {**OLD, "text": "The Quillon Bridge opened in 1911, rebuilt by the city."}
FACTS = [{"id": f"f{i}", "text": f"Quillon Bridge fact {i}: the bridge has {i + 2} arches and spans the river.",
          "title": f"Bridge fact {i}"} for i in range(6)]
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "round4-key")
    chroma = ChromaServer(tmp_path / "chroma").start()
    index = ChunkIndex(url=chroma.url())
    try:
        with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live, \
                httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
            yield index, http
    finally:
        chroma.stop()


def _raw(index: ChunkIndex, chunk_id: str) -> dict:
    """An entry as a Chroma writer sees it (what it can copy and put back later)."""
    got = index._collection.get(ids=[chunk_id], include=["documents", "metadatas", "embeddings"])
    return {"ids": got["ids"], "documents": got["documents"], "metadatas": got["metadatas"],
            "embeddings": [[float(x) for x in got["embeddings"][0]]]}


def _sources(http: httpx.Client, question: str = QUESTION, **kvrag) -> dict:
    r = http.post("/v1/chat/completions", json=chat(question, kvrag=kvrag or None))
    assert r.status_code == 200, r.text
    return r.json()


def _ids(body: dict) -> list[str]:
    return [s["id"] for s in body["kvrag_sources"]]


def _unverified(http: httpx.Client) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("kvrag_index_unverified_entries "))
    return float(line.split()[1])


def test_an_old_version_replayed_after_a_replace_is_skipped(served):
    index, http = served
    assert http.post("/v1/chunks", json={"chunks": [OLD, OWL]}).status_code == 200
    old = _raw(index, "bridge")
    r = http.post("/v1/chunks", json={"chunks": [NEW], "replace": True})
    assert r.status_code == 200, r.text
    assert "bridge" in _ids(_sources(http))
    before = _unverified(http)
    index._collection.upsert(**old)  # the replay: a genuine, signed, older entry
    assert [c.text for c in index.get(["bridge"], bound=False)] == [OLD["text"]]  # its MAC is sound: only the store can tell
    assert index.get(["bridge"]) == []  # by id (what recovery and the by-id judge read): not the bound text
    assert "bridge" not in _ids(_sources(http))  # never the old text (1893) answered
    assert {"id": "bridge", "reason": bindings.STALE} in index_guard.last_skipped() or _unverified(http) > before
    assert _unverified(http) > before  # counted
    assert [c.id for c in index.query(QUESTION, k=2)] == ["owl"] and index.last_skipped() == [{"id": "bridge", "reason": bindings.STALE}]
    # the writer posts its text again: the index holds the current version, answered again
    assert http.post("/v1/chunks", json={"chunks": [NEW], "replace": True}).status_code == 200
    assert "bridge" in _ids(_sources(http))


def test_a_deleted_entry_re_added_does_not_come_back(served):
    index, http = served
    assert http.post("/v1/chunks", json={"chunks": [OLD, OWL]}).status_code == 200
    old = _raw(index, "bridge")
    assert http.delete("/v1/chunks/bridge").status_code == 200
    index._collection.upsert(**old)  # resurrected in the index
    assert "bridge" not in _ids(_sources(http))
    assert [c.id for c in index.query(QUESTION, k=2)] == ["owl"] and index.last_skipped() == [{"id": "bridge", "reason": bindings.UNBOUND}]
    assert http.post("/v1/chat/completions", json=chat(QUESTION, kvrag={"chunk_ids": ["bridge"]})).status_code == 400  # by id too


def test_a_moved_vector_does_not_steer(served):
    index, http = served
    assert http.post("/v1/chunks", json={"chunks": [OLD, OWL]}).status_code == 200
    owl = _raw(index, "owl")
    owl["embeddings"] = [list(query_vector(QUESTION))]  # the owl entry moved onto the bridge question
    index._collection.upsert(**owl)
    body = _sources(http)
    assert "owl" not in _ids(body) and _ids(body)[0] == "bridge"
    assert [c.id for c in index.query(QUESTION, k=1)] == ["bridge"]
    assert index.last_skipped() == [{"id": "owl", "reason": index_guard.MOVED}]


def test_five_unsigned_decoys_are_replaced_by_the_next_good_entries(served):
    index, http = served
    for part in (FACTS[:3], FACTS[3:]):  # the server's --max-chunks is 4
        assert http.post("/v1/chunks", json={"chunks": part}).status_code == 200
    vector = list(query_vector(QUESTION))
    index._collection.upsert(ids=[f"decoy{i}" for i in range(5)], embeddings=[vector] * 5,
                             documents=[f"The Quillon Bridge opened in 14{i}2." for i in range(5)],
                             metadatas=[{"title": "Quillon Bridge", "source_name": "decoy.md"}] * 5)
    body = _sources(http, top_k=4)
    assert len(_ids(body)) == 4 and all(i.startswith("f") for i in _ids(body))  # 4 of 4, none a decoy
    found = index.query(QUESTION, k=5)
    assert [c.id for c in found] and all(c.id.startswith("f") for c in found) and len(found) == 5
    assert sorted(s["id"] for s in index.last_skipped()) == [f"decoy{i}" for i in range(5)]
    assert all(s["reason"] == index_guard.NO_MAC for s in index.last_skipped())


def test_every_skip_is_named_in_kvrag_dropped(served):
    index, http = served
    for part in (FACTS[:3], FACTS[3:]):  # the server's --max-chunks is 4
        assert http.post("/v1/chunks", json={"chunks": part}).status_code == 200
    index._collection.upsert(ids=["decoy"], embeddings=[list(query_vector(QUESTION))], documents=["A decoy."],
                             metadatas=[{"title": "Decoy"}])
    body = _sources(http, top_k=4)
    assert {"id": "decoy", "reason": index_guard.NO_MAC} in body.get("kvrag_dropped", [])


def test_without_a_key_the_deeper_query_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    from kvrag.types import Chunk

    index = ChunkIndex(tmp_path / "idx", key="")
    index.add([Chunk(f["id"], f["text"], f["title"]) for f in FACTS])
    assert len(index.query(QUESTION, k=3)) == 3 and index.last_skipped() == []
