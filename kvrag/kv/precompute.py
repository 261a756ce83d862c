"""Offline KV computation: the system prefix once, then chunks in length-sorted batches.

A chunk's KV is computed with the system prefix before it (so one chunk after the prefix reused
is exactly Full Attention), then its keys are stripped of RoPE for storage.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tqdm.auto import tqdm

from kvrag.model.cache import LayerStack, cache_arg, cache_kv, empty_cache, prefix_cache, stack_layers
from kvrag.model.loading import LoadedModel
from kvrag.model.rope import Rotary

class KVComputer:
    """Runs the model to produce prefix and chunk KV."""

    def __init__(self, lm: LoadedModel, rotary: Rotary) -> None:
        self.lm = lm
        self.rotary = rotary

    @torch.no_grad()
    def prefix_kv(self, prefix_ids: Sequence[int]) -> LayerStack:
        """KV of the system prefix at positions 0..S-1 (kept rotated: it never moves)."""
        model = self.lm.model
        ids = torch.tensor([list(prefix_ids)], device=self.lm.device)
        cache = empty_cache()
        model(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=ids.device)[None], **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
        return stack_layers(cache_kv(cache))

    @torch.no_grad()
    def chunk_kv(
        self,
        prefix: LayerStack,
        chunks: Sequence[Sequence[int]],
        batch_size: int = 8,
        progress: bool = False,
        context: Sequence[Sequence[int]] | None = None,
    ) -> list[LayerStack]:
        """RoPE-free KV of each chunk, computed after the prefix (and after `context[i]` if given).

        `context` holds extra tokens placed between the prefix and the chunk whose KV is then
        dropped; similarity-guided preprocessing uses it to let a chunk see its neighbours.
        Every chunk's KV is held until the end: to store as you go, use `iter_chunk_kv`.
        """
        out: list[LayerStack | None] = [None] * len(chunks)
        bar = tqdm(total=len(chunks), desc="chunk KV", unit="chunk", disable=not progress)
        for batch in self.iter_chunk_kv(prefix, chunks, batch_size, context):
            for i, stack in batch:
                out[i] = stack
            bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    def iter_chunk_kv(
        self,
        prefix: LayerStack,
        chunks: Sequence[Sequence[int]],
        batch_size: int = 8,
        context: Sequence[Sequence[int]] | None = None,
    ) -> Iterator[list[tuple[int, LayerStack]]]:
        """`chunk_kv` one forward batch at a time: yields [(position in `chunks`, KV)] per batch
        (chunks of similar length together), holding nothing once the caller lets a batch go, so a
        caller that stores each batch before asking for the next keeps one batch's KV in memory."""
        ctx = [list(c) for c in context] if context is not None else [[] for _ in chunks]
        order = sorted(range(len(chunks)), key=lambda i: len(ctx[i]) + len(chunks[i]))
        for batch in _batches(order, batch_size):
            with torch.no_grad():
                stacks = self._chunk_batch(prefix, [ctx[i] for i in batch], [chunks[i] for i in batch])
            out = list(zip(batch, stacks))
            del stacks
            yield out
            del out  # before the next batch is computed

    def _chunk_batch(self, prefix: LayerStack, ctxs: list[list[int]], chunks: list[Sequence[int]]) -> list[LayerStack]:
        model, device = self.lm.model, self.lm.device
        pk, pv = prefix
        s = pk.shape[2]
        lens = [len(c) + len(x) for c, x in zip(chunks, ctxs)]
        width = max(lens)
        pad = 0
        ids = torch.full((len(chunks), width), pad, dtype=torch.long, device=device)
        for row, (c, x) in enumerate(zip(chunks, ctxs)):
            seq = list(x) + list(c)
            ids[row, : len(seq)] = torch.tensor(seq, device=device)
        # Right padding needs no mask: causal attention never lets a real token see a later pad.
        b = len(chunks)
        cache = prefix_cache([(pk[i : i + 1].expand(b, -1, -1, -1), pv[i : i + 1].expand(b, -1, -1, -1)) for i in range(pk.shape[0])])
        positions = torch.arange(s, s + width, device=device)[None].expand(b, -1)
        model(input_ids=ids, position_ids=positions, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
        kv = cache_kv(cache)
        result = []
        for row, (c, x) in enumerate(zip(chunks, ctxs)):
            start = s + len(x)
            keys, values = stack_layers(kv, start, start + len(c), row=row)
            keys = self.rotary.unrotate(keys, torch.arange(start, start + len(c)))
            result.append((keys.contiguous(), values.contiguous()))
        return result


def _batches(items: list[int], size: int) -> Iterator[list[int]]:
    size = max(1, int(size))
    for i in range(0, len(items), size):
        yield items[i : i + size]
