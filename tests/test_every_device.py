"""Every method, SnapKV, KVLink and int8 entries on every device here (CUDA when there is one), fp32 and bf16.

Tolerances are relative L2 errors of the first-token logits: fp32 1e-4; bf16 3e-2 (a bf16 pass
rounds every layer; ratio 1.0 runs the same tokens through another kernel and order than Full
Attention's prefill). On the CPU these double as checks of the bf16 paths; on a GPU they are the
CUDA tests of issue #20.
"""

import pytest
import torch

from devices import DEVICES
from kvrag import KVRag, from_model
from kvrag.methods.snapkv import SnapKV
from tiny import THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
SELECTIVE = ["cacheblend", "epic", "a3", "fusionrag", "samkv"]


def rel(got, want):
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module", params=[(d, t) for d in DEVICES for t in DTYPES], ids=lambda p: f"{p[0]}-{str(p[1])[6:]}")
def rag(request, tmp_path_factory):
    device, dtype = request.param
    lm = from_model(tiny_model("llama").to(device, dtype), tiny_tokenizer())
    store = f"disk://{tmp_path_factory.mktemp('kv')}?quantize=int8"  # int8 entries on every device
    r = KVRag(lm, store=store, check=False)
    r.precompute(THREE_CHUNKS, progress=False)
    return r


@pytest.mark.parametrize("method", SELECTIVE + ["samkv:fusion", "kvlink", "kvlink+a3", "cacheblend:gradual"])
def test_every_method_runs_and_decodes(rag, method):
    name, _, variant = method.partition(":")
    params = {"update": "fusion"} if variant == "fusion" else {"gradual": True} if variant == "gradual" else {}
    if name.startswith("kvlink"):
        params["link_tokens"] = 2
    pre = rag.prefill(THREE_Q, THREE_IDS, method=name, recompute_ratio=0.3, **params)
    assert torch.isfinite(pre.logits).all() and pre.stats.cache_hits == 3
    out = rag.decode(pre, max_new_tokens=3)
    assert isinstance(out.answer().text, str) and out.stats.generated_tokens >= 0


@pytest.mark.parametrize("method", ["cacheblend", "epic", "a3", "fusionrag"])
def test_ratio_one_is_full_attention_on_every_device(rag, method):
    full = rag.prefill(THREE_Q, THREE_IDS, method="full")
    every = rag.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=1.0)
    assert rel(every.logits, full.logits) <= TOL[rag.lm.dtype]


def test_snapkv_eviction_on_every_device(rag):
    pre = rag.prefill(THREE_Q, THREE_IDS, method="a3", evict=SnapKV(budget=4))
    out = rag.decode(pre, max_new_tokens=3, evict=SnapKV(budget=4)).answer()
    assert out.stats.kept_kv_ratio < 1.0


def test_int8_entries_stay_within_their_bound_on_every_device(rag):
    key = rag._resolve(THREE_CHUNKS[:1]).keys[0]
    entry = rag.store.get(key)
    assert entry is not None and entry.keys.dtype.is_floating_point
    full = rag.prefill(THREE_Q, THREE_IDS[:1], method="full")
    reuse = rag.prefill(THREE_Q, THREE_IDS[:1], method="reuse")  # one chunk: exact but for int8 rounding
    assert rel(reuse.logits, full.logits) <= 5e-2
