"""EPIC / LegoLink: recompute the first tokens of every chunk (the attention-sink rule)."""

from __future__ import annotations

import torch

from kvrag.methods.base import Method, SelectContext, Selection


class Epic(Method):
    """EPIC/LegoLink: the first tokens of each chunk, budget split evenly across chunks."""

    name = "epic"
    probed_layers_only = True  # reads no KV

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        spans = ctx.spans
        if budget <= 0 or not spans:
            return Selection.empty()
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
        return Selection(torch.tensor(sorted(picked), dtype=torch.long))
