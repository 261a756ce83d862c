"""A method is only a selection rule: which chunk tokens the shared recompute pass refreshes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvrag.fuse import Stitched
from kvrag.model import LoadedModel
from kvrag.rope import Rotary


@dataclass
class SelectContext:
    """Everything a selection rule may look at."""

    lm: LoadedModel
    rotary: Rotary
    stitched: Stitched


class Method:
    """Base of every method; subclasses set `name` and implement `select`.

    Parameters are keyword arguments of the subclass constructor (with the papers' defaults), so
    `rag.answer(..., method="a3", layer=2)` reaches them.
    """

    name: ClassVar[str] = ""
    full_attention: ClassVar[bool] = False  # True only for the no-reuse baseline
    update: str = "overwrite"  # how recomputed KV is written: "overwrite" or "fusion" (SamKV eq. 4)

    def keep(self, ctx: SelectContext) -> torch.Tensor | None:
        """Chunk positions to keep in the cache (a sparsifying method); None keeps everything."""
        return None

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        """Global positions (inside chunks) to recompute, exactly `budget` of them."""
        raise NotImplementedError


class ScoredMethod(Method):
    """A rule that scores every chunk token and keeps the `budget` highest."""

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        """One score per chunk token, aligned with `ctx.stitched.chunk_positions()`."""
        raise NotImplementedError

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        positions = ctx.stitched.chunk_positions()
        if budget <= 0:
            return torch.empty(0, dtype=torch.long)
        if budget >= positions.numel():
            return positions
        scores = self.scores(ctx).float().cpu()
        top = torch.topk(scores, budget).indices
        return positions[top].sort().values


def token_budget(ratio: float, chunk_tokens: int) -> int:
    """How many chunk tokens a recompute ratio buys (rounded, clipped to the chunk tokens)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be within [0, 1], got {ratio}")
    return min(chunk_tokens, int(round(ratio * chunk_tokens)))

