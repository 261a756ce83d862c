"""Issue #17's options: the stop rule, recompute_ratio="auto", CacheBlend's gradual filtering, the default setting."""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.methods.auto_ratio import AutoRatio, auto_budget
from kvrag.decode.stream import rule_cut
from kvrag.options import DEFAULT_METHOD, AnswerOptions
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon long, then slept by the warm fire."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below the crust of the planet Earth."),
    Chunk("c", "Stock markets rose today after the central bank spoke about its interest rates."),
]
IDS = [c.id for c in CHUNKS]
Q = "What did the cat do?"


@pytest.fixture(scope="module")
def rag():
    r = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://")
    r.precompute(CHUNKS, progress=False)
    return r


@pytest.mark.parametrize(
    "text,rule,cut",
    [
        ("The Brannoch Line opened in 1893. It was built", "sentence", 33),
        ("It opened in 1893", "sentence", -1),  # not complete yet
        ("Pi is 3.14 or so", "sentence", -1),  # a decimal point ends nothing
        ("It served the U.S. Navy. Then", "sentence", 24),  # nor does an initial
        ("Yes\nNo", "line", 3),
        ("\nYes. No", "line", -1),  # a leading line break is not an answer
        ("Yes. No", "none", -1),
    ],
)
def test_stop_rules(text, rule, cut):
    assert rule_cut(text, rule) == cut


def test_the_stop_rule_ends_answers_and_can_be_turned_off(rag):
    long = rag.answer(Q, IDS, method="full", max_new_tokens=40, stop_at="none")
    short = rag.answer(Q, IDS, method="full", max_new_tokens=40, stop_at="line")
    assert long.text.startswith(short.text.strip()) or short.stats.generated_tokens <= long.stats.generated_tokens
    with pytest.raises(ValueError, match="stop_at"):
        rag.answer(Q, IDS, stop_at="paragraph")


def test_the_default_is_the_best_measured_fast_setting(rag):
    opts = AnswerOptions()
    assert opts.method is None and opts.recompute_ratio == 0.15 and opts.decode.stop_at == "sentence"  # None: the engine's
    assert rag.default_method == DEFAULT_METHOD != "reuse"  # no tuned adapter on this model
    out = rag.answer(Q, IDS)
    assert out.stats.method == DEFAULT_METHOD and out.stats.recomputed_tokens > 0


def test_auto_budget_takes_the_fewest_tokens_holding_the_mass():
    peaked = torch.tensor([10.0, 0.1, 0.1, 0.1, 0.1] + [0.0] * 95)
    flat = torch.ones(100)
    auto = AutoRatio(mass=0.5, floor=0.0, cap=1.0)
    assert auto_budget(peaked, 100, auto) == 1
    assert auto_budget(flat, 100, auto) == 50
    assert auto_budget(flat, 100, AutoRatio(mass=0.5, floor=0.0, cap=0.3)) == 30  # capped
    assert auto_budget(peaked, 100, AutoRatio(mass=0.5, floor=0.05, cap=0.3)) == 5  # floored


@pytest.mark.parametrize("method", ["a3", "cacheblend", "fusionrag", "epic", "reuse"])
def test_auto_ratio_reports_the_ratio_it_chose(rag, method):
    pre = rag.prefill(Q, IDS, method=method, recompute_ratio="auto")
    held = pre.stats.context_tokens
    assert pre.stats.recompute_ratio == pytest.approx(pre.stats.recomputed_tokens / held)
    if method == "reuse":
        assert pre.stats.recomputed_tokens == 0
    elif method == "epic":  # no scores: the fallback ratio
        assert pre.stats.recomputed_tokens == round(0.15 * held)
    else:
        assert 0 < pre.stats.recompute_ratio <= 0.3 + 1 / held


def test_a_bad_ratio_is_refused(rag):
    with pytest.raises(ValueError, match="auto"):
        rag.prefill(Q, IDS, method="a3", recompute_ratio="most")


def test_gradual_filtering_keeps_the_budget_and_its_ends(rag):
    full = rag.prefill(Q, IDS, method="full")
    every = rag.prefill(Q, IDS, method="cacheblend", gradual=True, recompute_ratio=1.0)
    assert (every.logits - full.logits).abs().max() <= 1e-4
    one = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.15)
    grad = rag.prefill(Q, IDS, method="cacheblend", gradual=True, recompute_ratio=0.15)
    assert grad.selected.numel() == one.selected.numel()
    first = grad.segments.chunk_starts[0], grad.segments.chunk_starts[0] + len(grad.segments.chunks[0])
    assert not any(first[0] <= p < first[1] for p in grad.selected.tolist())  # the exact first chunk is never spent on
    assert torch.isfinite(grad.selection.scores[grad.selected]).all()
