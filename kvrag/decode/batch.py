"""Continuous batching of decode steps: the sequences decoding at the same time share one forward a step.

Why: a decode step is bound by reading the weights (and on the CPU by per-op overhead), which costs
about the same for eight rows as for one. Concurrent answers (the server's requests, each decoding in
its own thread) used to take turns at the model lock, one token each; here they meet.

How: every open `StaticDecoder` that decodes without a graph registers with its model's `Batcher`.
A step call hands over (its buffers, token, position, slot) and waits. The first caller that finds no
step running leads: it waits (at most `window_s`) until every registered sequence has handed over its
next token, then runs `LeanStep.many` under the model lock for all of them and wakes each with its
own logits. Sequences join whenever they make their first step and leave when they close (an answer
that ended, or a stream its client abandoned: closed by the generator's cleanup), so the batch is
re-formed every step. Token choice, stop rules and sampling stay in each request's own loop
(`kvrag.decode.stream`): a batched answer picks its tokens from its own logits with its own
generator. Each row attends over its own slots exactly as alone; only the projections' float order
may differ (one matrix product for all rows), which the tests check does not change greedy answers.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvrag.decode.lean import LeanStep
from kvrag.model.home_thread import on_home

KV = tuple[torch.Tensor, torch.Tensor]
WINDOW_S = 0.005  # how long a step's leader waits for the other registered sequences' next tokens
MAX_BATCH = 32  # rows in one forward at most


@dataclass(eq=False)
class _Call:
    buffers: Sequence[KV]
    token: int
    position: int
    slot: int
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    steps: int = 0  # forwards run
    rows: int = 0  # sequence-steps served by them
    largest: int = 0  # the most rows in one forward
    sizes: dict[int, int] = field(default_factory=dict)  # rows -> forwards of that many rows


class Batcher:
    """Runs the decode steps of concurrent sequences of one model together (see the module docstring)."""

    def __init__(self, lm: Any, step: LeanStep, window_s: float = WINDOW_S, max_batch: int = MAX_BATCH) -> None:
        self.lm, self._step = lm, step
        self.window_s, self.max_batch = window_s, max_batch
        self._cond = threading.Condition()
        self._pending: list[_Call] = []
        self._open = 0  # registered sequences (open decoders)
        self._running = False
        self._last = 0  # rows of the previous step
        self.stats = BatchStats()

    def join(self) -> None:
        """A sequence starts decoding: later steps wait for it too."""
        with self._cond:
            self._open += 1

    def leave(self) -> None:
        """A sequence is done (or abandoned): no step waits for it any more."""
        with self._cond:
            self._open = max(0, self._open - 1)
            self._cond.notify_all()

    def step(self, buffers: Sequence[KV], token: int, position: int, slot: int) -> torch.Tensor:
        """This sequence's logits [vocab] after `token` at `position`, written at `slot` of `buffers`."""
        call = _Call(buffers, token, position, slot)
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
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
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
        return call.logits

    def _run(self, batch: list[_Call]) -> None:
        device = self.lm.device
        try:
            tokens = torch.tensor([[c.token] for c in batch], device=device)
            positions = torch.tensor([[c.position] for c in batch], device=device)
            with self.lm.lock:
                logits = self._step.many(tokens, positions, [(c.buffers, c.slot) for c in batch])
            for i, c in enumerate(batch):
                c.logits = logits[i]
        except BaseException as exc:  # every waiting sequence hears of it, not only the leader
            for c in batch:
                c.error = exc
        finally:
            for c in batch:
                c.done = True
            s = self.stats
            s.steps += 1
            s.rows += len(batch)
            s.largest = max(s.largest, len(batch))
            s.sizes[len(batch)] = s.sizes.get(len(batch), 0) + 1


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


def batcher_for(lm: Any, step: LeanStep) -> Batcher:
    """The one batcher of this model's step (made at its first use): one per model, and per decode
    weights should they be changed (kvrag.decode.lean.use_decode_weights)."""
    with _LOCK:
        b = _BATCHERS.get(step)
        if b is None:
            b = _BATCHERS[step] = Batcher(lm, step)
        return b
