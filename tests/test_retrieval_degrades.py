"""Retrieval degrades, never refuses. One bad entry in the shared index (empty text, a 60k-character
document, a 20k-character title) gave every request that retrieved it a 400 ("chunk 'garbage' has no
text", context_length_exceeded) on every replica, blaming the client; so did two long chunks a write key
posted. Now such an entry is skipped and logged, the lowest-ranked chunks are dropped until the rest fit
the context, and the response's `kvrag_dropped` names each with its reason. Real HTTP, a real chroma
index, a tiny random model (the mechanics)."""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag import KVRag, from_model  # noqa: E402
from tiny import tiny_model, tiny_tokenizer  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, sse_events  # noqa: E402

QUESTION = "When do owls hunt at night?"
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}


@pytest.fixture
def served(tmp_path):
    index = ChunkIndex(tmp_path / "chroma")
    # titles in the prompt (the default layout leaves them out): a 20k-character one must not fit
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", layout={"chunk_template": "{title}\n{text}\n"})
    with LiveServer(create_app(rag, SETTINGS, index)) as live, httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        assert http.post("/v1/chunks", json={"chunks": [OWL]}).status_code == 200
        yield http, index, rag


def _plant(index: ChunkIndex, chunk_id: str, text: str, title: str = "") -> None:
    """What anyone who can write to the index can do: an entry beside the owl, found by the same question."""
    coll = index._collection
    vector = coll.get(ids=["owl"], include=["embeddings"])["embeddings"][0]
    coll.upsert(ids=[chunk_id], embeddings=[list(vector)], documents=[text], metadatas=[{"title": title}])


@pytest.mark.parametrize("bad", ["empty", "oversized text", "oversized title"])
def test_a_bad_index_entry_is_skipped_and_named_not_a_400(served, bad, caplog):
    http, index, _ = served
    text, title = {"empty": ("", ""), "oversized text": ("x " * 30_000, ""), "oversized title": ("short", "T" * 20_000)}[bad]
    _plant(index, "garbage", text, title)
    with caplog.at_level(logging.WARNING, logger="kvrag.server"):
        r = http.post("/v1/chat/completions", json=chat(QUESTION))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [s["id"] for s in body["kvrag_sources"]] == ["owl"]
    assert [d["id"] for d in body["kvrag_dropped"]] == ["garbage"] and body["kvrag_dropped"][0]["reason"]
    assert "'garbage'" in caplog.text
    with http.stream("POST", "/v1/chat/completions", json=chat(QUESTION, stream=True)) as s:
        events = [e for e in sse_events(s) if e != "[DONE]"]
    assert events[0]["kvrag_dropped"] == body["kvrag_dropped"] == events[-1]["kvrag_dropped"]


def test_chunks_that_do_not_fit_together_lose_the_lowest_ranked(served):
    http, index, rag = served
    room = rag.lm.max_context // 2 + 200  # each fits alone, two do not (byte-level tokens: one per character)
    longs = [{"id": f"long-{i}", "text": f"Owls{i} hunt at night. " + "owl " * (room // 4), "title": ""} for i in range(2)]
    assert http.post("/v1/chunks", json={"chunks": longs}).status_code == 200  # a write key may post them
    order = [c.id for c in index.query(QUESTION, k=5)]
    r = http.post("/v1/chat/completions", json=chat(QUESTION))
    assert r.status_code == 200, r.text
    kept, dropped = [s["id"] for s in r.json()["kvrag_sources"]], [d["id"] for d in r.json()["kvrag_dropped"]]
    assert sorted(kept + dropped) == sorted(order) and dropped and "did not fit" in r.json()["kvrag_dropped"][0]["reason"]
    assert max(order.index(i) for i in kept) < min(order.index(i) for i in dropped)  # the lowest-ranked went
    assert json.loads(r.headers["x-kvrag-sources"]) == kept


def test_a_clients_own_oversized_chunk_is_still_its_400(served):
    http, _, rag = served
    big = {"id": "mine", "text": "x " * rag.lm.max_context}
    r = http.post("/v1/chat/completions", json=chat(QUESTION, kvrag={"chunks": [big]}))
    assert r.status_code in (400, 413) and "kvrag_dropped" not in r.text


def test_kvrag_top_k_is_capped_at_max_chunks(served):
    http, _, _ = served
    more = [{"id": f"owl-{i}", "text": f"Owls of kind {i} hunt at night.", "title": "Owls"} for i in range(6)]
    assert http.post("/v1/chunks", json={"chunks": more[:3]}).status_code == 200
    assert http.post("/v1/chunks", json={"chunks": more[3:]}).status_code == 200
    r = http.post("/v1/chat/completions", json=chat(QUESTION, kvrag={"top_k": 10_000}))
    assert r.status_code == 200 and len(r.json()["kvrag_sources"]) == SETTINGS.max_chunks == 4
    assert http.post("/v1/chat/completions", json=chat(QUESTION, kvrag={"top_k": 10**9})).status_code == 400
