"""Continuous batching of decode steps: the sequences decoding at the same time share one forward a step.

Why: a decode step is bound by reading the weights (and on the CPU by per-op overhead), which costs
about the same for eight rows as for one. Concurrent answers (the server's requests, each decoding in
its own thread) used to take turns at the model lock, one token each; here they meet.

How: every `StaticDecoder` over a model with a lean step takes a row of the model's slot pool
(kvrag.decode.pool) through its `Batcher` (`seat`: its context copied in), hands each step over as
(its seat, token(s), position, slot) and waits. The first caller that finds no step running leads: it
waits (at most `window_s`) until every registered sequence has handed over its next token, then runs
the pooled step for all of them under the model lock (kvrag.decode.graphs: on CUDA a graph per row
bucket and span, replayed; elsewhere the same step eagerly) and wakes each with its own logits. A lone
sequence steps the same way (the bucket of one row), so on a GPU every step replays a graph, one
sequence or 32. Sequences join whenever they make their first step and leave when they close (an
answer that ended, or a stream its client abandoned: closed by the generator's cleanup), handing
their answer's K/V back to their own cache, so the batch is re-formed every step. A sequence
decoding alone without a graph may add drafted tokens to its call (kvrag.decode.draft): that step
runs `LeanStep.many` over the pool's rows, each drafted row seeing the rows before it. Token choice,
stop rules and sampling stay in each request's own loop (`kvrag.decode.stream`): a batched answer
picks its tokens from its own logits with its own generator. Each row attends over its own slots
exactly as alone; only the projections' float order may differ (one matrix product for all rows),
which the tests check does not change greedy answers.

A new request's prefill runs between steps: it holds the model lock, and the next step waits for
it (one forward at a time). Chunking it would let steps run beside a long Full Attention prefill,
but a reuse prefill is one pass over the question's few tokens (its cost is loading the chunks' KV),
and on the CPU a prefill keeps every core busy anyway.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvrag.decode.graphs import PooledStep
from kvrag.decode.lean import LeanStep
from kvrag.decode.pool import Seat, SlotPool
from kvrag.model.home_thread import on_home

KV = tuple[torch.Tensor, torch.Tensor]
WINDOW_S = 0.005  # how long a step's leader waits for the other registered sequences' next tokens
MAX_BATCH = 32  # rows in one forward at most


@dataclass(eq=False)
class Call:
    """One sequence's part of a step, and what it got back."""

    seat: Seat
    tokens: Sequence[int]  # the token chosen, then any drafted after it
    position: int
    slot: int
    graph: bool = False  # replay a graph for this step if every call in it asks for one
    logits: torch.Tensor | None = None  # [len(tokens), vocab]
    replayed: bool = False  # served by a replayed CUDA graph
    setup_s: float = 0.0  # spent capturing a graph for this step
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    steps: int = 0  # forwards run
    rows: int = 0  # sequence-steps served by them
    drafts: int = 0  # drafted tokens they also computed (kvrag.decode.draft), right or not
    largest: int = 0  # the most sequences in one forward
    replays: int = 0  # forwards replayed from a CUDA graph
    sizes: dict[int, int] = field(default_factory=dict)  # sequences -> forwards of that many


class Batcher:
    """Runs the decode steps of concurrent sequences of one model together (see the module docstring)."""

    def __init__(self, lm: Any, step: LeanStep, window_s: float = WINDOW_S, max_batch: int = MAX_BATCH) -> None:
        self.lm, self._step = lm, step
        self.window_s, self.max_batch = window_s, max_batch
        self._cond = threading.Condition()
        self._pending: list[Call] = []
        self._open = 0  # registered sequences (open decoders)
        self._running = False
        self._last = 0  # rows of the previous step
        self.stats = BatchStats()
        self._pooled: PooledStep | None = None  # the slot pool and its step, made at the first seat
        self._pool_lock = threading.Lock()  # the pool's rows and buffers (taken inside the model lock)
        self._min_rows = 1

    def reserve(self, rows: int) -> None:
        """Make room for this many sequences at once when the pool is made (kvrag.decode.pool: `min_rows`)."""
        self._min_rows = max(1, rows)

    @property
    def pooled(self) -> PooledStep | None:
        return self._pooled

    def seat(self, kv: Sequence[KV], start: int, limit: int) -> Seat | None:
        """A row of the slot pool for a sequence that starts decoding, its context (the first `start`
        slots of the per-layer `kv`) copied in, writing at most up to slot `limit`; it is then
        registered (`join`). None when the pool cannot take it (full, or another shape): the sequence
        then decodes on its own."""
        k = kv[0][0]
        with self.lm.lock, self._pool_lock:
            if self._pooled is None:
                pool = SlotPool(len(kv), k.shape[1], k.shape[-1], k.dtype, k.device, max_rows=self.max_batch,
                                min_rows=self._min_rows)
                self._pooled = PooledStep(self._step, pool)
            seat = self._pooled.seat(kv, start, limit)
        if seat is not None:
            self.join()
        return seat

    def unseat(self, seat: Seat, into: Sequence[KV] | None = None) -> None:
        """The sequence is done: its answer's K/V go back to `into` (its cache's buffers), its row to the
        pool (the last row moves into it), and no step waits for it any more (`leave`)."""
        try:
            with self.lm.lock, self._pool_lock:
                assert self._pooled is not None
                self._pooled.release(seat, into)
        finally:
            self.leave()

    def clear(self) -> bool:
        """Free the pool's buffers and graphs if no sequence holds a row (True if freed)."""
        with self.lm.lock, self._pool_lock:
            if self._pooled is None or self._pooled.pool.seats:
                return False
            self._pooled = None
            return True

    def join(self) -> None:
        """A sequence starts decoding: later steps wait for it too."""
        with self._cond:
            self._open += 1

    def leave(self) -> None:
        """A sequence is done (or abandoned): no step waits for it any more."""
        with self._cond:
            self._open = max(0, self._open - 1)
            self._cond.notify_all()

    def alone(self) -> bool:
        """Whether at most one sequence is decoding (a CUDA graph may then serve it: kvrag.decode.static)."""
        with self._cond:
            return self._open <= 1

    def drafts_allowed(self) -> bool:
        """Whether a sequence may add drafted tokens to its next step (as many as its DecodeConfig
        asks): only while it decodes alone; others' rows already fill the forward, and a sequence
        served from its drafts would keep the others waiting for its call."""
        return self.alone()

    def step(self, seat: Seat, tokens: Sequence[int], position: int, slot: int, graph: bool = False) -> Call:
        """This sequence's part of the next step: `call.logits` [len(tokens), vocab], row i after
        `tokens[: i + 1]`, the tokens fed at `position` and written at `slot` of its row onwards."""
        call = Call(seat, list(tokens), position, slot, graph)
        with self._cond:
            self._pending.append(call)
            self._cond.notify_all()
            while not call.done:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                deadline = time.monotonic() + self.window_s
                # wait for the sequences that stepped last time and are still open (a newcomer joins when
                # it comes; one that stopped stepping without closing is not waited for again)
                want = min(self._open, max(1, self._last), self.max_batch)
                while len(self._pending) < want and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(left)
                batch, self._pending = _take(self._pending, self.max_batch)
                self._last = len(batch)
                self._cond.release()
                try:
                    on_home(self._run, batch)  # a server's model thread (kvrag.model.home_thread), else here
                finally:
                    self._cond.acquire()
                    self._running = False
                    self._cond.notify_all()
        if call.error is not None:
            raise call.error
        assert call.logits is not None
        return call

    def _run(self, batch: list[Call]) -> None:
        try:
            with self.lm.lock, self._pool_lock:
                pooled = self._pooled
                assert pooled is not None
                if all(len(c.tokens) == 1 for c in batch):
                    graph = all(c.graph for c in batch)
                    out, replayed, setup = pooled.run([(c.seat, c.tokens[0], c.position, c.slot) for c in batch], graph)
                    for c in batch:
                        c.logits, c.replayed, c.setup_s = out[c.seat.row : c.seat.row + 1], replayed, setup
                    self.stats.replays += int(replayed)
                else:  # drafts ride this step: eager, rows of one sequence seeing each other
                    for c, rows in zip(batch, pooled.many([(c.seat, c.tokens, c.position, c.slot) for c in batch])):
                        c.logits = rows
        except BaseException as exc:  # every waiting sequence hears of it, not only the leader
            for c in batch:
                c.error = exc
        finally:
            for c in batch:
                c.done = True
            s = self.stats
            s.steps += 1
            s.rows += len(batch)
            s.drafts += sum(len(c.tokens) - 1 for c in batch)
            s.largest = max(s.largest, len(batch))
            s.sizes[len(batch)] = s.sizes.get(len(batch), 0) + 1


def _take(pending: list[Call], max_rows: int) -> tuple[list[Call], list[Call]]:
    """The calls of the next forward (in order, at least one, at most `max_rows` rows) and those left."""
    rows = 0
    for i, c in enumerate(pending):
        rows += len(c.tokens)
        if i and rows > max_rows:
            return pending[:i], pending[i:]
    return pending, []


_BATCHERS: "weakref.WeakKeyDictionary[Any, Batcher]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def decode_batch_stats(model: Any) -> BatchStats:
    """What the batched decoder has done for `model` so far (over its current decode weights): the
    server's /metrics reads it. Empty until its first batched step."""
    from kvrag.decode.lean import lean_step

    step = lean_step(model) if model is not None else None
    with _LOCK:
        b = _BATCHERS.get(step) if step is not None else None
    return b.stats if b is not None else BatchStats()


def reserve_decode_rows(lm: Any, rows: int) -> None:
    """Let `rows` sequences of `lm` decode together from the start without growing the slot pool (a
    server passes its concurrency): on a GPU each growth drops the captured graphs."""
    from kvrag.decode.lean import lean_step

    step = lean_step(lm.model)
    if step is not None:
        batcher_for(lm, step).reserve(rows)


def batcher_for(lm: Any, step: LeanStep) -> Batcher:
    """The one batcher of this model's step (made at its first use): one per model, and per decode
    weights should they be changed (kvrag.decode.lean.use_decode_weights)."""
    with _LOCK:
        b = _BATCHERS.get(step)
        if b is None:
            b = _BATCHERS[step] = Batcher(lm, step)
        return b
