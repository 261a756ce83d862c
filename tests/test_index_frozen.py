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
