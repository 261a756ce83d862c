"""Task scores (SQuAD-style F1, answer contained) and fidelity to Full Attention."""

from __future__ import annotations

import re
import string
from collections import Counter

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


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


def contains(prediction: str, answers: list[str]) -> float:
    """1 if any acceptable answer appears in the prediction (normalised), else 0."""
    pred = normalize(prediction)
    return float(any(normalize(a) and normalize(a) in pred for a in answers))


def agreement(prediction: str, reference: str) -> float:
    """1 if the two generated answers are the same after normalisation."""
    return float(normalize(prediction) == normalize(reference))


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_reference || P) of the first generated token's distribution, in nats."""
    p = torch.log_softmax(reference_logits.float(), dim=-1)
    q = torch.log_softmax(logits.float(), dim=-1)
    return float(torch.sum(p.exp() * (p - q)))
