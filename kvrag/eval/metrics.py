"""Task scores (SQuAD-style F1, answer contained) and fidelity to Full Attention."""

from __future__ import annotations

from collections import Counter

from kvrag.check.answers import agreement, contains, first_token_kl, normalize  # noqa: F401 (re-exported: one definition of "the same answer")


def f1(prediction: str, truth: str) -> float:
    pred, gold = normalize(prediction).split(), normalize(truth).split()
    if not pred or not gold:
        return float(pred == gold)
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, answers: list[str]) -> float:
    return max((f1(prediction, a) for a in answers), default=0.0)
