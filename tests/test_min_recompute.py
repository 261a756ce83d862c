"""Issue #34: where recomputing is cheap, recompute more. Every answer recomputes at least
`min_recompute` chunk tokens, chunks holding no more (or no more than `short_context`), and chunks that
are records of one kind (`records_whole`), are read with Full Attention (over the base weights, whatever
the method), an explicit ratio 0 stays Full Reuse, and the stats say what was done."""

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.options import DEFAULT_MIN_RECOMPUTE, DEFAULT_RECORDS_WHOLE, DEFAULT_SHORT_CONTEXT, AnswerOptions
from test_methods import RECORDS  # four lamp records written to one pattern
from test_quality_options import CHUNKS, IDS, Q  # three ~90-character chunks and a question about the first
from tiny import tiny_model, tiny_tokenizer

METHODS = ["reuse", "cacheblend", "epic", "a3", "fusionrag", "samkv", "kvlink"]


@pytest.fixture(scope="module")
def rag():
    # no prefix cache: these tests ask the same prompts again and measure how the policy reads them
    # (a repeated prompt would continue from the cache: tests/test_conversation.py)
    r = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False, prefix_cache=PrefixCache(0))
    r.precompute(CHUNKS, progress=False)
    return r


def context_tokens(rag):
    return sum(len(rag.layout.chunk_ids(c)) for c in CHUNKS)


@pytest.mark.parametrize("method", METHODS)
def test_chunks_within_the_minimum_are_read_with_full_attention(rag, method):
    n = context_tokens(rag)
    full = rag.prefill(Q, IDS, method="full")
    pre = rag.prefill(Q, IDS, method=method, min_recompute=n)
    assert torch.equal(pre.logits, full.logits)  # the very same pass
    assert pre.stats.method == method and pre.stats.recomputed_tokens == n and pre.stats.recompute_ratio == 1.0
    assert f"{n} chunk tokens <= min_recompute={n}" in pre.stats.full_reason
    assert pre.stats.cache_hits == 0  # nothing was read from the store
    one_more = rag.prefill(Q, IDS, method=method, min_recompute=n - 1)  # one token short: reuse
    assert one_more.stats.full_reason == ""


@pytest.mark.parametrize("method", METHODS)
def test_contexts_within_short_context_are_read_with_full_attention(rag, method):
    n = context_tokens(rag)
    full = rag.prefill(Q, IDS, method="full")
    pre = rag.prefill(Q, IDS, method=method, short_context=n, min_recompute=0)
    assert torch.equal(pre.logits, full.logits)
    assert f"{n} chunk tokens <= short_context={n}" in pre.stats.full_reason and pre.stats.cache_hits == 0
    assert rag.prefill(Q, IDS, method=method, short_context=n - 1, min_recompute=0).stats.full_reason == ""


def test_the_minimum_raises_a_small_ratio_but_not_an_explicit_zero(rag):
    n = context_tokens(rag)
    first = len(rag.layout.chunk_ids(CHUNKS[0]))  # the first chunk's KV is exact: chosen last
    pre = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.05, min_recompute=20)
    assert pre.stats.recomputed_tokens == 20 and pre.stats.full_reason == ""
    assert pre.stats.recompute_ratio == pytest.approx(20 / n)
    off = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.05, min_recompute=0)
    assert off.stats.recomputed_tokens == max(1, round(0.05 * n)) or off.stats.recomputed_tokens < 20
    zero = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.0, min_recompute=20)
    assert zero.stats.recomputed_tokens == 0  # ratio 0 is Full Reuse, as the invariant says
    assert n - first > 20


def test_the_default_comes_from_the_environment_then_the_constant(rag, monkeypatch):
    assert AnswerOptions(min_recompute=7).min_recompute_tokens() == 7
    monkeypatch.setenv("KVRAG_MIN_RECOMPUTE", "12")
    assert AnswerOptions().min_recompute_tokens() == 12
    monkeypatch.delenv("KVRAG_MIN_RECOMPUTE")
    assert AnswerOptions().min_recompute_tokens() == DEFAULT_MIN_RECOMPUTE
    monkeypatch.setenv("KVRAG_MIN_RECOMPUTE", "lots")
    with pytest.raises(ValueError, match="KVRAG_MIN_RECOMPUTE"):
        AnswerOptions().min_recompute_tokens()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="min_recompute"):
            AnswerOptions(min_recompute=bad)
        with pytest.raises(ValueError, match="short_context"):
            AnswerOptions(short_context=bad)


def test_the_whole_read_limit_is_the_larger_of_the_two(monkeypatch):
    monkeypatch.delenv("KVRAG_MIN_RECOMPUTE")
    monkeypatch.delenv("KVRAG_SHORT_CONTEXT")
    assert AnswerOptions().full_context_tokens() == max(DEFAULT_SHORT_CONTEXT, DEFAULT_MIN_RECOMPUTE)
    assert AnswerOptions(short_context=0).full_context_tokens() == DEFAULT_MIN_RECOMPUTE
    assert AnswerOptions(short_context=0, min_recompute=0).full_context_tokens() == 0
    monkeypatch.setenv("KVRAG_SHORT_CONTEXT", "300")
    assert AnswerOptions().full_context_tokens() == 300
    monkeypatch.setenv("KVRAG_SHORT_CONTEXT", "x")
    with pytest.raises(ValueError, match="KVRAG_SHORT_CONTEXT"):
        AnswerOptions().full_context_tokens()


def test_shipped_default_reads_short_contexts_whole(rag, shipped_defaults):
    assert len(rag.layout.chunk_ids(CHUNKS[0])) <= DEFAULT_MIN_RECOMPUTE < context_tokens(rag) <= DEFAULT_SHORT_CONTEXT
    for ids in (["a"], IDS):
        out = rag.answer(Q, ids, method="reuse", max_new_tokens=4)
        assert out.stats.full_reason and out.stats.recomputed_tokens == out.stats.context_tokens
    long = rag.answer(Q, IDS, method="cacheblend", max_new_tokens=4, short_context=0)  # the minimum still holds
    assert not long.stats.full_reason and long.stats.recomputed_tokens == DEFAULT_MIN_RECOMPUTE


RECORD_IDS = [c.id for c in RECORDS]
RQ = "How much does the Faloven lamp weigh?"


@pytest.mark.parametrize("method", METHODS)
def test_records_of_one_kind_are_read_with_full_attention(rag, method):
    """Chunks written to one pattern (records of one kind) are read whole by every method unless
    records_whole=False, and the stats say why; unrelated chunks are not."""
    rag.precompute(RECORDS, progress=False)
    full = rag.prefill(RQ, RECORD_IDS, method="full")
    pre = rag.prefill(RQ, RECORD_IDS, method=method, records_whole=True)
    assert torch.equal(pre.logits, full.logits) and pre.stats.cache_hits == 0
    assert "records of one kind" in pre.stats.full_reason and pre.stats.recompute_ratio == 1.0
    assert rag.prefill(RQ, RECORD_IDS, method=method, records_whole=False).stats.full_reason == ""
    assert rag.prefill(Q, IDS, method=method, records_whole=True).stats.full_reason == ""


def test_records_whole_comes_from_the_request_then_the_environment_then_the_default(monkeypatch, shipped_defaults):
    assert AnswerOptions().records_read_whole() is DEFAULT_RECORDS_WHOLE is True
    monkeypatch.setenv("KVRAG_RECORDS_WHOLE", "0")
    assert AnswerOptions().records_read_whole() is False and AnswerOptions(records_whole=True).records_read_whole()
    monkeypatch.setenv("KVRAG_RECORDS_WHOLE", "maybe")
    with pytest.raises(ValueError, match="KVRAG_RECORDS_WHOLE"):
        AnswerOptions().records_read_whole()
    with pytest.raises(ValueError, match="records_whole"):
        AnswerOptions(records_whole="yes")


def test_shipped_default_reads_records_whole(rag, shipped_defaults):
    rag.precompute(RECORDS, progress=False)
    out = rag.answer(RQ, RECORD_IDS, method="fusionrag", max_new_tokens=4, short_context=0, min_recompute=0)
    assert "records of one kind" in out.stats.full_reason
    assert out.stats.recomputed_tokens == out.stats.context_tokens


@pytest.mark.parametrize("method", ["fusionrag", "kvlink"])
def test_the_read_whole_policy_is_decided_once_a_request(rag, method, monkeypatch):
    """The read-ahead, kvlink's routing and the pipeline share one verdict per request (kept with its
    resolved chunks), and every request decides afresh."""
    calls = []
    decide = AnswerOptions.whole_reason
    monkeypatch.setattr(AnswerOptions, "whole_reason", lambda self, *a: calls.append(1) or decide(self, *a))
    rag.precompute(RECORDS, progress=False)
    assert "records of one kind" in rag.prefill(RQ, RECORD_IDS, method=method, records_whole=True).stats.full_reason
    assert rag.prefill(RQ, RECORD_IDS, method=method, records_whole=False).stats.full_reason == ""
    assert len(calls) == 2
