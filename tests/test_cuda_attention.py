"""Attention by position in query blocks on every device here (the CPU always, CUDA when there is
one): the dense mask's logits, the kernels named in the stats (efficient ones on CUDA), and masks that
stay bounded (on CUDA by the memory the pass allocates too). tests/test_attention.py covers the CPU
in depth; the CPU runs here keep these tests' helpers in step with the library."""

import pytest
import torch
import torch.nn.functional as F

import kvrag.model.attention as attention
from devices import on_devices
from kvrag import KVRag, from_model
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
KERNELS = {"flash_attention", "efficient_attention", "cudnn_attention", "math"}


def engine(device, arch, dtype, attn="sdpa", chunks=THREE_CHUNKS):
    model = tiny_model(arch, attn=attn).to(device, dtype)
    rag = KVRag(from_model(model, tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(chunks, progress=False)
    return rag


@on_devices("arch, dtype", [(a, d) for a in ARCHS for d in (torch.float32, torch.bfloat16)], cpu=[("llama", torch.float32)])
def test_blocked_attention_matches_the_dense_mask(device, arch, dtype, monkeypatch):
    blocked, dense = engine(device, arch, dtype), engine(device, arch, dtype, attn="eager")
    for budget in (attention.MASK_BUDGET, 2000):
        monkeypatch.setattr(attention, "MASK_BUDGET", budget)
        for method in ("full", "reuse", "cacheblend", "a3", "samkv", "fusionrag"):
            a = blocked.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.3)
            b = dense.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.3)
            err = (a.logits.float() - b.logits.float()).norm() / b.logits.float().norm()
            assert err <= TOL[dtype], (method, budget, float(err))


@on_devices("dtype", [torch.bfloat16])
def test_question_and_probe_blocks_run_on_efficient_kernels(device, dtype):
    """Every pass names its kernels; on CUDA none is the math kernel (it would build the scores whole)."""
    rag = engine(device, "llama", dtype)
    stats = rag.prefill(THREE_Q, THREE_IDS, method="cacheblend", recompute_ratio=0.3).stats
    assert set(stats.attention_kernels) == {"probe", "recompute"}
    used = {k for kernels in stats.attention_kernels.values() for k in kernels}
    assert used, stats.attention_kernels
    if device == "cuda":
        assert "math" not in used, stats.attention_kernels
    else:
        assert used <= KERNELS, stats.attention_kernels


class SpiedSDPA:
    """Stands in for `torch.nn.functional` in kvrag.model.attention: records each attention call's
    query rows x key slots and the elements of its mask tensor, then runs the real kernel."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (queries, keys, mask elements; 0: no mask tensor)

    def __getattr__(self, name):
        return getattr(F, name)

    def scaled_dot_product_attention(self, q, k, v, attn_mask=None, **kwargs):
        plain = isinstance(attn_mask, torch.Tensor) and type(attn_mask) is torch.Tensor  # a CausalBias is no tensor of its size
        self.calls.append((q.shape[-2], k.shape[-2], attn_mask.numel() if plain else 0))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)


@on_devices("dtype", [torch.bfloat16])
def test_a_long_probe_allocates_no_whole_pass_mask(device, dtype, monkeypatch):
    """CacheBlend's all-token probe over ~3.9k tokens, the block budget lowered to 1 Mi elements (at the
    default 16 Mi one block holds most of a 4k pass). Every device: no attention call sees more than the
    budget's queries x keys, nor a mask tensor past it (the budget ignored, the probe's block is
    2611 x 3918). CUDA: the pass's peak memory stays under n*n bytes, the smallest whole-pass mask
    (boolean), so a whole-pass mask allocated anywhere, by kvrag or by transformers, fails the test.
    The bound was n*n/2 bytes (7.7 MB), which correct blocks do not keep to: one block's mask and the
    copies a kernel makes of it (bool, bf16, aligned: ~5 bytes an element, ~5 MB at 1 Mi) come on top
    of what grows with n (stitched KV, activations); the H200 measured 8.2 MB at n = 3918."""
    budget = 1 << 20
    monkeypatch.setattr(attention, "MASK_BUDGET", budget)
    long = [type(c)(c.id + "-long", text=(c.text + " ") * 24) for c in THREE_CHUNKS]
    rag = engine(device, "llama", dtype, chunks=long)
    spied = SpiedSDPA()
    monkeypatch.setattr(attention, "F", spied)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    pre = rag.prefill(THREE_Q, [c.id for c in long], method="cacheblend", recompute_ratio=0.15)
    n = pre.segments.total_len
    assert n > 3000 and budget < n * n // 8 and set(pre.stats.attention_kernels) == {"probe", "recompute"}
    largest = max(q * k for q, k, _ in spied.calls)  # the attention scores of one call, queries x keys
    assert largest <= budget and max(m for _, _, m in spied.calls) <= budget, (n, largest)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < n * n, (n, peak)  # a whole-pass mask alone, boolean, would be n*n bytes
