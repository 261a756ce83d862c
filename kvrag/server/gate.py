"""Admission: a fixed number of running requests plus a bounded queue, refusing the rest at once.

Refusing early (503 + Retry-After) beats queueing without bound: a client waiting behind a long
queue gets its answer later than if it retried, and the server's memory stays bounded.
"""

from __future__ import annotations

import asyncio
import time


class QueueFullError(Exception):
    """Every slot is running and the queue is full."""


class Slot:
    """One admitted request's hold on the engine; `release()` is idempotent, so a stream's `finally`
    and an error path may both call it."""

    def __init__(self, gate: "RequestGate", waited_s: float) -> None:
        self._gate = gate
        self.waited_s = waited_s
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gate._release()


class RequestGate:
    """`max_running` requests hold a slot; up to `max_waiting` more wait (FIFO) for one."""

    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running = 0
        self.waiting = 0
        self._sem: asyncio.Semaphore | None = None  # made on first use, inside the server's event loop

    async def acquire(self) -> Slot:
        """A slot, after waiting in the queue if need be; QueueFullError when the queue is full."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_running)
        if self.running >= self.max_running and self.waiting >= self.max_waiting:
            raise QueueFullError(f"server busy: {self.running} running, {self.waiting} waiting (queue limit {self.max_waiting})")
        t0 = time.perf_counter()
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        return Slot(self, time.perf_counter() - t0)

    def _release(self) -> None:
        self.running -= 1
        assert self._sem is not None
        self._sem.release()

    def as_dict(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting, "max_concurrency": self.max_running, "max_queue": self.max_waiting}
