"""Issue #22 on the CPU: the static-cache decode step picks exactly the tokens of the growing-cache decode.

The static step (kvrag.decode.static.StaticStep.run) is the function a CUDA graph captures on a GPU;
here it runs eagerly. The capture itself is not run on the CPU: tests/test_cuda.py checks graph ==
eager on a GPU. What the CPU can check of capturability is checked here: no host sync inside the
step, fixed buffers written in place, the mask and the RoPE position given as tensors.
"""

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.model.cache import SpliceCache, cache_kv, cache_len
from kvrag.decode.stream import DecodeConfig, DecodeState, EagerStep, stepper, stream_tokens
from kvrag.methods.snapkv import SnapKV
from kvrag.options import AnswerOptions
from kvrag.decode.static import StaticDecoder, supports
from test_gpu_readiness import count_syncs
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

# Full Attention prefill, a reuse prefill (stitched, recomputed in place), and SamKV's sparse stitched cache.
PREFILLS = ["full", "cacheblend", "samkv"]
# the seed: one whose sampled answers run to max_new_tokens on every tiny model and prefill (an early EOS
# would compare few steps); seed 7 ended one at 5 tokens once the default layout changed the prompt
SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.9, top_p=0.9, seed=4)}


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    rag = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    return rag


def decode(rag, method, static, max_new_tokens=24, **sampling):
    """Token ids, finish reason and the cache's length afterwards, from a fresh prefill."""
    pre = rag.prefill(THREE_Q, THREE_IDS, method=method)
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, static=static, **sampling)
    state = DecodeState()
    text = "".join(stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context))
    return state.token_ids, state.finish_reason, cache_len(pre.output.cache), text


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("method", PREFILLS)
def test_static_decode_picks_the_same_tokens_as_the_growing_cache(rag, method, sampling):
    eager = decode(rag, method, static=False, **SAMPLING[sampling])
    static = decode(rag, method, static=True, **SAMPLING[sampling])
    assert len(eager[0]) >= 8  # the comparison covers many steps, not an answer that ended at once
    assert static == eager  # tokens, finish reason, the cache's length afterwards, text


def test_the_static_path_is_the_one_taken_and_its_logits_match(rag):
    """Step by step over SamKV's sparse cache: slot indices != positions, same logits either way."""
    a = rag.prefill(THREE_Q, THREE_IDS, method="samkv")
    b = rag.prefill(THREE_Q, THREE_IDS, method="samkv")
    held = a.stitched.positions
    assert held.numel() < int(held[-1]) + 1  # sparse: some global positions are not held
    start = cache_len(a.output.cache)
    assert a.output.next_position > start  # the RoPE position is not the slot index
    cfg = DecodeConfig(max_new_tokens=9, static=True)
    eager = EagerStep(rag.lm, a.output.cache)
    static = stepper(rag.lm, b.output.cache, b.output.next_position, cfg, rag.lm.max_context)
    assert isinstance(static, StaticDecoder) and not static.graph and not static.captured  # CPU: eager, no capture
    buf = b.output.cache.layers[0]._kbuf.data_ptr()
    for i, token in enumerate([5, 77, 100, 200, 31, 9, 64, 250]):
        want, got = eager(token, a.output.next_position + i), static(token, b.output.next_position + i)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    static.close()
    assert b.output.cache.layers[0]._kbuf.data_ptr() == buf  # decoded in the prefill's reserved room
    for (ka, va), (kb, vb) in zip(cache_kv(a.output.cache), cache_kv(b.output.cache)):
        assert kb.shape[-2] == start + 8
        torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-5)


def test_snapkv_evicted_cache_decodes_statically_and_grows_its_room_once():
    """SnapKV keeps 64 slots of room; 80 tokens need more: the static buffer is grown before the first step."""
    rag = KVRag(from_model(tiny_model("llama", seed=3), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    texts = []
    for static in (False, True):
        pre = rag.prefill(THREE_Q, THREE_IDS, method="reuse", evict=SnapKV(budget=8))
        out = rag.decode(pre, evict=SnapKV(budget=8), max_new_tokens=80, stop_at="none", static=static).answer()
        texts.append((out.text, out.stats.generated_tokens, out.stats.kv_bytes))
    assert texts[0][1] > 64 and texts[1] == texts[0]


def test_answer_through_the_pipeline_is_the_same_with_static_on(rag):
    kw = dict(method="cacheblend", max_new_tokens=20, stop_at="none", temperature=0.7, seed=1)
    eager, static = rag.answer(THREE_Q, THREE_IDS, static=False, **kw), rag.answer(THREE_Q, THREE_IDS, static=True, **kw)
    assert (static.text, static.stats.generated_tokens, static.stats.kv_bytes) == (eager.text, eager.stats.generated_tokens, eager.stats.kv_bytes)
    # the static decoder's one-time set-up is reported inside the decode time; the growing cache has none
    assert 0 < static.stats.decode_setup_s < static.stats.decode_s and eager.stats.decode_setup_s == 0


def test_the_step_never_syncs_with_the_host_and_hides_only_the_unused_room(rag):
    """The single-sequence step of a sequence outside the slot pool (StaticStep: a model without a lean
    step, or a full pool). A host sync inside the captured region would fail capture on a GPU (or bake
    a value in). The pooled step's own checks: tests/test_pooled_decode.py."""
    from kvrag.decode.static import StaticStep, _room

    pre = rag.prefill(THREE_Q, THREE_IDS, method="samkv")
    start = cache_len(pre.output.cache)
    step = StaticStep(rag.lm.model, [_room(layer, start + 4) for layer in pre.output.cache.layers], rag.lm.dtype, rag.lm.device)
    step.set(65, pre.output.next_position, start)
    with count_syncs() as syncs:
        step.run()
    assert syncs["n"] == 0
    for kbuf, vbuf in step.buffers:
        assert torch.isfinite(kbuf).all() and torch.isfinite(vbuf).all()  # the room is zeroed, never garbage
        assert kbuf[..., start, :].abs().sum() > 0 and kbuf[..., start + 1 :, :].abs().sum() == 0  # wrote slot `start` only
    mask = torch.where(step._slots <= step.slot, 1, 0)
    assert mask[: start + 1].all() and not mask[start + 1 :].any()  # every held slot visible, the room hidden


def test_abandoned_stream_leaves_the_cache_as_decoded_so_far(rag):
    pre = rag.prefill(THREE_Q, THREE_IDS, method="cacheblend")
    start = cache_len(pre.output.cache)
    cfg = DecodeConfig(max_new_tokens=40, static=True)
    state = DecodeState()
    stream = stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context)
    for _ in range(5):
        next(stream)
    stream.close()
    assert cache_len(pre.output.cache) == start + len(state.token_ids) - 1  # every token but the last was fed back


def test_auto_is_on_for_cuda_and_on_the_cpu_where_the_lean_step_applies():
    cfg = DecodeConfig()
    assert cfg.static is None
    assert not cfg.static_on(torch.device("cpu")) and cfg.static_on(torch.device("cuda"))
    assert DecodeConfig(static=True).static_on(torch.device("cpu"))
    assert not DecodeConfig(static=False).static_on(torch.device("cuda"))
    with pytest.raises(ValueError, match="static"):
        DecodeConfig(static="yes")
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    cache = SpliceCache([(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))] * 3, reserve=4)
    assert cfg.static_on(torch.device("cpu"), lm.model)  # a supported architecture: the lean static step
    assert isinstance(stepper(lm, cache, 3, DecodeConfig()), StaticDecoder)
    assert isinstance(stepper(lm, cache, 3, DecodeConfig(static=False)), EagerStep)


def test_caches_it_cannot_serve_decode_eagerly():
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    ragged = SpliceCache([(torch.zeros(1, 2, n, 16), torch.zeros(1, 2, n, 16)) for n in (3, 4, 3)])
    assert not supports(ragged)
    assert isinstance(stepper(lm, ragged, 4, DecodeConfig(static=True)), EagerStep)
    with pytest.raises(ValueError):
        StaticDecoder(lm, ragged, 4)


def test_static_travels_in_the_options():
    opts = AnswerOptions.from_kwargs(static=True)
    assert opts.decode.static is True
    assert AnswerOptions.from_kwargs(opts, max_new_tokens=5).decode.static is True  # kept when other decode keys change
    assert AnswerOptions().decode.static is None
