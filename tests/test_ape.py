"""APE (kvrag.model.ape): the question's and the answer's attention over reused chunk KV with a
temperature T and a scale S. T = S = 1 is plain reuse bit for bit; otherwise the merged attention is
APE's two-part formula, the same in the question's pass, the lean decode step and the stock forward,
and the decode step stays free of host syncs (what a CUDA graph needs)."""

import pytest
import torch
import torch.nn.functional as F

from kvrag import KVRag, from_model
from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
from kvrag.defaults import Ape, DefaultSetting
from kvrag.model.ape import DecodeApe, ape_attention, ape_logits
from kvrag.options import AnswerOptions
from test_gpu_readiness import count_syncs
from tiny import ARCHS, THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

APE = Ape(0.7, 0.8)


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    rag = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://", check=False)
    rag.precompute(THREE_CHUNKS, progress=False)
    return rag


def _two_part(q, k, v, context, ape, scaling):
    """APE as its paper writes it: the context part with scores / T and its log-sum-exp L_C, the rest
    (L_N) as usual, merged with weights softmax([S*T*L_C, L_N]). q [h, n, d], k/v [h, kv, d]."""
    s = torch.einsum("hnd,hkd->hnk", q, k) * scaling
    sc, sn = s[..., context] / ape.temperature, s[..., ~context]
    lc, ln = torch.logsumexp(sc, -1, keepdim=True), torch.logsumexp(sn, -1, keepdim=True)
    oc = torch.softmax(sc, -1) @ v[:, context]
    on = torch.softmax(sn, -1) @ v[:, ~context]
    w = torch.softmax(torch.cat([ape.scale * ape.temperature * lc, ln], -1), -1)
    return w[..., :1] * oc + w[..., 1:] * on


def test_the_merged_softmax_is_apes_two_part_formula():
    torch.manual_seed(0)
    h, n, kv, d = 4, 5, 40, 16
    q, k, v = torch.randn(h, n, d), torch.randn(h, kv, d), torch.randn(h, kv, d)
    context = torch.zeros(kv, dtype=torch.bool)
    context[6:30] = True
    for ape in (Ape(0.7, 0.8), Ape(1.0, 0.6), Ape(0.5, 1.3)):
        got = ape_attention(q[None], k[None], v[None], None, context, ape, d**-0.5)[0]
        torch.testing.assert_close(got, _two_part(q, k, v, context, ape, d**-0.5), rtol=1e-5, atol=1e-5)


def test_at_t_s_one_the_formula_is_ordinary_attention():
    """The formula itself (forced through, where the engine would take the stock path) equals SDPA."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    context = torch.arange(50) >= 10
    got = ape_attention(q, k, v, None, context, Ape(1.0, 1.0), 0.25)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    scores = torch.randn(3, 50)
    torch.testing.assert_close(ape_logits(scores, context, Ape(1.0, 1.0)), scores)


def test_t_s_one_is_plain_reuse_bit_for_bit(rag):
    assert AnswerOptions(ape=(1.0, 1.0)).ape is None  # the option normalises to "off"
    a = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0)
    b = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=(1.0, 1.0))
    assert torch.equal(a.logits, b.logits) and b.ape is None
    kw = dict(method="reuse", max_new_tokens=16, stop_at="none")
    x, y = rag.answer(THREE_Q, THREE_IDS, **kw), rag.answer(THREE_Q, THREE_IDS, ape=Ape(1.0, 1.0), **kw)
    assert x.text == y.text and y.stats.ape == ""


def test_ape_changes_the_question_pass_and_every_method_takes_it(rag):
    plain = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0)
    ape = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=APE)
    assert not torch.allclose(plain.logits, ape.logits, atol=1e-4)
    assert ape.stats.ape == APE.tag and ape.ape is not None
    start, stop = ape.ape.start, ape.ape.stop
    assert start == len(ape.segments.prefix) and stop == ape.segments.context_len  # the chunk slots, nothing else
    full = rag.prefill(THREE_Q, THREE_IDS, method="full", ape=APE)  # Full Attention reads whole: no APE
    assert full.ape is None and full.stats.ape == ""
    fr = rag.prefill(THREE_Q, THREE_IDS, method="fusionrag", recompute_ratio=0.3, ape=APE)
    assert fr.stats.ape == APE.tag


@pytest.mark.parametrize("static", [False, True])
def test_ape_decodes_the_same_on_the_lean_step_and_the_models_own_forward(rag, static):
    """Both decode paths (the static lean step a CUDA graph captures, and the stock forward) attend
    with APE alike: the same tokens as the other path."""
    outs = []
    for st in (static, not static):
        pre = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=APE)
        cfg = DecodeConfig(max_new_tokens=20, static=st)
        state = DecodeState()
        list(stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context,
                           ape=pre.ape))
        outs.append(state.token_ids)
    assert len(outs[0]) >= 8 and outs[0] == outs[1]


def test_ape_changes_the_decode_steps_too(rag):
    """A decode step after an APE prefill reads the chunk slots through APE (not only the first token)."""
    from kvrag.decode.stream import EagerStep

    a = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=APE)
    b = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=APE)
    with_ape = EagerStep(rag.lm, a.output.cache, a.ape)(65, a.output.next_position)
    without = EagerStep(rag.lm, b.output.cache, None)(65, b.output.next_position)
    assert not torch.allclose(with_ape, without, atol=1e-4)


def test_the_ape_decode_step_never_syncs_with_the_host(rag):
    from kvrag.decode.static import StaticStep, _room
    from kvrag.model.cache import cache_len

    pre = rag.prefill(THREE_Q, THREE_IDS, method="reuse", recompute_ratio=0.0, ape=APE)
    start = cache_len(pre.output.cache)
    step = StaticStep(rag.lm.model, [_room(layer, start + 4) for layer in pre.output.cache.layers], rag.lm.dtype,
                      rag.lm.device, ape=pre.ape)
    step.set(65, pre.output.next_position, start)
    with count_syncs() as syncs:
        step.run()
    assert syncs["n"] == 0


def test_an_ape_default_setting_names_itself_and_reaches_the_request():
    setting = DefaultSetting("reuse", 0.0, "calibrated", "why", Ape(0.9, 1.0))
    assert setting.name == "reuse+ape(T=0.9,S=1)"
    opts = AnswerOptions().with_default_method(setting)
    assert opts.method == "reuse" and opts.ape == Ape(0.9, 1.0)
    mine = AnswerOptions(ape=(0.8, 0.9)).with_default_method(setting)
    assert mine.ape == Ape(0.8, 0.9)  # the caller's own setting wins
    assert DefaultSetting("reuse", 0.0, ape=Ape(1.0, 1.0)).name == "reuse"


@pytest.mark.parametrize("bad", [(0.0, 1.0), (1.0, -1), "x,y", (1.0,), {"temp": 1.0}, (float("nan"), 1.0)])
def test_bad_ape_values_are_refused_clearly(bad):
    with pytest.raises(ValueError, match="ape"):
        AnswerOptions(ape=bad)


def test_ape_in_the_prefix_signature():
    a = AnswerOptions(method="reuse").prefix_signature(False)
    b = AnswerOptions(method="reuse", ape=APE).prefix_signature(False)
    assert a != b and AnswerOptions(method="full", ape=APE).prefix_signature(True) == "exact"
