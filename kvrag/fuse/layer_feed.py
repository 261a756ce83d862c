"""Layer-wise loading of the stitched context: layer i's KV is filled when a pass first needs it.

Loading every layer before the first forward puts the whole host-to-device copy in front of the
prefill. Here the chunk stacks stay on the host (pinned on CUDA) and each destination layer is
filled on demand (LMCache's layer-wise pipeline):

- on CUDA, a side stream copies a layer's keys and values (non_blocking: from pinned memory a DMA
  that never stalls the host), rotates the keys to their global positions and records one event
  per layer. `ensure(i)` makes the current stream wait on layer i's event (a device-side wait, no
  host sync) and issues the next `lookahead` layers, so layer i+1's copy runs while layer i computes;
- on the CPU the same code fills layer i synchronously on its first `ensure(i)` (nothing to overlap).

Nothing in the per-layer path reads a tensor's value on the host: slots and ranges are Python ints
fixed when the feed is built.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterable, Sequence

import torch

from kvrag.kv.layout import Segments
from kvrag.model.cache import LayerStack
from kvrag.model.rope import Rotary
from kvrag.timing import clock

DEFAULT_LOOKAHEAD = 2  # layers issued ahead of the one a pass asks for (CUDA only)


def copy_layer(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One layer's slice to its destination: asynchronous from pinned host memory (and on the device)."""
    dst.copy_(src, non_blocking=True)


class LayerFeed:
    """Fills the layers of a stitched context's buffers on demand; see the module docstring.

    `keys`/`values` [layers, kv_heads, context slots, head_dim] are the destination (the stitched
    context, slots = positions); `prefix` is on the device; `chunks` anywhere (host, pinned on CUDA).
    """

    def __init__(
        self,
        prefix: LayerStack,
        chunks: Sequence[LayerStack],
        segments: Segments,
        rotary: Rotary,
        keys: torch.Tensor,
        values: torch.Tensor,
        lookahead: int = DEFAULT_LOOKAHEAD,
    ) -> None:
        self.keys, self.values = keys, values
        self.layers = int(keys.shape[0])
        self.device = keys.device
        self.cuda = self.device.type == "cuda"
        self.lookahead = max(0, int(lookahead)) if self.cuda else 0
        self.rotary = rotary
        self._prefix = prefix
        self.n_prefix, self.total = int(prefix[0].shape[2]), segments.context_len
        # (start, end) context slots of each chunk and of each chunk's link slots (zeros until the pass)
        self._chunks = [(s, s + int(k.shape[2]), k, v) for s, (k, v) in zip(segments.chunk_starts, chunks)]
        self._links = [(e, e + segments.links) for s, e, _, _ in self._chunks] if segments.links else []
        width = self.total - self.n_prefix
        # raw (unrotated) keys land in a staging buffer laid out like the context after the prefix,
        # then one rotation per layer writes them to their slots; a ring of them for layers in flight
        n_stage = (self.lookahead + 1) if self._chunks else 0
        self._stage = [keys.new_zeros(1, keys.shape[1], width, keys.shape[3]) for _ in range(n_stage)]
        self._positions = torch.arange(self.n_prefix, self.total, device=self.device)  # made on the device: no copy
        self.issued = [False] * self.layers  # layer's fill enqueued (CPU: done)
        self.waited = [False] * self.layers  # the current stream is ordered after the layer's fill
        self.order: list[int] = []  # layers in the order they were issued
        self._next = 0  # CUDA: the next layer to issue
        self._closed = False
        self._copy_s = 0.0
        self._wait_s = 0.0
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffers and sources are ready
            self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # per issued layer, on the side stream
            self._waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # around each wait, on the current stream
            self._done: list[torch.cuda.Event | None] = [None] * self.layers

    # -- demand -----------------------------------------------------------------------------------
    def ensure(self, layer: int) -> None:
        """Make layer `layer` usable by work queued on the current stream from now on."""
        if self.cuda:  # in layer order, up to `lookahead` layers past this one
            top = min(self.layers - 1, layer + self.lookahead)
            while self._next <= top:
                self._issue(self._next)
                self._next += 1
        elif not self.issued[layer]:  # this layer only, now
            self._issue(layer)
        if self.waited[layer]:
            return
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(current)
            current.wait_event(self._done[layer])
            after.record(current)
            self._waits.append((before, after))
        self.waited[layer] = True

    def ensure_layers(self, layers: Iterable[int]) -> None:
        for i in layers:
            self.ensure(i)

    def ensure_all(self) -> None:
        self.ensure_layers(range(self.layers))

    @property
    def complete(self) -> bool:
        return all(self.waited)

    # -- the fill ---------------------------------------------------------------------------------
    def _issue(self, i: int) -> None:
        if self._closed:
            raise RuntimeError(f"layer {i} asked of a closed layer feed (its prefill failed or finished)")
        self.issued[i] = True
        self.order.append(i)
        if not self.cuda:
            t = clock(self.device)
            self._fill(i)
            spent = clock(self.device) - t
            self._copy_s += spent
            self._wait_s += spent  # on the CPU every fill is waited for
            return
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        self._fill(i)
        done.record(self.stream)
        self._spans.append((start, done))
        self._done[i] = done

    def _fill(self, i: int) -> None:
        """Prefix, chunk values and rotated chunk keys of layer i; link slots zeroed."""
        keys, values = self.keys[i : i + 1], self.values[i : i + 1]
        n = self.n_prefix
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            copy_layer(keys[:, :, :n], self._prefix[0][i : i + 1])
            copy_layer(values[:, :, :n], self._prefix[1][i : i + 1])
            if not self._chunks:
                return
            stage = self._stage[i % len(self._stage)]
            for start, end, k, v in self._chunks:
                copy_layer(stage[:, :, start - n : end - n], k[i : i + 1])
                copy_layer(values[:, :, start:end], v[i : i + 1])
            self.rotary.rotate(stage, self._positions, out=keys[:, :, n : self.total])
            for start, end in self._links:
                keys[:, :, start:end].zero_()
                values[:, :, start:end].zero_()

    # -- the end ----------------------------------------------------------------------------------
    def timings(self) -> tuple[float, float]:
        """(seconds of layer copy+rotate work, seconds the consumer waited for it); on CUDA read from
        the events, so call it after the device has caught up (a `clock()` after the pass)."""
        if not self.cuda:
            return self._copy_s, self._wait_s
        copy = sum(a.elapsed_time(b) for a, b in self._spans) / 1000
        wait = sum(a.elapsed_time(b) for a, b in self._waits) / 1000
        return copy, wait

    def close(self) -> None:
        """Order the current stream after every fill issued (so the buffers the side stream wrote or
        read are safe to free or reuse) and drop the host sources and staging buffers."""
        if self.cuda and not self._closed:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._closed = True
        self._chunks, self._stage, self._prefix = [], [], (self.keys[:, :, :0], self.values[:, :, :0])
