"""SamKV sparsification and SnapKV eviction on tiny random models."""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.model.cache import cache_kv, fuse_by_cosine
from kvrag.methods.snapkv import SnapKV
from kvrag.methods.samkv import chunk_blocks, dynamic_top_p
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [Chunk(str(i), (f"Sentence {i} says the topic is number {i}. " * 6).strip()) for i in range(5)]
IDS = [c.id for c in CHUNKS]
Q = "Which sentence says the topic is number 3?"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def rag(request):
    r = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://")
    r.precompute(CHUNKS, progress=False)
    return r


def test_eq2_dynamic_top_p_edge_cases():
    assert dynamic_top_p(0.5, 1.0, 0.0) == pytest.approx(0.5)
    assert dynamic_top_p(1.0, 1.0, 0.0) == 0.0  # anchor at the max: nothing above it
    assert dynamic_top_p(1.5, 1.0, 0.0) == 0.0  # anchor above (min, max]
    assert dynamic_top_p(0.0, 1.0, 0.0) == 0.0  # anchor at the min is outside (min, max]
    assert dynamic_top_p(-1.0, 1.0, 0.0) == 0.0
    assert dynamic_top_p(0.5, 0.5, 0.5) == 0.0  # degenerate: all blocks equal


def test_block_layout():
    b = chunk_blocks(100, 150, 8, initial=1, local=2)
    assert b.ranges[0] == (100, 108) and b.ranges[-1] == (148, 150)
    assert b.anchor[0] and b.anchor[-1] and b.anchor[-2] and not any(b.anchor[1:-2])
    assert b.positions(b.middle) == list(range(108, 140))


def test_samkv_keeps_anchor_blocks_and_reports_the_kept_ratio(rag):
    pre = rag.prefill(Q, IDS, method="samkv", recompute_ratio=0.1, block_size=4)
    st, seg = pre.stitched, pre.segments
    held = set(st.positions.tolist())
    assert set(range(len(seg.prefix))) <= held  # the prefix is never dropped
    for start, end in st.chunk_spans:
        b = chunk_blocks(start, end, 4, 1, 2)
        anchors = b.positions([i for i, a in enumerate(b.anchor) if a])
        assert set(anchors) <= held
    n_chunk = st.chunk_positions().numel()
    assert pre.stats.kept_kv_ratio == pytest.approx(n_chunk / pre.stats.context_tokens)
    assert 0 < pre.stats.kept_kv_ratio < 0.8
    # the cache handed to decoding is the sparse one: its length is what was kept + the question
    assert cache_kv(pre.output.cache)[0][0].shape[2] == st.positions.numel() + len(seg.question)
    assert torch.equal(st.positions, st.positions.sort().values)
    # recomputed tokens are kept tokens, as many as asked
    assert set(pre.selected.tolist()) <= held
    assert pre.selected.numel() == round(0.1 * n_chunk)


def test_samkv_without_selection_reduces_to_the_unsparsified_result(rag):
    full = rag.prefill(Q, IDS, method="full")
    reuse = rag.prefill(Q, IDS, method="reuse")
    none = rag.prefill(Q, IDS, method="samkv", recompute_ratio=0.0, sparsify=False)
    every = rag.prefill(Q, IDS, method="samkv", recompute_ratio=1.0, sparsify=False)
    assert torch.equal(none.logits, reuse.logits) and none.stats.kept_kv_ratio == 1.0
    assert (every.logits - full.logits).abs().max() <= 1e-4


def test_samkv_fusion_mode_differs_from_overwrite_and_decodes(rag):
    over = rag.prefill(Q, IDS, method="samkv", recompute_ratio=0.3, block_size=4)
    fused = rag.prefill(Q, IDS, method="samkv", recompute_ratio=0.3, block_size=4, update="fusion")
    assert torch.equal(over.selected, fused.selected)
    assert not torch.equal(over.logits, fused.logits)
    out = rag.answer(Q, IDS, method="samkv", update="fusion", max_new_tokens=4)
    assert out.stats.generated_tokens > 0 and out.stats.kv_bytes > 0


def test_fusion_is_cosine_weighted():
    new, old = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    theta = torch.nn.functional.cosine_similarity(new, old, dim=-1)[..., None]
    assert torch.allclose(fuse_by_cosine(new, old), theta * new + (1 - theta) * old, atol=1e-6)
    assert torch.allclose(fuse_by_cosine(new, new), new, atol=1e-6)


@pytest.mark.parametrize("method", ["full", "reuse", "a3"])
def test_snapkv_with_budget_over_the_length_is_exact(rag, method):
    base = rag.answer(Q, IDS, method=method, max_new_tokens=6)
    same = rag.answer(Q, IDS, method=method, max_new_tokens=6, evict=SnapKV(budget=10_000))
    assert same.text == base.text and same.stats.kv_bytes == base.stats.kv_bytes


def test_snapkv_bounds_the_cache_per_layer_and_head(rag):
    budget = 12
    pre = rag.prefill(Q, IDS, method="reuse", evict=SnapKV(budget=budget))
    seg = pre.segments
    out = rag.decode(pre, max_new_tokens=5, evict=SnapKV(budget=budget)).answer()
    kept = len(seg.prefix) + budget + len(seg.question) + out.stats.generated_tokens - 1
    kv = cache_kv(pre.output.cache)
    assert all(k.shape[2] == kept for k, _ in kv)
    assert out.stats.kv_bytes == sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
    assert out.stats.kept_kv_ratio == pytest.approx(budget / pre.stats.context_tokens)


def test_snapkv_needs_the_captured_window(rag):
    pre = rag.prefill(Q, IDS, method="reuse")
    with pytest.raises(ValueError, match="evict"):
        rag.decode(pre, evict=SnapKV(budget=4))
    with pytest.raises(ValueError):
        SnapKV(budget=-1)
