"""The calibration's rule: which measured setting a request that names no method gets (kvrag.check.calibrate).

What a user loses is a right answer, not a differently worded one. So, where Full Attention answers enough of
the calibration questions right (contains the gold: at least MIN_FULL_RIGHT), a setting passes when
- of the questions Full answers right, it answers at least CALIBRATION_KEEP of them right, and
- its right count is at least Full's less one in CALIBRATION_SLACK_PER questions;
agreement with Full's text and the first token's KL are measured and reported beside it, not ruled on
(on the bundled model most differing answers are drift among answers Full has wrong as well). Where Full
answers too few right to decide (a tiny model, a set the model cannot read), the older rule decides: Full's
answer, after normalisation, on at least CALIBRATION_BUDGET of the questions. Either way the setting's median
TTFT must beat Full's by CALIBRATION_MIN_SPEEDUP, and the fastest passing setting wins; none: Full Attention.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from kvrag.defaults import CALIBRATION_BUDGET, CALIBRATION_KEEP, CALIBRATION_SLACK_PER, DEFAULT_RATIO, Ape, DefaultSetting

MIN_FULL_RIGHT = 10  # Full's right answers below which "right" cannot decide: agreement with Full's text does


@dataclass(frozen=True)
class Rule:
    """The thresholds of one calibration run, fixed once Full Attention has answered every question."""

    questions: int
    full_right: int
    budget: float = CALIBRATION_BUDGET

    @property
    def by_right(self) -> bool:
        """Whether right answers decide (else: agreement with Full's answer)."""
        return self.full_right >= MIN_FULL_RIGHT

    @property
    def may_lose(self) -> int:
        """How many of Full's right answers a setting may answer wrong."""
        return self.full_right - math.ceil(CALIBRATION_KEEP * self.full_right - 1e-9)

    @property
    def right_needed(self) -> int:
        return self.full_right - self.questions // CALIBRATION_SLACK_PER

    @property
    def may_differ(self) -> int:
        """Under the agreement rule: how many answers may differ from Full's."""
        return math.floor((1.0 - self.budget) * self.questions + 1e-9)

    def hopeless(self, asked: int, right: int, lost: int, same: int) -> bool:
        """Whether a setting, after `asked` questions, can no longer pass (it is dropped there)."""
        if not self.by_right:
            return asked - same > self.may_differ
        return lost > self.may_lose or right + (self.questions - asked) < self.right_needed

    def passes(self, right: int, lost: int, same: int) -> bool:
        if not self.by_right:
            return self.questions - same <= self.may_differ
        return lost <= self.may_lose and right >= self.right_needed

    def describe(self) -> str:
        if self.by_right:
            return (f"at least {self.full_right - self.may_lose} of the {self.full_right} calibration questions Full "
                    f"Attention answers right answered right too, and at least {self.right_needed} of all {self.questions}")
        return (f"Full Attention's answer on >= {self.budget:.0%} of the {self.questions} calibration questions "
                f"(Full answered only {self.full_right} right: too few to rule on right answers)")


def setting_ape(row: dict[str, Any]) -> Ape | None:
    ape = row.get("ape")
    return Ape(ape["temperature"], ape["scale"]) if isinstance(ape, dict) else None


def choose(rows: Sequence[dict[str, Any]], rule: Rule, min_speedup: float) -> DefaultSetting:
    """The fastest setting that passed and beats Full's TTFT by `min_speedup`; else Full Attention."""
    fast = [r for r in rows if r.get("status") == "passed" and r["ttft_ratio"] >= min_speedup]
    if fast:
        best = max(fast, key=lambda r: r["ttft_ratio"])
        kept = (f"kept {best['kept']} of Full's {rule.full_right} right answers, {best['right']} right in all"
                if rule.by_right else f"{best['same']}/{best['asked']} same as Full")
        why = f"the fastest setting with {rule.describe()} ({kept}, {best['ttft_ratio']:.1f}x Full's TTFT)"
        return DefaultSetting(best["method"], float(best["ratio"]), "calibrated", why, setting_ape(best))
    counts = Counter(r.get("status") for r in rows)
    labels = (("failed", "lost too many"), ("too slow", f"under {min_speedup:g}x Full's speed"), ("slower", "slower than one that passed"),
              ("passed", f"passed but under {min_speedup:g}x Full's speed"), ("skipped", "skipped"))
    parts = ", ".join(f"{counts[k]} {label}" for k, label in labels if counts[k])
    why = (f"no reuse setting gave {rule.describe()} at >= {min_speedup:g}x its speed ({parts}): Full Attention "
           "with the exact prefix cache")
    return DefaultSetting("full", DEFAULT_RATIO, "calibrated", why)
