"""The calibration's rule (kvrag.check.calibration_rule): keep Full Attention's right answers, the fastest wins."""

import pytest

from kvrag.check.calibration_rule import MIN_FULL_RIGHT, Rule, choose
from kvrag.defaults import Ape


def row(name, method, ratio, right, kept, lost, same, ttft, asked=96, status=None, ape=None):
    r = {"setting": name, "method": method, "ratio": ratio, "asked": asked, "right": right, "kept": kept, "lost": lost,
         "same": same, "ttft_ratio": ttft, "kl": 0.1}
    rule = Rule(96, 30)
    r["status"] = status or ("passed" if rule.passes(right, lost, same) else "failed")
    if ape:
        r["ape"] = {"temperature": ape.temperature, "scale": ape.scale}
    return r


def test_thresholds_keep_nine_in_ten_of_fulls_right_answers_and_all_but_one_in_thirty():
    rule = Rule(96, 30)
    assert rule.by_right and rule.may_lose == 3 and rule.right_needed == 27
    assert rule.passes(right=27, lost=3, same=10)  # differing text among answers Full has wrong costs nothing
    assert not rule.passes(right=28, lost=4, same=90)  # a fourth right answer lost: refused, however alike the rest
    assert not rule.passes(right=26, lost=3, same=90)  # fewer right in all than Full less one in thirty
    assert rule.hopeless(asked=50, right=10, lost=4, same=40)  # dropped as soon as it cannot pass
    assert rule.hopeless(asked=90, right=10, lost=0, same=90)  # 10 + 6 left < 27
    assert not rule.hopeless(asked=20, right=8, lost=1, same=5)


def test_the_issues_example_wrong_answers_drifting_cost_nothing_lost_right_ones_do():
    """First 8 calibration questions (the issue): Full right on 2; fusionrag@0.5 kept both and differed only
    where Full was wrong too; plain reuse lost both. Scaled up here to a set that can decide."""
    rule = Rule(24, 10)
    assert rule.passes(right=10, lost=0, same=15)  # fusionrag@0.5-like: 15/24 same, but no right answer lost
    assert not rule.passes(right=6, lost=4, same=6)  # reuse-like


def test_too_few_right_answers_fall_back_to_agreement_with_full():
    rule = Rule(24, MIN_FULL_RIGHT - 1)
    assert not rule.by_right and rule.may_differ == 2
    assert rule.passes(right=0, lost=0, same=22) and not rule.passes(right=9, lost=0, same=21)
    assert "too few" in rule.describe()


def test_the_fastest_passing_setting_wins_and_carries_its_ape():
    ape = Ape(0.8, 0.9)
    rows = [row("reuse", "reuse", 0.0, 20, 18, 12, 10, 16.0),
            row("fusionrag@0.5", "fusionrag", 0.5, 30, 30, 0, 50, 1.8),
            row("reuse+ape(T=0.8,S=0.9)", "reuse", 0.0, 29, 28, 2, 40, 14.0, ape=ape),
            row("a3@0.5", "a3", 0.5, 30, 30, 0, 50, 1.1)]
    chosen = choose(rows, Rule(96, 30), 1.2)
    assert (chosen.method, chosen.ratio, chosen.ape) == ("reuse", 0.0, ape)
    assert chosen.name == "reuse+ape(T=0.8,S=0.9)" and "kept 28 of Full's 30" in chosen.why


def test_none_passing_is_full_attention_with_the_reason():
    rows = [row("reuse", "reuse", 0.0, 20, 18, 12, 10, 16.0), row("a3@0.5", "a3", 0.5, 30, 30, 0, 50, 1.1)]
    chosen = choose(rows, Rule(96, 30), 1.2)
    assert chosen.method == "full" and "1 lost too many" in chosen.why and "passed but under 1.2x" in chosen.why


@pytest.mark.parametrize("full_right", [10, 25, 33])
def test_may_lose_is_the_most_that_keeps_ninety_percent(full_right):
    rule = Rule(96, full_right)
    assert (full_right - rule.may_lose) / full_right >= 0.9 > (full_right - rule.may_lose - 1) / full_right


def test_ingest_says_when_its_stored_kv_will_be_read(monkeypatch):
    """`kvrag ingest` ends by saying at what retrieval size the KV it stored is read (issue 70, item 4)."""
    from kvrag.cli.ingest import kv_use_note
    from kvrag.defaults import DefaultSetting

    monkeypatch.delenv("KVRAG_SHORT_CONTEXT", raising=False)
    monkeypatch.delenv("KVRAG_MIN_RECOMPUTE", raising=False)

    class Engine:
        def __init__(self, setting):
            self.setting = setting

        def peek_default(self):
            return self.setting

    reuse = kv_use_note(Engine(DefaultSetting("fusionrag", 0.15, "calibrated", "why", Ape(0.9, 1.0))), 120.4)
    assert "~120 tokens a chunk, 6 chunk(s) or fewer" in reuse and "from 7 retrieved chunks on" in reuse
    assert "fusionrag@0.15+ape(T=0.9,S=1) (calibrated)" in reuse
    full = kv_use_note(Engine(DefaultSetting("full", 0.15, "calibrated", "why")), 120)
    assert "Full Attention" in full and "never this KV" in full
    assert "not calibrated yet" in kv_use_note(Engine(None), 120)


def test_summary_names_the_tier_each_chunk_came_from():
    from kvrag.types import AnswerStats

    assert "tiers=computed:1,disk:3" in AnswerStats(method="reuse", tiers={"disk": 3, "computed": 1}).summary()
