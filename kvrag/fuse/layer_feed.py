"""Layer-wise loading of the stitched context: layer i's KV is filled when a pass first needs it.

Loading every layer before the first forward puts the whole host-to-device copy in front of the
prefill. Here the chunk stacks stay on the host (pinned on CUDA) and the destination is filled on
demand (LMCache's layer-wise pipeline), in layer groups:

- a group's raw KV arrives with one copy per chunk for all of the group's layers (a chunk entry's
  layers are contiguous, so each is one DMA), never one per chunk per layer; a group's size is
  chosen so a request issues about `COPY_BUDGET` chunk copies whatever its chunk count;
- each layer's keys are then rotated to their global positions in place, over the whole context at
  once with cos/sin computed once per request: per layer a fixed handful of ops, whatever the
  number of chunks;
- on CUDA, a side stream does both and records one event per layer. `ensure(i)` makes the current
  stream wait on layer i's event (a device-side wait, no host sync) and issues the next `lookahead`
  layers, so later layers' copies run while layer i computes;
- on the CPU the same code fills on the first `ensure(i)` (nothing to overlap), one layer a group
  unless `group_layers` says otherwise, so a probe fills only the layers it reaches.

Nothing in the per-layer or per-chunk path reads a tensor's value on the host: slots and ranges are
Python ints fixed when the feed is built.
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
COPY_BUDGET = 128  # chunk copies (keys and values each) a request's feed aims for on CUDA


def group_size(layers: int, chunks: int, cuda: bool, budget: int = COPY_BUDGET) -> int:
    """Layers per copy group: on CUDA as few groups as keep a request near `budget` chunk copies (at
    least one layer a group, so a short request still overlaps its copies layer by layer); on the
    CPU one layer a group (a fill costs what it reads; filling ahead buys nothing)."""
    if not cuda or chunks == 0:
        return 1
    groups = max(1, min(layers, budget // max(1, chunks)))
    return -(-layers // groups)


def copy_layer(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One slice to its destination: asynchronous from pinned host memory (and on the device)."""
    dst.copy_(src, non_blocking=True)


class LayerFeed:
    """Fills the layers of a stitched context's buffers on demand; see the module docstring.

    `keys`/`values` [layers, kv_heads, context slots, head_dim] are the destination (the stitched
    context, slots = positions); `prefix` is on the device; `chunks` anywhere (host, pinned on CUDA).
    `group_layers`: layers per copy group (default: `group_size`).
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
        group_layers: int | None = None,
    ) -> None:
        self.keys, self.values = keys, values
        self.layers = int(keys.shape[0])
        self.device = keys.device
        self.cuda = self.device.type == "cuda"
        self.lookahead = max(0, int(lookahead)) if self.cuda else 0
        self.rotary = rotary
        self._prefix = prefix
        self.n_prefix, self.total = int(prefix[0].shape[2]), segments.context_len
        # (start, end) context slots of each chunk, and the link slots (zeros until the pass) as one index
        self._chunks = [(s, s + int(k.shape[2]), k, v) for s, (k, v) in zip(segments.chunk_starts, chunks)]
        self._links = torch.tensor(segments.link_positions(), dtype=torch.long, device=self.device) if segments.links else None
        self.group = max(1, int(group_layers or group_size(self.layers, len(self._chunks), self.cuda)))
        self._copied = [False] * (-(-self.layers // self.group))  # a group's raw KV enqueued
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # every layer's: computed on first use
        self.issued = [False] * self.layers  # layer's fill enqueued (CPU: done)
        self.waited = [False] * self.layers  # the current stream is ordered after the layer's fill
        self.order: list[int] = []  # layers in the order they were issued
        self.copies = 0  # chunk copies issued (keys and values each count one)
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
        """Layer i: its group's raw KV if not there yet, then its keys rotated and its link slots zeroed."""
        with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
            g = i // self.group
            if not self._copied[g]:
                self._copy_group(g)
            if not self._chunks:
                return
            n = self.n_prefix
            cos, sin = self._rotation()
            self.rotary.rotate_in_place(self.keys[i : i + 1, :, n : self.total], cos, sin)
            if self._links is not None:
                self.keys[i].index_fill_(1, self._links, 0)
                self.values[i].index_fill_(1, self._links, 0)

    def _copy_group(self, g: int) -> None:
        """Prefix and raw (unrotated) chunk KV of every layer in group g: two copies per chunk."""
        self._copied[g] = True
        a, b = g * self.group, min(self.layers, (g + 1) * self.group)
        n = self.n_prefix
        copy_layer(self.keys[a:b, :, :n], self._prefix[0][a:b])
        copy_layer(self.values[a:b, :, :n], self._prefix[1][a:b])
        for start, end, k, v in self._chunks:
            copy_layer(self.keys[a:b, :, start:end], k[a:b])
            copy_layer(self.values[a:b, :, start:end], v[a:b])
            self.copies += 2

    def _rotation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of every context position after the prefix, once per request, made on the device."""
        if self._cos_sin is None:
            positions = torch.arange(self.n_prefix, self.total, device=self.device)
            self._cos_sin = self.rotary.cos_sin(positions, self.keys)
        return self._cos_sin

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
        read are safe to free or reuse) and drop the host sources and rotation tables."""
        if self.cuda and not self._closed:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._closed = True
        self._chunks, self._cos_sin = [], None
        self._prefix = (self.keys[:, :, :0], self.values[:, :, :0])
