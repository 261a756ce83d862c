"""Attention by position in query blocks (kvrag.model.attention): same answers as the dense mask, bounded masks,
kernels named in the stats, flash-attention refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import kvrag.model.attention as attention
from kvrag import KVRag, from_model
from kvrag.model.attention import IMPL, PassSpec, plan_blocks
from kvrag.errors import UnsupportedModelError

from tiny import ARCHS, THREE_CHUNKS, THREE_Q, tiny_model, tiny_tokenizer

METHODS = ["full", "reuse", "cacheblend", "epic", "a3", "fusionrag", "samkv"]


def engines(arch: str):
    """The same weights twice: kvrag_sdpa (blocks by position) and eager (the dense additive mask)."""
    blocked = KVRag(from_model(tiny_model(arch), tiny_tokenizer()), store="memory://", check=False)
    dense = KVRag(from_model(tiny_model(arch, attn="eager"), tiny_tokenizer()), store="memory://", check=False)
    assert blocked.lm.model.config._attn_implementation == IMPL
    assert dense.lm.model.config._attn_implementation == "eager"
    for r in (blocked, dense):
        r.precompute(THREE_CHUNKS, progress=False)
    return blocked, dense


def ids():
    return [c.id for c in THREE_CHUNKS]


@pytest.mark.parametrize("arch", ARCHS)
def test_blocked_attention_gives_the_dense_masks_logits_for_every_method(arch, monkeypatch):
    blocked, dense = engines(arch)
    for budget in (attention.MASK_BUDGET, 64):  # one block, then many small blocks
        monkeypatch.setattr(attention, "MASK_BUDGET", budget)
        for method in METHODS:
            a = blocked.prefill(THREE_Q, ids(), method=method, recompute_ratio=0.3)
            b = dense.prefill(THREE_Q, ids(), method=method, recompute_ratio=0.3)
            assert torch.equal(a.selected.cpu(), b.selected.cpu()), (method, budget)
            assert (a.logits - b.logits).abs().max() <= 1e-4, (method, budget)


def test_blocked_attention_with_kvlink_slots_and_gradual_cacheblend(monkeypatch):
    blocked, dense = engines("llama")
    monkeypatch.setattr(attention, "MASK_BUDGET", 64)
    for method, params in (("kvlink", {"link_tokens": 2}), ("cacheblend", {"gradual": True})):
        a = blocked.prefill(THREE_Q, ids(), method=method, recompute_ratio=0.3, **params)
        b = dense.prefill(THREE_Q, ids(), method=method, recompute_ratio=0.3, **params)
        assert (a.logits - b.logits).abs().max() <= 1e-4, method


def test_answers_are_the_same_tokens_as_the_dense_mask():
    blocked, dense = engines("qwen2")
    for method in ("reuse", "cacheblend", "full"):
        a = blocked.answer(THREE_Q, ids(), method=method, max_new_tokens=8, stop_at="none")
        b = dense.answer(THREE_Q, ids(), method=method, max_new_tokens=8, stop_at="none")
        assert a.text == b.text, method


def test_plan_needs_no_mask_for_a_fully_visible_block_and_a_causal_bias_for_a_prefill():
    keys = np.arange(100)
    question = plan_blocks(np.arange(100, 110), np.concatenate([keys, np.arange(100, 110)]), True, 1 << 20)
    assert [b.kind for b in question] == ["causal"]  # the question over the context: lower-right causal
    one = plan_blocks(np.array([100]), np.arange(101), True, 1 << 20)
    assert [(b.kind, b.keys) for b in one] == [("none", 101)]
    scattered = plan_blocks(np.array([10, 50, 100, 101]), np.concatenate([keys, [100, 101]]), True, 1 << 20)
    assert [(b.kind, b.keys) for b in scattered] == [("mask", 51), ("causal", 102)]  # the question: a block of its own
    # small blocks: early queries attend only to the keys up to them
    split = plan_blocks(np.array([10, 50, 100, 101]), np.concatenate([keys, [100, 101]]), True, 102)
    assert [(b.kind, b.keys) for b in split] == [("none", 11), ("none", 51), ("none", 101), ("none", 102)]
    # hidden link slots (a position no query reaches) break the ordering: a mask per block over every key
    hidden = np.array([0, 1, np.iinfo(np.int64).max, 3, 4])
    assert {b.kind for b in plan_blocks(np.array([3, 4]), hidden, True, 1 << 20)} == {"mask"}


def test_masks_at_32k_on_the_8b_shape_stay_under_the_bound():
    """The passes at 32k tokens, planned as the engine plans them: no block's mask exceeds MASK_BUDGET
    elements (16 MiB as bool; the dense mask of the recompute pass would be 0.3 GiB in bf16, CacheBlend's
    all-token probe 2 GiB), and the all-token probe and Full Attention need no mask tensor on CUDA."""
    n, question = 32768, 32
    keys = np.arange(n + question)
    rng = np.random.default_rng(0)
    selected = np.sort(rng.choice(np.arange(16, n), size=int(0.15 * n), replace=False))
    recompute = plan_blocks(np.concatenate([selected, np.arange(n, n + question)]), keys, True, attention.MASK_BUDGET)
    probe = plan_blocks(np.arange(16, n + question), keys, True, attention.MASK_BUDGET)
    for plan in (recompute, probe):
        assert all((b.stop - b.start) * b.keys <= attention.MASK_BUDGET for b in plan if b.kind == "mask")
    assert {b.kind for b in probe} == {"causal"}
    assert recompute[-1].kind in ("causal", "none") and recompute[-1].keys == n + question
    assert sum((b.stop - b.start) * b.keys for b in recompute) < len(selected) * (n + question)  # early blocks see fewer keys


def test_every_mask_a_pass_builds_respects_the_budget(monkeypatch):
    blocked, _ = engines("llama")
    monkeypatch.setattr(attention, "MASK_BUDGET", 2000)  # the pass has ~360 key slots: blocks of 5 queries
    sizes = []
    real = PassSpec.mask

    def spy(self, block):
        m = real(self, block)
        sizes.append(m.numel())
        return m

    monkeypatch.setattr(PassSpec, "mask", spy)
    for method in ("cacheblend", "a3", "samkv"):
        blocked.prefill(THREE_Q, ids(), method=method, recompute_ratio=0.3)
    assert sizes and max(sizes) <= 2000


def test_stats_name_the_kernel_of_each_pass():
    blocked, dense = engines("llama")
    stats = blocked.prefill(THREE_Q, ids(), method="cacheblend", recompute_ratio=0.3).stats
    assert set(stats.attention_kernels) == {"probe", "recompute"}
    for kernels in stats.attention_kernels.values():
        assert kernels and all(name in ("flash_attention", "efficient_attention", "math", "cudnn_attention") for name in kernels)
    assert "flash_attention" in stats.attention_kernels["recompute"]  # the CPU's fused kernel, mask or not
    assert blocked.prefill(THREE_Q, ids(), method="full").stats.attention_kernels == {}  # the model's own pass
    assert dense.prefill(THREE_Q, ids(), method="reuse").stats.attention_kernels == {}  # eager: no SDPA
    assert "attention_kernels" in stats.as_dict()


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "flex_attention"])
def test_flash_attention_is_refused_with_a_clear_error(impl):
    model = tiny_model("llama")
    model.config._attn_implementation = impl
    with pytest.raises(UnsupportedModelError, match="attn_implementation='sdpa'"):
        from_model(model, tiny_tokenizer())


def test_outside_a_pass_the_model_is_stock_sdpa():
    """Decoding, training and a user's own forward on the wrapped model behave as transformers' SDPA."""
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    from_model(model, tiny_tokenizer())
    assert model.config._attn_implementation == IMPL
    x = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        assert torch.allclose(model(x).logits, reference(x).logits, atol=1e-5)
