"""EPIC / LegoLink: recompute the first tokens of every chunk (the attention-sink rule)."""

from __future__ import annotations

import torch

from kvrag.methods.base import Method, SelectContext


class Epic(Method):
    """EPIC/LegoLink: the first tokens of each chunk, budget split evenly across chunks."""

    name = "epic"

    def select(self, ctx: SelectContext, budget: int) -> torch.Tensor:
        spans = ctx.stitched.chunk_spans
        if budget <= 0 or not spans:
            return torch.empty(0, dtype=torch.long)
        picked: list[int] = []
        depth = 0
        # take token `depth` of every chunk, round after round, so every chunk gets its head first
        while len(picked) < budget:
            added = False
            for start, end in spans:
                if start + depth < end and len(picked) < budget:
                    picked.append(start + depth)
                    added = True
            if not added:
                break
            depth += 1
        return torch.tensor(sorted(picked), dtype=torch.long)
