"""A method is only a selection rule: which chunk tokens the shared recompute pass refreshes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
    """Base of every method; subclasses set `name` and implement `select`."""

    name: ClassVar[str] = ""
    full_attention: ClassVar[bool] = False  # True only for the no-reuse baseline

    def __init__(self, **params: Any) -> None:
        if params:
            raise TypeError(f"method {self.name!r} takes no parameters {sorted(params)}")

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        """Global positions (inside chunks) to recompute, at most `budget` of them."""
        raise NotImplementedError


def token_budget(ratio: float, chunk_tokens: int) -> int:
    """How many chunk tokens a recompute ratio buys (rounded, clipped to the chunk tokens)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be within [0, 1], got {ratio}")
    return min(chunk_tokens, int(round(ratio * chunk_tokens)))
