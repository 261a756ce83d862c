"""A method is only a selection rule: which chunk tokens the shared recompute pass refreshes.

Methods are stateless: `keep()` and `select()` return positions (and the scores behind them) and
nothing is stored on the method between calls, so one instance serves concurrent requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from kvrag.fuse.stitch import Stitched
from kvrag.kv.layout import Links
from kvrag.model.loading import LoadedModel
from kvrag.model.rope import Rotary


@dataclass
class Selection:
    """Global chunk positions a rule picked, and optionally the scores behind the pick.

    `scores` is dense by global position ([context_len], -inf where a position was not scored),
    so it stays meaningful after the context is sparsified.
    """

    positions: torch.Tensor
    scores: torch.Tensor | None = None
    whole_chunks: int = 0  # chunks picked whole besides the top tokens (kvrag.methods.attention), for the stats

    @classmethod
    def empty(cls) -> "Selection":
        return cls(torch.empty(0, dtype=torch.long))

    @classmethod
    def of(cls, picked: "Selection | torch.Tensor | None") -> "Selection | None":
        """A rule's answer as a Selection (a third-party rule may return bare positions)."""
        if picked is None or isinstance(picked, Selection):
            return picked
        return cls(torch.as_tensor(picked, dtype=torch.long))


@dataclass
class SelectContext:
    """Everything a selection rule may look at.

    `exact_chunks`: how many leading chunks hold KV that is already exact (the first chunk, whose
    KV was computed right after the system prefix): no rule spends its budget on them.
    `prior`: the scores a `keep()` returned (SamKV scores tokens while choosing what to keep).
    """

    lm: LoadedModel
    rotary: Rotary
    stitched: Stitched
    exact_chunks: int = 0
    prior: torch.Tensor | None = None

    @property
    def spans(self) -> list[tuple[int, int]]:
        """[start, end) global positions of the chunks a rule may select from."""
        return self.stitched.chunk_spans[self.exact_chunks :]

    def candidates(self) -> torch.Tensor:
        """Chunk positions held in the context that a rule may select (never link slots, never exact chunks)."""
        positions = self.stitched.chunk_positions()
        if self.exact_chunks and self.stitched.chunk_spans:
            end = self.stitched.chunk_spans[min(self.exact_chunks, len(self.stitched.chunk_spans)) - 1][1]
            positions = positions[positions >= end]
        return positions


@dataclass
class LinkSlots:
    """What a method adds to the layout before the pass: K link slots per chunk and their inputs."""

    per_chunk: int = 0
    embeds: torch.Tensor | None = None  # [n_chunks * K, hidden]
    scope: str = "global"  # what the slots attend to (Segments.link_scope): "chunk" for trailers

    @property
    def layout(self) -> Links:
        """The slots as the layout lays them out: count and scope."""
        return Links(self.per_chunk, self.scope)


@dataclass
class PrepareContext:
    """What `Method.prepare` may use: the model, the chunk count, and the engine's link adapter."""

    lm: LoadedModel
    n_chunks: int
    link_adapter: Callable[[], Any]  # -> LinkAdapter | None, resolved only when a method asks
    default_links: dict[int, torch.Tensor]


class Method:
    """Base of every method; subclasses set `name` and implement `select`.

    Parameters are keyword arguments of the subclass constructor (with the papers' defaults), so
    `rag.answer(..., method="a3", layer=2)` reaches them.
    """

    name: ClassVar[str] = ""
    full_attention: ClassVar[bool] = False  # True only for the no-reuse baseline
    update: str = "overwrite"  # how recomputed KV is written: "overwrite" or "fusion" (SamKV eq. 4)
    # layer-wise loading (kvrag.fuse.layer_feed): True when keep/select read stitched KV only at layers this
    # rule's own probes reached (kvrag.fuse.probe fills those), so the other layers load behind the probes and
    # the pass; otherwise every layer is filled first. Declared per class, never inherited: a subclass
    # may read more than its parent.
    probed_layers_only: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "probed_layers_only" not in cls.__dict__:
            cls.probed_layers_only = False

    def prepare(self, ctx: PrepareContext) -> LinkSlots:
        """Anything the layout needs before the context is stitched (KVLink's link slots); none by default."""
        return LinkSlots()

    def keep(self, ctx: SelectContext) -> Selection | None:
        """Chunk positions to keep in the cache (a sparsifying method); None keeps everything."""
        return None

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        """Global positions among `ctx.candidates()` to recompute, exactly `budget` of them."""
        raise NotImplementedError


class ScoredMethod(Method):
    """A rule that scores every candidate token and keeps the `budget` highest."""

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        """One score per candidate token, aligned with `ctx.candidates()`."""
        raise NotImplementedError

    def select(self, ctx: SelectContext, budget: int) -> Selection:
        positions = ctx.candidates()
        if budget <= 0:
            return Selection.empty()
        if budget >= positions.numel():
            return Selection(positions)
        scores = self.scores(ctx).float().cpu()
        top = torch.topk(scores, budget).indices
        dense = torch.full((ctx.stitched.segments.context_len,), float("-inf"))
        dense[positions] = scores
        return Selection(positions[top].sort().values, dense)


def token_budget(ratio: float, chunk_tokens: int) -> int:
    """How many chunk tokens a recompute ratio buys (rounded, clipped to the chunk tokens)."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"recompute_ratio must be within [0, 1], got {ratio}")
    return min(chunk_tokens, int(round(ratio * chunk_tokens)))
