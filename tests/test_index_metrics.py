"""/metrics for index outages: `kvrag_index_unavailable_total` counts requests refused 503 index_unavailable, and
`kvrag_index_state{state=...}` is 1 for the index's state as of its last call (read without calling it). Real
HTTP; the unreachable index is a real refused connection (a loopback port nothing listens on). The outage of a
real `chroma run`, killed and restarted under two replicas, is in test_replicas.py."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from test_backends import free_port  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402


def metric(text: str, name: str) -> float | None:
    """One sample's value from /metrics' text (`name` with its labels, as rendered), None when absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def states(text: str) -> dict[str, float | None]:
    return {s: metric(text, f'kvrag_index_state{{state="{s}"}}') for s in ("ok", "unreachable", "mismatch", "off")}


def test_refusals_for_an_unreachable_index_are_counted_and_its_state_shown():
    index = ChunkIndex(url=f"chroma://127.0.0.1:{free_port()}/kvrag_chunks")  # nothing listens there
    with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        text = http.get("/metrics").text
        assert metric(text, "kvrag_index_unavailable_total") == 0.0
        assert states(text) == {"ok": 0.0, "unreachable": 1.0, "mismatch": 0.0, "off": 0.0}  # its start-up call failed
        r = http.post("/v1/chat/completions", json=chat("When do owls hunt?"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable"
        assert http.post("/v1/chunks", json={"chunks": [{"id": "owl", "text": "Owls hunt at night."}]}).status_code == 503
        assert http.delete("/v1/chunks/owl").status_code == 503
        assert http.post("/v1/chat/completions", json=chat("Hi", kvrag={"retrieve": False})).status_code == 200  # not counted
        assert metric(http.get("/metrics").text, "kvrag_index_unavailable_total") == 3.0


def test_without_an_index_the_state_is_off(tmp_path):
    with LiveServer(create_app(tiny_rag(), SETTINGS)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        text = http.get("/metrics").text
        assert states(text) == {"ok": 0.0, "unreachable": 0.0, "mismatch": 0.0, "off": 1.0}
        assert metric(text, "kvrag_index_unavailable_total") == 0.0
    with LiveServer(create_app(tiny_rag(), SETTINGS, ChunkIndex(tmp_path / "chroma"))) as live:
        assert states(httpx.get(f"{live.url}/metrics", trust_env=False).text)["ok"] == 1.0  # an embedded index
