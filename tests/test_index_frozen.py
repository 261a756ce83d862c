"""A frozen index server costs a bounded wait, never a hang. With `chroma run` stopped by SIGSTOP, `/health`
took 10.1 s (it counted the index) and one request 210 s against the documented 10 s bound (each call
waited its whole timeout, one request after another). Now every call to a shared index is bounded,
a server that has not answered one is refused at once until it does, and `/health` reports the index's
last known state within a second. Real `chroma run` (frozen with SIGSTOP, resumed with SIGCONT), real
HTTP; a tiny random model (the mechanics)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from chroma_server import ChromaServer  # noqa: E402
from kvrag.ingest.index_url import HTTP_TIMEOUT_S  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.model.home_thread import HOME  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

QUESTION = "When do owls hunt at night?"
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}
MARGIN_S = 3.0  # what a 503 may take beyond the documented bound (a shared, busy machine)
AT_ONCE = 6  # retrieving requests sent together while the index is frozen


@pytest.fixture
def chroma(tmp_path):
    server = ChromaServer(tmp_path / "chroma").start()
    try:
        yield server
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def home():
    """The model's home thread, as `kvrag serve` runs it: every engine call of every request runs there,
    one after another (kvrag.model.home_thread), which is what made one slow index call per request add up."""
    stop = threading.Event()
    thread = threading.Thread(target=HOME.serve, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        HOME.wake()
        thread.join(10)


def _timed(call):
    t0 = time.monotonic()
    out = call()
    return out, time.monotonic() - t0


def test_a_frozen_index_is_a_bounded_503_and_health_answers_at_once(chroma, home):
    assert HTTP_TIMEOUT_S == 10.0  # the bound docs/stores.md states
    index = ChunkIndex(url=chroma.url())
    with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live, httpx.Client(base_url=live.url, timeout=120, trust_env=False) as http:
        assert http.post("/v1/chunks", json={"chunks": [OWL]}).status_code == 200
        assert http.post("/v1/chat/completions", json=chat(QUESTION)).status_code == 200
        os.kill(chroma.proc.pid, signal.SIGSTOP)
        try:
            health, took = _timed(lambda: http.get("/health"))
            assert health.status_code == 200 and took < 1.0, took
            assert health.json()["index"]["state"] in ("ok", "unreachable")  # its last known state

            answers: list[tuple[int, float]] = []

            def ask() -> None:
                r, t = _timed(lambda: http.post("/v1/chat/completions", json=chat(QUESTION)))
                answers.append((r.status_code, t) if r.status_code != 503 else (r.json()["error"]["code"], t))

            threads = [threading.Thread(target=ask) for _ in range(AT_ONCE)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert [a for a, _ in answers] == ["index_unavailable"] * AT_ONCE, answers
            assert max(t for _, t in answers) < HTTP_TIMEOUT_S + MARGIN_S, answers

            health, took = _timed(lambda: http.get("/health"))
            assert took < 1.0 and health.json()["index"]["state"] == "unreachable", (took, health.json())
            assert health.json()["status"] == "degraded"
            r, took = _timed(lambda: http.post("/v1/chunks", json={"chunks": [{"id": "fig", "text": "Figs grow."}]}))
            assert r.status_code == 503 and took < HTTP_TIMEOUT_S + MARGIN_S, (r.text, took)
        finally:
            os.kill(chroma.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60  # resumed: the server works again, by itself
        while http.post("/v1/chat/completions", json=chat(QUESTION)).status_code != 200:
            assert time.monotonic() < deadline, "the server did not recover after SIGCONT"
            time.sleep(0.5)
        r = http.post("/v1/chat/completions", json=chat(QUESTION))
        assert r.status_code == 200 and [s["id"] for s in r.json()["kvrag_sources"]] == ["owl"]
        assert http.get("/health").json()["index"]["state"] == "ok"



def test_bounded_calls_give_up_refuse_while_overdue_and_recover():
    from kvrag.ingest.index_calls import BoundedCalls
    from kvrag.ingest.index_url import IndexUnavailableError

    calls, resume = BoundedCalls("chroma://test:1/c", bound_s=0.3), threading.Event()
    assert calls.run(lambda: calls.run(lambda: 7)) == 7  # a call within a call runs inline
    with pytest.raises(ZeroDivisionError):
        calls.run(lambda: 1 / 0)  # the call's own error, as it is
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailableError, match="did not answer within 0.3 s"):
        calls.run(resume.wait)  # a server that never answers
    assert 0.3 <= time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailableError, match="has not answered"):
        calls.run(lambda: 1)  # refused at once while that call is outstanding
    assert time.monotonic() - t0 < 0.1
    resume.set()  # the server answers it: calls go through again
    deadline = time.monotonic() + 5
    while True:
        try:
            assert calls.run(lambda: 2) == 2
            break
        except IndexUnavailableError:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_refresh_waits_briefly_and_runs_one_probe_at_a_time():
    from kvrag.ingest.index_calls import BoundedCalls

    calls, resume, started = BoundedCalls("chroma://test:1/c", bound_s=5), threading.Event(), []

    def probe() -> None:
        started.append(1)
        resume.wait()

    for _ in range(3):
        t0 = time.monotonic()
        calls.refresh(probe, wait_s=0.1)
        assert time.monotonic() - t0 < 1.0
    assert len(started) == 1  # the first is still running: no second probe piles up
    resume.set()
    time.sleep(0.2)
    calls.refresh(probe, wait_s=1.0)
    assert len(started) == 2
