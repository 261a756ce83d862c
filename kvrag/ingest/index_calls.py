"""Calls to a shared index server (`chroma run`), each bounded in time, and a server that has stopped
answering refused at once instead of waited for again.

Why: a frozen server (SIGSTOP, a stalled disk, a full machine) accepts connections and never answers.
Even with httpx timeouts each call then held its caller for the whole timeout, and a serving process
runs every request's engine call on one thread (kvrag.model.home_thread), so 20 retrieving requests
took 10 s, 20 s, ... 210 s against the documented 10 s. Here a call runs in a daemon thread and its
caller waits at most `bound_s` (HTTP_TIMEOUT_S): then it gets IndexUnavailableError, and the call is
left to finish in the background (the server answers once it is resumed, or httpx gives up after
READ_TIMEOUT_S). While such an overdue call is outstanding the server is known not to answer, so new
calls are refused at once; the first one after it finishes tries again. `refresh` is what /health uses:
at most one probe in flight, waited for briefly, so health reports the last known state at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, wait
from typing import Any, Callable, TypeVar

from kvrag.ingest.index_url import HTTP_TIMEOUT_S, IndexUnavailableError

__all__ = ["BoundedCalls"]

T = TypeVar("T")


class BoundedCalls:
    """Calls to the index server at `where` (as messages name it), each waited for at most `bound_s`."""

    def __init__(self, where: str, bound_s: float = HTTP_TIMEOUT_S) -> None:
        self.where, self.bound_s = where, bound_s
        self._lock = threading.Lock()
        self._overdue = 0  # calls past their bound, still running
        self._overdue_since = 0.0
        self._probe: Future | None = None
        self._local = threading.local()

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` (a call to the server), its result or its error within `bound_s`; IndexUnavailableError
        when it has not answered by then, or at once while an earlier call is still overdue. A call made
        from within a call runs as it is: its caller's bound covers it."""
        if getattr(self._local, "inside", False):
            return fn()
        with self._lock:
            overdue, since = self._overdue, self._overdue_since
        if overdue:
            raise IndexUnavailableError(
                f"the index server at {self.where} has not answered a call for {time.monotonic() - since:.0f} s "
                "(frozen or overloaded?); retry once it answers")
        done: Future = Future()
        threading.Thread(target=self._work, args=(fn, done), name="kvrag-index-call", daemon=True).start()
        if not wait([done], timeout=self.bound_s).done:
            self._late(done)
            raise IndexUnavailableError(f"the index server at {self.where} did not answer within {self.bound_s:g} s "
                                        "(frozen or overloaded?); retry once it answers")
        return done.result()

    def _work(self, fn: Callable[[], Any], done: Future) -> None:
        self._local.inside = True
        done.set_running_or_notify_cancel()
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            done.set_exception(exc)

    def _late(self, done: Future) -> None:
        with self._lock:
            if not self._overdue:
                self._overdue_since = time.monotonic() - self.bound_s  # when the call was made
            self._overdue += 1
        done.add_done_callback(self._answered)  # at once if it finished meanwhile

    def _answered(self, _: Future) -> None:
        with self._lock:
            self._overdue -= 1

    def refresh(self, fn: Callable[[], Any], wait_s: float) -> None:
        """Run `fn` (which makes its own bounded calls and records how they went) in the background unless
        the last such run is still going, and wait for it at most `wait_s`."""
        with self._lock:
            probe = self._probe
            if probe is None or probe.done():
                probe = self._probe = Future()
                threading.Thread(target=self._quietly, args=(fn, probe), name="kvrag-index-probe", daemon=True).start()
        wait([probe], timeout=wait_s)

    @staticmethod
    def _quietly(fn: Callable[[], Any], probe: Future) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - the outcome is in what `fn` recorded (ChunkIndex.state)
            pass
        finally:
            probe.set_result(None)
