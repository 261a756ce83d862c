"""Continuous batching of decode steps: the sequences decoding at the same time share one forward a step.

Why: a decode step is bound by reading the weights (and on the CPU by per-op overhead), which costs
about the same for eight rows as for one. Concurrent answers (the server's requests, each decoding in
its own thread) used to take turns at the model lock, one token each; here they meet.

How: every open `StaticDecoder` registers with its model's `Batcher` (one that replays a CUDA graph
steps through it only while others decode too: a graph replays one sequence's step).
A step call hands over (its buffers, token(s), first position, first slot) and waits. The first caller that finds no
step running leads: it waits (at most `window_s`) until every registered sequence has handed over its
next token, then runs `LeanStep.many` under the model lock for all of them and wakes each with its
own logits. Sequences join whenever they make their first step and leave when they close (an answer
that ended, or a stream its client abandoned: closed by the generator's cleanup), so the batch is
re-formed every step. A sequence decoding alone may add drafted tokens to its call
(kvrag.decode.draft): their rows ride the same forward, each seeing the rows before it. Token choice,
stop rules and sampling stay in each request's own loop (`kvrag.decode.stream`): a batched answer
picks its tokens from its own logits with its own generator. Each row attends over its own slots exactly as alone; only the projections' float order
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
    tokens: Sequence[int]  # the token chosen, then any drafted after it
    position: int
    slot: int
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    steps: int = 0  # forwards run
    rows: int = 0  # sequence-steps served by them
    drafts: int = 0  # drafted tokens they also computed (kvrag.decode.draft), right or not
    largest: int = 0  # the most sequences in one forward
    sizes: dict[int, int] = field(default_factory=dict)  # sequences -> forwards of that many


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

    def alone(self) -> bool:
        """Whether at most one sequence is decoding (a CUDA graph may then serve it: kvrag.decode.static)."""
        with self._cond:
            return self._open <= 1

    def drafts_allowed(self) -> bool:
        """Whether a sequence may add drafted tokens to its next step (as many as its DecodeConfig
        asks): only while it decodes alone; others' rows already fill the forward, and a sequence
        served from its drafts would keep the others waiting for its call."""
        return self.alone()

    def step(self, buffers: Sequence[KV], tokens: Sequence[int], position: int, slot: int) -> torch.Tensor:
        """This sequence's logits [len(tokens), vocab]: row i after `tokens[: i + 1]`, the tokens fed at
        `position` and written at `slot` of `buffers` onwards."""
        call = _Call(buffers, list(tokens), position, slot)
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
        return call.logits

    def _run(self, batch: list[_Call]) -> None:
        device = self.lm.device
        try:
            tokens = torch.tensor([[t] for c in batch for t in c.tokens], device=device)
            positions = torch.tensor([[c.position + i] for c in batch for i in range(len(c.tokens))], device=device)
            counts = [len(c.tokens) for c in batch]
            with self.lm.lock:
                logits = self._step.many(tokens, positions, [(c.buffers, c.slot) for c in batch], counts)
            for c, rows in zip(batch, logits.split(counts)):
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


def _take(pending: list[_Call], max_rows: int) -> tuple[list[_Call], list[_Call]]:
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


def batcher_for(lm: Any, step: LeanStep) -> Batcher:
    """The one batcher of this model's step (made at its first use): one per model, and per decode
    weights should they be changed (kvrag.decode.lean.use_decode_weights)."""
    with _LOCK:
        b = _BATCHERS.get(step)
        if b is None:
            b = _BATCHERS[step] = Batcher(lm, step)
        return b
