"""A follow-up's chunks: the previous turn's first, in its order, so the exact prefix cache serves it
(kvrag.ingest.follow_up), through the library and through `kvrag serve` with an OpenAI-style history.
A real chroma index over the bundled sample, and the tiny model for the server's mechanics."""

from __future__ import annotations

import json

import pytest

from kvrag.chat import Conversation
from kvrag.ingest.follow_up import conversation_chunks, keep_order, turn_queries
from kvrag.ingest.samples import sample_questions
from kvrag.types import Chunk

QUESTIONS = [r["question"] for r in sample_questions()]
FOLLOW_UPS = ["Tell me more about it.", "Who was involved?", "When did that happen?", "Why?", "Where is it?"]
K = 5


def test_follow_ups_keep_the_previous_order_of_the_chunks_retrieved_again():
    a, b, c, d = (Chunk(id=i, text=i) for i in "abcd")
    assert [x.id for x in keep_order([b, a], ["a", "b"])] == ["a", "b"]  # the same chunks: the earlier order
    assert [x.id for x in keep_order([d, b, c, a], ["a", "b", "c"])] == ["a", "b", "c", "d"]  # new ones after
    assert [x.id for x in keep_order([d, c, b], ["a", "b", "c"])] == ["b", "c", "d"]
    assert [x.id for x in keep_order([b, a], [])] == ["b", "a"]


def test_each_user_turn_is_replayed_with_the_query_it_was_asked_with():
    conv = Conversation.of([("user", "A?"), ("assistant", "a"), ("user", "B?"), ("assistant", "b"), ("user", "C?")])
    assert turn_queries(conv) == ["A?", "A?\nB?", "B?\nC?"]
    assert turn_queries(conv, turns=1) == ["A?", "B?", "C?"]


@pytest.fixture(scope="module")
def sample_index(tmp_path_factory):
    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.ingest.samples import sample_corpus_dir

    chunks = load_documents([sample_corpus_dir()])
    index = ChunkIndex(tmp_path_factory.mktemp("follow-up") / "chroma")
    index.add(chunks)
    return index, chunks


def _shared_start(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reordered_follow_up(index) -> tuple[str, str, list[str], list[str]]:
    """The first (question, follow-up) of the sample whose fresh top-k keeps every chunk of the question's
    but ranks them anew: where a follow-up without the kept order would lose the prefix cache."""
    for q in QUESTIONS:
        first = [c.id for c in index.query(q, K)]
        for f in FOLLOW_UPS:
            fresh = [c.id for c in index.query(f"{q}\n{f}", K)]
            if set(fresh) == set(first) and fresh != first:
                return q, f, first, fresh
    raise AssertionError("no follow-up of the sample ranks its question's chunks anew")


def test_query_many_answers_as_query_does(sample_index):
    index, _ = sample_index
    qs = [QUESTIONS[0], f"{QUESTIONS[0]}\n{FOLLOW_UPS[0]}", QUESTIONS[3]]
    assert [[c.id for c in hits] for hits in index.query_many(qs, k=K)] == [[c.id for c in index.query(q, K)] for q in qs]
    assert index.query_many([], k=K) == [] and index.query_many(qs[:1], k=0) == [[]]


def test_a_follow_up_reads_the_previous_turns_chunks_first_in_their_order(sample_index):
    index, _ = sample_index
    q, f, first, fresh = reordered_follow_up(index)
    one = Conversation.ask(q)
    assert [c.id for c in conversation_chunks(index, one, k=K)] == first  # turn one: retrieval's own order
    two = one.with_answer("An answer.", f)
    assert [c.id for c in conversation_chunks(index, two, k=K)] == first  # not `fresh`: the same chunks, turn one's order
    three = two.with_answer("Another.", QUESTIONS[-1])
    got = [c.id for c in conversation_chunks(index, three, k=K)]
    now = [c.id for c in index.query(three.retrieval_query(), K)]
    assert sorted(got) == sorted(now)  # always this turn's top-k, only reordered
    kept = [i for i in first if i in now]
    assert got[: len(kept)] == kept


def test_over_the_sample_the_kept_order_shares_more_of_the_previous_start(sample_index):
    index, _ = sample_index
    raw = kept = 0
    for q in QUESTIONS:
        first = [c.id for c in index.query(q, K)]
        for f in FOLLOW_UPS:
            conv = Conversation.ask(q).with_answer("An answer.", f)
            raw += _shared_start(first, [c.id for c in index.query(conv.retrieval_query(), K)])
            kept += _shared_start(first, [c.id for c in conversation_chunks(index, conv, k=K)])
    assert kept > raw


def test_the_server_answers_a_follow_up_from_the_previous_turns_prompt(sample_index):
    """OpenAI-style history, no chunk ids: turn two's sources start with turn one's in turn one's order,
    its prompt's start comes from the prefix cache (all of turn one's prompt), and its answer is what the
    same request reads without the cache (Full Attention: exact)."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from kvrag.server import ServerSettings, create_app
    from test_server import LiveServer, tiny_rag

    index, chunks = sample_index
    q, f, first, fresh = reordered_follow_up(index)
    rag = tiny_rag()
    ctx = {"method": "full"}
    with LiveServer(create_app(rag, ServerSettings(top_k=K), index)) as live, \
            httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        m = [{"role": "user", "content": q}]
        one = http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 3, "kvrag": ctx}).json()
        m += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]}, {"role": "user", "content": f}]
        two = http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 3, "kvrag": ctx}).json()
        off = http.post("/v1/chat/completions", json={"messages": m, "max_tokens": 3, "kvrag": {**ctx, "prefix_cache": False}}).json()
    assert [s["id"] for s in one["kvrag_sources"]] == first
    assert [s["id"] for s in two["kvrag_sources"]] == first != fresh
    assert two["kvrag_stats"]["prefix_hit_tokens"] >= one["usage"]["prompt_tokens"]
    assert off["kvrag_stats"]["prefix_hit_tokens"] == 0 and [s["id"] for s in off["kvrag_sources"]] == first
    assert two["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
