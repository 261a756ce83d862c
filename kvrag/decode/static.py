"""Decoding over a preallocated static KV cache: one fixed-shape step per token, capturable in a CUDA graph.

Why: on a GPU a small model's decode step costs mostly kernel launches (hundreds per token), and
replaying a captured CUDA graph issues them all at once. A graph replays fixed shapes and fixed
buffer addresses, so a step never lets a per-token Python number into the model's inputs.

`StaticDecoder` is the stepper `kvrag.decode.stream` calls, `(token, position) -> logits`. On a model
with a lean step (kvrag.decode.lean: Llama, Mistral, Qwen2/3) it takes a row of the model's slot pool
(kvrag.decode.pool) and steps together with every other sequence decoding now (kvrag.decode.batch),
replaying one CUDA graph per batch bucket on CUDA (kvrag.decode.graphs). Otherwise, or when the pool
is full, it steps alone with `StaticStep` over its own buffers:

- the KV buffers are the prefilled cache's own (the room reserved after the context, grown once
  here if it is too small); each step writes its K/V at the `slot` tensor (index_copy_) and attends
  over the whole buffer;
- the mask comes from `slot`: every slot up to it is visible (every held slot, a sparse stitched
  context's included whatever their global positions, precedes the answer) and the unused room is
  hidden (and zeroed, so no uninitialised NaN can leak through a masked weight of 0);
- the RoPE position is the `position` tensor: the global next position, not the slot index.

Sampling stays outside the step, on the returned logits with the caller's generator, so a graphed
decode picks its tokens exactly as the eager one does. The same steps run eagerly on the CPU (where
tests check their tokens against the growing-cache decode); the capture paths are never run by the
CPU test suite: tests/test_cuda.py checks graph == eager tokens on a GPU.

Without a graph (the CPU), a step may also feed tokens drafted from the prompt (kvrag.decode.draft):
their rows are the logits the following steps would compute, kept and served when the token chosen is
the one drafted; the slots of a draft not chosen are simply written again by the next forward.

Its cache is `kvrag.model.cache.SlotCache` (every transformers Cache subclass lives there): a layer of
fixed capacity that decodes in a SpliceLayer's reserved room (`SpliceLayer.room`) and hands the grown
length back when decoding ends (`SpliceLayer.adopt`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from kvrag.decode.batch import batcher_for
from kvrag.decode.pool import Seat
from kvrag.decode.draft import PromptLookup
from kvrag.decode.graphs import CAPTURE_LOCK
from kvrag.decode.lean import lean_step
from kvrag.model.ape import DecodeApe, decoding_with
from kvrag.model.cache import SlotCache, SpliceLayer, cache_arg
from kvrag.model.home_thread import on_home

log = logging.getLogger(__name__)

KV = tuple[torch.Tensor, torch.Tensor]


class StaticStep:
    """One decode step over fixed-shape inputs. `set` fills them outside; `run` is the region a
    CUDA graph captures (on the CPU it simply runs), returning the next token's logits [vocab]."""

    def __init__(self, model: Any, buffers: Sequence[KV], dtype: torch.dtype, device: torch.device, lean: bool = True,
                 ape: DecodeApe | None = None) -> None:
        capacity = buffers[0][0].shape[-2]
        self.model = model
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.buffers = list(buffers)
        self.cache = SlotCache(buffers, self.slot)
        self.lean = lean_step(model) if lean else None  # the same modules without the stock forward's overhead
        self._slots = torch.arange(capacity, device=device)
        self._visible = torch.zeros((), dtype=dtype, device=device)
        self._hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=device)
        # APE over the chunk slots: which slots are context, made once (a graph reads the same buffer)
        self.ape = ape if ape is not None and ape.ape.active else None
        self._ape_ctx = self.ape.context(capacity, device)[None, None, None] if self.ape is not None else None

    def set(self, token: int, position: int, slot: int) -> None:
        """The step's inputs, written in place (their addresses are what a graph reads)."""
        self.token.fill_(token)
        self.position.fill_(position)
        self.slot.fill_(slot)

    @torch.no_grad()
    def run(self) -> torch.Tensor:
        """The forward of `token` at `position`, writing slot `slot`; no host sync, no shape that changes."""
        mask = torch.where(self._slots <= self.slot, self._visible, self._hidden)[None, None, None]
        if self.lean is not None:
            ape = (self._ape_ctx, self.ape.ape) if self.ape is not None else None
            return self.lean(self.token, self.position, self.buffers, self.slot, mask, ape)[0]
        with decoding_with(self.ape):
            return self._model_step(mask)

    def _model_step(self, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=self.token,
            position_ids=self.position,
            attention_mask=mask,
            **cache_arg(self.model, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]


def supports(cache: Any) -> bool:
    """Whether `cache` can be decoded statically: one sequence, every layer holding the same slot count
    (one mask serves all layers). SnapKV's gathered caches qualify; anything else decodes eagerly."""
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None for layer in layers):
        return False
    lengths = {layer.keys.shape[-2] for layer in layers}
    return len(lengths) == 1 and all(layer.keys.shape[0] == 1 for layer in layers)


class StaticDecoder:
    """Steps a prefilled cache token by token through one `StaticStep`, replayed from a CUDA graph when
    `graph` (default: on CUDA). Called as `decoder(token, position) -> logits`; `close()` hands the
    written length back to the cache, so it reads afterwards as if decoded by appending."""

    WARMUP = 2  # eager runs on a side stream before capture (allocator, cuBLAS/SDPA lazy setup)

    def __init__(self, lm: Any, cache: Any, steps: int, graph: bool | None = None,
                 context_ids: Sequence[int] = (), draft_tokens: int = 0, ape: DecodeApe | None = None) -> None:
        """`steps`: the most forwards this decode can take (the room is made to hold them).
        `draft_tokens`: tokens drafted from `context_ids` (the prompt's) and the answer so far to feed
        with each step when it decodes alone (kvrag.decode.draft); without a graph only. On a model
        with a lean step the sequence takes a row of the model's slot pool and steps with every other
        sequence decoding now (kvrag.decode.batch), from a graph per batch bucket on CUDA; otherwise
        (or when the pool is full) it steps alone over its own buffers, from a graph of its own."""
        if not supports(cache):
            raise ValueError("this cache cannot be decoded statically (layers of different lengths, or a batch)")
        t = time.perf_counter()
        self.cache = cache
        self.start = cache.layers[0].keys.shape[-2]
        self.buffers = [_room(layer, self.start + steps) for layer in cache.layers]
        self.capacity = self.buffers[0][0].shape[-2]
        self.written = 0
        self.graph = lm.device.type == "cuda" if graph is None else graph
        self._lock = lm.lock
        self._batcher = None
        self._seat: Seat | None = None
        lean = lean_step(lm.model)
        self._weights = lean.weights if lean is not None else "model"
        ape = ape if ape is not None and ape.ape.active else None
        if lean is not None and ape is None:  # every device: concurrent answers share one forward a step (APE: alone)
            self._batcher = batcher_for(lm, lean)
            self._seat = self._batcher.seat(self.buffers, self.start, self.start + steps)
            if self._seat is None:  # the pool cannot take it: decode alone
                self._batcher = None
            else:
                self.capacity = self.start + steps
        self.seated = self._seat is not None  # decodes in a row of the model's slot pool, batched with the others
        # the single-sequence step over its own buffers (not made for a seated sequence)
        self.step = StaticStep(lm.model, self.buffers, lm.dtype, lm.device, ape=ape) if self._seat is None else None
        self.draft_tokens = draft_tokens if self._seat is not None and not self.graph else 0
        self._lookup = PromptLookup(context_ids) if self.draft_tokens > 0 else None
        self._ahead: list[tuple[int, torch.Tensor]] = []  # (drafted token, the logits after it), verified already
        self.forwards = 0  # forwards run; the rest of the steps were served from verified drafts
        self.accepted = 0  # steps whose token was the one drafted, served without a forward
        self._graph: Any = None  # torch.cuda.CUDAGraph of the single-sequence step, once captured
        self._out: torch.Tensor | None = None
        self.replays = 0  # steps served by replaying a graph (tests read it: the capture did not fall back)
        # the one-time cost before the first step: the room, the pool row's copy, and on CUDA the graph's
        # warm-up and capture when a step needs one (synchronised, so it includes the device's copies);
        # `AnswerStats.decode_setup_s`
        self.setup_s = time.perf_counter() - t

    @property
    def weights(self) -> str:
        """What the steps read: "model" (its own weights) or "int8" (kvrag.decode.int8)."""
        return self._weights

    @property
    def captured(self) -> bool:
        """Whether the steps replay a captured CUDA graph (tests read this)."""
        return self._graph is not None or self.replays > 0

    @torch.no_grad()
    def __call__(self, token: int, position: int) -> torch.Tensor:
        """Logits after feeding `token` at global `position`; valid until the next call."""
        slot = self.start + self.written
        if slot >= self.capacity:
            raise RuntimeError(f"static decode ran out of its {self.capacity - self.start} reserved slots")
        if self._lookup is not None:
            self._lookup.append(token)
        if self._ahead:  # the last forward also read the token drafted for this step
            drafted, logits = self._ahead.pop(0)
            if drafted == token:  # its K/V sit at this slot already
                self.written += 1
                self.accepted += 1
                return logits
            self._ahead.clear()  # not chosen: the slots it and those after it wrote are rewritten from here
        if self._seat is not None:  # with the other sequences decoding now (alone: a bucket of one)
            drafts = self._drafts(slot)
            call = self._batcher.step(self._seat, [token, *drafts], position, slot, self.graph)
            self.replays += int(call.replayed)
            self.setup_s += call.setup_s
            rows = call.logits
            self._ahead = list(zip(drafts, rows[1:]))
            logits = rows[0]
        else:
            logits = on_home(self._locked, token, position, slot)
        self.forwards += 1
        self.written += 1
        return logits

    def _drafts(self, slot: int) -> list[int]:
        """Tokens to feed after this step's, within the reserved room (none when others decode too)."""
        if self._lookup is None or not self._batcher.drafts_allowed():  # a lookup implies a batcher
            return []
        return self._lookup.propose(min(self.draft_tokens, self.capacity - slot - 1))

    def _locked(self, token: int, position: int, slot: int) -> torch.Tensor:
        with self._lock:
            self.step.set(token, position, slot)
            return self._replay() if self.graph else self.step.run()

    def _replay(self) -> torch.Tensor:
        if self._graph is None:
            t = time.perf_counter()
            try:
                self._out = self._capture()
            except RuntimeError as err:  # e.g. a rope variant that syncs on the host: decode eagerly instead
                log.warning("CUDA graph capture failed (%s); decoding this answer without a graph", err)
                self.graph = False
                return self.step.run()
            finally:
                self.setup_s += time.perf_counter() - t
        self._graph.replay()
        self.replays += 1
        assert self._out is not None
        return self._out

    def _capture(self) -> torch.Tensor:
        """Capture `StaticStep.run` (GPU only; never run by the CPU tests). The warm-up runs compute this
        very step (same inputs, same slot), so the replay that follows rewrites the same K/V. Once per
        answer: the graph holds this answer's buffers (`decode_setup_s` says what that costs)."""
        with CAPTURE_LOCK:  # one capture at a time per process (the pooled step's too)
            return self._capture_now()

    def _capture_now(self) -> torch.Tensor:
        """Warm up and capture on a side stream with CUDAGraph's own begin/end. Not `torch.cuda.graph`:
        on entering, it synchronises the device and empties the device's caching allocator and (torch
        2.13) the pinned host one, so after every answer the store's next pinned read buffers would be
        page-locked afresh (cudaHostAlloc, ~GB/s), and older torch versions run gc.collect() there too.
        The CUDA tests (tests/test_cuda.py) check the replayed tokens against eager decoding."""
        device = self.step.token.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self.step.run()
            # thread_local: other threads (store loads, other engines) may use CUDA while this one captures
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = self.step.run()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:  # the capture was invalidated by what failed: nothing to end
                    pass
                raise
            graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)  # the set-up's time is the device's too
        self._graph = graph
        return out

    def close(self) -> None:
        """Hand the written length back to the cache's layers (a seated sequence's answer K/V copied back
        from its pool row first) and free a graph of its own (and its memory pool)."""
        if self._seat is not None:
            seat, self._seat = self._seat, None
            self._batcher.unseat(seat, self.buffers)
        length = self.start + self.written
        for layer, (kbuf, vbuf) in zip(self.cache.layers, self.buffers):
            _adopt(layer, kbuf, vbuf, length)
        self._graph = self._out = None


def _room(layer: Any, capacity: int) -> KV:
    """Buffers [1, kv_heads, >= capacity, d] whose first slots are the layer's: a SpliceLayer's own
    (grown once if its reserved room is short), else a copy. The unused room is zeroed (finite)."""
    n = layer.keys.shape[-2]
    if isinstance(layer, SpliceLayer):
        kbuf, vbuf = layer.room(capacity)
    else:
        kbuf, vbuf = _with_room(layer.keys, capacity), _with_room(layer.values, capacity)
    kbuf[..., n:, :].zero_()
    vbuf[..., n:, :].zero_()
    return kbuf, vbuf


def _with_room(t: torch.Tensor, capacity: int) -> torch.Tensor:
    buf = t.new_empty(*t.shape[:-2], capacity, t.shape[-1])
    buf[..., : t.shape[-2], :] = t
    return buf


def _adopt(layer: Any, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
    """Make the layer hold the first `length` slots of these buffers (a SpliceLayer keeps them as its room)."""
    if isinstance(layer, SpliceLayer):
        layer.adopt(kbuf, vbuf, length)
    else:
        layer.keys, layer.values = kbuf[..., :length, :], vbuf[..., :length, :]
