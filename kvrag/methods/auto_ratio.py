"""`recompute_ratio="auto"`: per request, the smallest ratio that covers a stated share of the rule's score mass.

A scoring rule (question attention for a3/fusionrag, KV deviation for CacheBlend, pooled-query
scores for SamKV) says how much each token matters. A fixed ratio recomputes as many tokens for a
question whose attention sits on five tokens as for one that spreads over the whole context;
"auto" recomputes the fewest tokens whose scores hold `mass` of the total (between `floor` and
`cap` of the chunk tokens) and reports the ratio it chose in `stats.recompute_ratio`. Rules that
score nothing (epic, reuse) fall back to `fallback`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AutoRatio:
    mass: float = 0.5  # share of the score mass the recomputed tokens must hold
    floor: float = 0.02  # never below this share of the chunk tokens
    cap: float = 0.3  # never above it: past this, reuse stops paying
    fallback: float = 0.15  # the ratio for rules without scores

    def __post_init__(self) -> None:
        if not (0 < self.mass <= 1 and 0 <= self.floor <= self.cap <= 1 and 0 <= self.fallback <= 1):
            raise ValueError(f"AutoRatio needs 0 < mass <= 1 and 0 <= floor <= cap <= 1, got {self}")


def auto_budget(scores: torch.Tensor, held: int, auto: AutoRatio) -> int:
    """How many of the scored candidates to recompute: the fewest whose scores hold `auto.mass` of
    the total, clipped to [floor, cap] of the `held` chunk tokens (and to the candidates)."""
    n = int(scores.numel())
    if n == 0:
        return 0
    s = scores.detach().float().cpu()
    s = torch.nan_to_num(s - s.min().clamp_max(0), nan=0.0, posinf=0.0)  # scores that may be negative become a mass
    total = float(s.sum())
    if total <= 0:
        k = int(round(auto.fallback * held))
    else:
        cum = torch.cumsum(torch.sort(s, descending=True).values, 0) / total
        k = int(torch.searchsorted(cum, torch.tensor([auto.mass])).item()) + 1
    lo, hi = int(round(auto.floor * held)), int(round(auto.cap * held))
    return max(0, min(n, max(lo, min(hi, k))))
