"""One thread runs the model's work in a serving process: `on_home(fn, ...)`.

Why: torch's CPU kernels run on OpenMP (libgomp), and every thread that starts a parallel region
gets a team of worker threads of its own. Once a process holds more such threads than CPUs, libgomp
stops letting idle workers spin and puts them to sleep after every region, so each of the hundreds of
small regions of a decode step pays a wake-up: measured on a 2-core machine, a decode step run by any
thread other than the one that ran torch first was ~1.6x slower (16 against 26 tokens/s), and so was
everything once a server's worker threads had each run a forward.

So a server makes one thread the model's home (`kvrag serve`: the main thread, which loaded the
model; uvicorn runs beside it) and sends every model call there: prefills, ingests, each batched
decode step, and the token choice of sampled answers. When no home thread is serving (the library,
the CLI, tests that run a server in a thread), `on_home` simply calls the function in the calling
thread: nothing changes for them.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class HomeThread:
    """A queue of calls that one thread (the one in `serve`) runs in order."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[tuple[Callable[..., Any], tuple, dict, Future] | None]" = queue.SimpleQueue()
        self._ident: int | None = None

    @property
    def serving(self) -> bool:
        return self._ident is not None

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` run on the home thread (here when none serves, or when this is it)."""
        ident = self._ident
        if ident is None or ident == threading.get_ident():
            return fn(*args, **kwargs)
        fut: Future = Future()
        self._queue.put((fn, args, kwargs, fut))
        while True:
            try:
                return fut.result(timeout=0.5)
            except TimeoutError:
                if self._ident is None and fut.cancel():  # it stopped after we looked: nobody will run it
                    raise RuntimeError("the server is shutting down") from None

    def serve(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        """Run queued calls on this thread until `stop` is set; calls still queued then get an error."""
        self._ident = threading.get_ident()
        try:
            while not stop.is_set():
                try:
                    item = self._queue.get(timeout=poll_s)
                except queue.Empty:
                    continue
                if item is not None:
                    _run(*item)
        finally:
            self._ident = None
            while True:  # nobody will run these now: their callers must not wait forever
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[3].set_exception(RuntimeError("the server is shutting down"))

    def wake(self) -> None:
        """Let `serve` notice its stop event now rather than at its next poll."""
        self._queue.put(None)


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
        fut.set_exception(exc)


HOME = HomeThread()


def on_home(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on the process's model thread when one serves; else here (see the module docstring)."""
    return HOME.call(fn, *args, **kwargs)
