"""Exactness invariants of the core engine on tiny random models of each architecture."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from kvrag import (
    Chunk,
    ChunkNotFoundError,
    ContextTooLongError,
    EmptyRetrievalError,
    KVRag,
    UnsupportedModelError,
    from_model,
)
from kvrag.fuse.stitch import recompute
from kvrag.options import DEFAULT_METHOD
from kvrag.methods.base import Method
from tiny import ARCHS, LLAMA3_ROPE, tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below.", title="Geology"),
    Chunk("c", "Stock markets rose today after the central bank spoke."),
    Chunk("d", "Paris is the capital of France; the Seine runs through it."),
]
IDS = [c.id for c in CHUNKS]
Q = "What did the cat do?"


def make_rag(arch="llama", seed=0, store="memory://", **kw):
    rag = KVRag(from_model(tiny_model(arch, seed=seed, **kw), tiny_tokenizer()), store=store)
    rag.precompute(CHUNKS, progress=False)
    return rag


class SelectAll(Method):
    name = "select-all"

    def select(self, ctx, budget):
        return ctx.stitched.chunk_positions()


def maxdiff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS + ["llama3-rope"])
def test_single_chunk_reuse_equals_full(arch):
    rag = make_rag("llama", rope_scaling=LLAMA3_ROPE) if arch == "llama3-rope" else make_rag(arch)
    full = rag.prefill(Q, ["a"], method="full")
    reuse = rag.prefill(Q, ["a"], method="reuse")
    assert reuse.stats.cache_hits == 1 and reuse.stats.recomputed_tokens == 0
    assert maxdiff(full.logits, reuse.logits) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS + ["llama3-rope"])
def test_several_chunks_reuse_differs_but_recompute_all_is_full(arch):
    rag = make_rag("llama", rope_scaling=LLAMA3_ROPE) if arch == "llama3-rope" else make_rag(arch)
    full = rag.prefill(Q, IDS, method="full")
    reuse = rag.prefill(Q, IDS, method="reuse")
    every = rag.prefill(Q, IDS, method=SelectAll())
    # the cross-chunk loss is real, not masked away: logits move beyond the exactness bound and
    # the reused KV of later chunks is far from what Full Attention computes
    assert maxdiff(full.logits, reuse.logits) > 2e-4
    s = len(full.segments.prefix) + len(full.segments.chunks[0])  # second chunk onwards
    assert maxdiff(full.output.cache.layers[-1].values[:, :, s:], reuse.output.cache.layers[-1].values[:, :, s:]) > 1e-3
    # ...and the shared recompute pass with every chunk token selected is exactly Full Attention
    assert every.stats.recomputed_tokens == full.segments.context_len - len(full.segments.prefix)
    assert maxdiff(full.logits, every.logits) <= 1e-4
    # the caches handed to decoding agree too, layer by layer
    for (kf, vf), (ke, ve) in zip(
        [(l.keys, l.values) for l in full.output.cache.layers], [(l.keys, l.values) for l in every.output.cache.layers]
    ):
        assert maxdiff(kf, ke) <= 1e-4 and maxdiff(vf, ve) <= 1e-4


def test_eager_attention_gives_the_same_invariants():
    rag = make_rag("llama", attn="eager")
    full = rag.prefill(Q, IDS, method="full")
    every = rag.prefill(Q, IDS, method=SelectAll())
    assert maxdiff(full.logits, every.logits) <= 1e-4


def test_stored_entries_are_never_modified_by_a_request():
    rag = make_rag()
    key = rag._resolve([CHUNKS[0]]).keys[0]
    before = rag.store.get(key).keys.clone()
    rag.prefill(Q, IDS, method=SelectAll())
    rag.prefill(Q, IDS, method="reuse")
    assert torch.equal(rag.store.get(key).keys, before)


def test_batched_precompute_matches_one_by_one():
    rag = make_rag()
    prefix = rag.prefix_kv()
    ids = [rag.layout.chunk_ids(c) for c in CHUNKS]
    batched = rag.computer.chunk_kv(prefix, ids, batch_size=4)
    single = [rag.computer.chunk_kv(prefix, [i], batch_size=1)[0] for i in ids]
    for (kb, vb), (ks, vs) in zip(batched, single):
        assert kb.shape == ks.shape
        assert maxdiff(kb, ks) <= 1e-5 and maxdiff(vb, vs) <= 1e-5


def test_second_answer_does_no_chunk_prefill(tmp_path):
    rag = KVRag(from_model(tiny_model("qwen2"), tiny_tokenizer()), store=f"disk://{tmp_path}/kv")
    first = rag.answer(Q, chunks=CHUNKS[:3], max_new_tokens=3)  # not precomputed: computed now, written back
    assert first.stats.cache_misses == 3 and first.stats.chunk_prefill_tokens > 0
    second = rag.answer(Q, IDS[:3], max_new_tokens=3)
    assert second.stats.cache_hits == 3 and second.stats.cache_misses == 0
    assert second.stats.chunk_prefill_tokens == 0 and second.stats.bytes_loaded > 0
    # a fresh engine over the same folder hits too (persistent)
    again = KVRag(from_model(tiny_model("qwen2"), tiny_tokenizer()), store=f"disk://{tmp_path}/kv")
    third = again.answer(Q, chunks=CHUNKS[:3], max_new_tokens=3)
    assert third.stats.cache_hits == 3 and third.stats.chunk_prefill_tokens == 0
    assert third.text == second.text


def test_cache_from_another_model_is_a_miss():
    shared = make_rag(seed=0).store
    other = KVRag(from_model(tiny_model("llama", seed=1), tiny_tokenizer()), store=shared)
    out = other.answer(Q, chunks=CHUNKS[:2], max_new_tokens=2)
    assert out.stats.cache_hits == 0 and out.stats.cache_misses == 2


def test_cache_from_another_system_prompt_is_a_miss():
    rag = make_rag()
    other = KVRag(rag.lm, store=rag.store, system_prompt="You are terse.")
    out = other.answer(Q, chunks=CHUNKS[:2], max_new_tokens=2)
    assert out.stats.cache_hits == 0 and out.stats.cache_misses == 2


def test_streaming_pieces_make_the_answer_and_stats_fill_in():
    rag = make_rag()
    stream = rag.stream(Q, IDS, max_new_tokens=8)
    pieces = list(stream)
    assert "".join(pieces) == stream.text
    assert 0 < stream.stats.generated_tokens <= 8 and stream.stats.method == DEFAULT_METHOD  # issue #17: the best measured fast setting


def test_stop_strings_and_max_tokens():
    rag = make_rag()
    long = rag.answer(Q, IDS, max_new_tokens=12)
    assert long.stats.generated_tokens <= 12
    if len(long.text) >= 3:
        stop = long.text[1:3]
        cut = rag.answer(Q, IDS, max_new_tokens=12, stop=[stop])
        assert stop not in cut.text
        assert long.text.startswith(cut.text)


def test_sampling_is_reproducible_with_a_seed():
    rag = make_rag()
    a = rag.answer(Q, IDS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    b = rag.answer(Q, IDS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert a.text == b.text


def test_bad_input_raises_clear_errors():
    rag = make_rag()
    with pytest.raises(EmptyRetrievalError, match="no chunks"):
        rag.answer(Q, [])
    with pytest.raises(ChunkNotFoundError, match="nope"):
        rag.answer(Q, ["a", "nope"])
    with pytest.raises(ValueError, match="question"):
        rag.answer("  ", IDS)
    with pytest.raises(ValueError, match="unknown method"):
        rag.answer(Q, IDS, method="magic")
    with pytest.raises(ValueError, match="recompute_ratio"):
        rag.answer(Q, IDS, method="reuse", recompute_ratio=1.5)
    with pytest.raises(TypeError, match="'cacheblend' has no parameter 'layr'; its parameters: layer, "):
        rag.answer(Q, IDS, method="cacheblend", layr=2)
    with pytest.raises(TypeError, match="'reuse' has no parameter 'layr'; it takes none"):  # kvlink's default rule
        rag.answer(Q, IDS, method="kvlink", layr=2)
    huge = Chunk("huge", "word " * 5000)
    with pytest.raises(ContextTooLongError, match="context is 4096"):
        rag.answer(Q, chunks=[huge])


def test_non_rope_model_is_refused():
    tok = tiny_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(UnsupportedModelError, match="rotary"):
        from_model(gpt2, tok)
