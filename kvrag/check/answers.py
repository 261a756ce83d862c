"""Whether two answers are the same, as calibration and the benchmarks judge it: SQuAD normalisation,
and the first token's KL divergence. Here, below the engine, so calibration can use them; kvrag.eval
re-exports them."""

from __future__ import annotations

import re
import string

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def agreement(prediction: str, reference: str) -> float:
    """1 if the two generated answers are the same after normalisation."""
    return float(normalize(prediction) == normalize(reference))


def contains(prediction: str, answers: list[str]) -> float:
    """1 if any acceptable answer appears in the prediction (normalised), else 0."""
    pred = normalize(prediction)
    return float(any(normalize(a) and normalize(a) in pred for a in answers))


def parted(partial: str, reference: str) -> bool:
    """Whether an answer still being generated can no longer equal `reference` after normalisation: a
    word it has finished differs from the reference's, or its last word, which may only grow, does not
    begin the reference's next word (nor an article, which normalisation drops)."""
    words, ref = normalize(partial).split(), normalize(reference).split()
    done, last = words[:-1], words[-1] if words else ""
    if done != ref[: len(done)]:
        return True
    if not last or any(article.startswith(last) for article in ("a", "an", "the")):
        return False
    return len(done) >= len(ref) or not ref[len(done)].startswith(last)


def first_token_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_reference || P) of the first generated token's distribution, in nats."""
    p = torch.log_softmax(reference_logits.float(), dim=-1)
    q = torch.log_softmax(logits.float(), dim=-1)
    return float(torch.sum(p.exp() * (p - q)))
