"""The pooled decode step, replayed from one CUDA graph per (row bucket, span): `PooledStep`.

Why: a decode step of an 8B model is ~1,000 kernel launches; eagerly the host cannot issue them as
fast as the GPU runs them (measured on an H200: a batched eager step took 81.5 ms for one row where
the graphed single-sequence step took 10.7 ms). A graph replays them at once, but only over the
shapes and addresses it was captured with. The slot pool (kvrag.decode.pool) gives every step
fixed addresses, and its buckets give a handful of shapes: each (rows, span) is captured the first
time a step needs it and replayed from then on, whoever the sequences in its rows are. Sequences join
and leave between steps without a capture; only a pool that grows (more rows, a longer sequence than
its capacity) drops the graphs, which are then captured again as steps need them.

The graphs share one memory pool (as vLLM's do): safe because a graph's output is copied out right
after its replay, before any other graph runs. Without a graph (the CPU, or `graph=False`) the same
`LeanStep.rows` runs eagerly over the same buffers and inputs, so the CPU tests check the logic the
GPU replays. A capture that fails (e.g. a rope variant that syncs on the host) turns graphs off for
this step and it runs eagerly from then on.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import torch

from kvrag.decode.attend import key_splits
from kvrag.decode.lean import LeanStep
from kvrag.decode.pool import KV, Seat, SlotPool

log = logging.getLogger(__name__)
# torch allows one graph capture at a time per process; engines over different models may decode in parallel threads
CAPTURE_LOCK = threading.Lock()
WARMUP = 2  # eager runs on a side stream before a capture (allocator, cuBLAS lazy set-up)


class PooledStep:
    """A model's slot pool and the step over it: `run(feeds, graph)` steps the fed sequences once."""

    def __init__(self, step: LeanStep, pool: SlotPool) -> None:
        self.step, self.pool = step, pool
        self.graphs_on = True  # off for good once a capture failed
        self._graphs: dict[tuple[int, int, int], tuple[Any, torch.Tensor]] = {}
        self._generation = -1
        self._mempool: Any = None
        self.captures = 0  # graphs captured (tests read it: joining and leaving capture nothing new)
        self.replays = 0

    def run(self, feeds: Sequence[tuple[Seat, int, int, int]], graph: bool) -> tuple[torch.Tensor, bool, float]:
        """One step: each (seat, token, position, slot) in `feeds` feeds its token and writes its slot.
        Returns the logits of the bucket's rows [rows, vocab] (a copy: row `seat.row` is that
        sequence's), whether a graph was replayed, and the seconds spent capturing one."""
        pool = self.pool
        rows, span = pool.set_inputs(feeds)
        key = (rows, span, key_splits(rows, pool.kv_heads, span, pool.device))
        if not (graph and self.graphs_on):
            return self.region(*key), False, 0.0
        if self._generation != pool.generation:  # the buffers were reallocated: the old graphs read freed memory
            self._graphs.clear()
            self._mempool = torch.cuda.graph_pool_handle()
            self._generation = pool.generation
        setup = 0.0
        entry = self._graphs.get(key)
        if entry is None:
            t = time.perf_counter()
            try:
                with CAPTURE_LOCK:
                    entry = self._graphs[key] = self._capture(key)
            except RuntimeError as err:
                log.warning("CUDA graph capture failed (%s); decoding without graphs", err)
                self.graphs_on = False
                return self.region(*key), False, time.perf_counter() - t
            setup = time.perf_counter() - t
        g, out = entry
        g.replay()
        self.replays += 1
        return out.clone(), True, setup  # copied now: the next replay (of any graph: they share memory) overwrites it

    def region(self, rows: int, span: int, splits: int) -> torch.Tensor:
        """What a graph captures: the step over the pool's persistent inputs (no host sync inside)."""
        tokens, positions, buffers, write, slots = self.pool.step_inputs(rows, span)
        return self.step.rows(tokens, positions, buffers, write, slots, splits)

    def _capture(self, key: tuple[int, int, int]) -> tuple[Any, torch.Tensor]:
        """Warm up and capture `region(*key)` on a side stream (GPU only; the CPU tests run the region
        eagerly). The warm-up runs compute this very step (same inputs), so the replay that follows
        rewrites the same K/V. CUDAGraph's own begin/end, not `torch.cuda.graph`: that one synchronises
        and empties the caching allocators (the store's pinned buffers too) on every capture."""
        device = self.pool.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self.region(*key)
            # thread_local: other threads (store loads, other engines) may use CUDA while this one captures
            g.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
            try:
                out = self.region(*key)
            except BaseException:
                try:
                    g.capture_end()
                except RuntimeError:  # the capture was invalidated by what failed: nothing to end
                    pass
                raise
            g.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)  # the set-up's time is the device's too
        self.captures += 1
        return g, out

    def many(self, feeds: Sequence[tuple[Seat, Sequence[int], int, int]]) -> list[torch.Tensor]:
        """A step where a sequence feeds several rows (a token and the drafts after it, kvrag.decode.draft),
        eager only: `LeanStep.many` over the seats' rows of the pool. Logits [len(tokens), vocab] each."""
        device = self.pool.device
        tokens = torch.tensor([[t] for _, toks, _, _ in feeds for t in toks], device=device)
        positions = torch.tensor([[p + i] for _, toks, p, _ in feeds for i in range(len(toks))], device=device)
        counts = [len(toks) for _, toks, _, _ in feeds]
        for seat, toks, _, slot in feeds:
            if not (seat.start <= slot and slot + len(toks) <= seat.limit):
                raise RuntimeError(f"slots {slot}..{slot + len(toks)} are outside this sequence's room [{seat.start}, {seat.limit})")
            seat.end = max(seat.end, slot + len(toks))
        logits = self.step.many(tokens, positions, [(self.pool.row_buffers(s.row), slot) for s, _, _, slot in feeds], counts)
        return list(logits.split(counts))

    def seat(self, kv: Sequence[KV], start: int, limit: int) -> Seat | None:
        """A row for a sequence starting to decode (its context copied in), or None if the pool cannot hold it."""
        if not self.pool.fits(kv, limit):
            return None
        return self.pool.seat(kv, start, limit)

    def release(self, seat: Seat, into: Sequence[KV] | None = None) -> None:
        self.pool.release(seat, into)
