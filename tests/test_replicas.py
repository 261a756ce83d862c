"""Issue #52: several replicas, several users. Two `kvrag serve` processes share one `chroma run` (the
retrieval index) and one Redis (the KV): what either ingests the other retrieves and answers from
cached KV; what either deletes neither retrieves; the index server killed mid-run is a 503 (never an
answer without context), and once restarted everything is back, nothing lost. Real servers, real
HTTP, the openai client; a tiny model (the mechanics, not the answers' wording)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from chroma_server import ChromaServer  # noqa: E402
from conftest import SHORT_CONTEXT_ENV  # noqa: E402
from test_backends import REDIS, RedisServer, free_port  # noqa: E402
from test_index_metrics import metric, states  # noqa: E402

pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")

WRITE_KEY, READ_KEY = "sk-replica-admin", "sk-replica-app"
FACTS = [{"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"},
         {"id": "bee", "text": "Bees make honey from the nectar of flowers.", "title": "Bees"},
         {"id": "ant", "text": "Ants build nests under the ground.", "title": "Ants"}]

SERVE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from kvrag import KVRag, from_model
    from kvrag.server.runner import serve
    from kvrag.server.settings import ServerSettings
    from tiny import tiny_model, tiny_tokenizer

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store={store!r})
    serve(ServerSettings(port={port}, max_new_tokens=4, index={index!r}, api_keys=({write!r},), read_keys=({read!r},)), rag=rag)
    """
)


def _env(home: Path, **extra: str) -> dict[str, str]:
    return {"KVRAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "ANONYMIZED_TELEMETRY": "False", "KVRAG_CALIBRATE": os.environ.get("KVRAG_CALIBRATE", "0"),
            **{n: os.environ[n] for n in SHORT_CONTEXT_ENV}, **extra}


class Replica:
    def __init__(self, store: str, index: str, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = SERVE.format(tests=str(Path(__file__).parent), store=store, port=self.port, index=index, write=WRITE_KEY, read=READ_KEY)
        self.proc = subprocess.Popen([sys.executable, "-c", code], env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait(self, seconds: float = 180) -> "Replica":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"replica exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.3)
        raise AssertionError(f"replica at {self.url} did not come up in {seconds} s")

    def http(self, method: str, path: str, key: str | None = WRITE_KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=60, trust_env=False, **kw)

    def openai(self, key: str = READ_KEY) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(trust_env=False, timeout=60))

    def ask(self, question: str, key: str = READ_KEY):
        """A plain OpenAI request (no kvrag context: the server retrieves), raw, for its headers."""
        return self.openai(key).chat.completions.with_raw_response.create(
            model="kvrag", messages=[{"role": "user", "content": question}], max_tokens=4)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    chroma, redis = ChromaServer(root / "chroma").start(), RedisServer()
    redis.start()
    replicas = [Replica(redis.url, chroma.url(), root / f"home{i}") for i in range(2)]
    try:
        for r in replicas:
            r.wait()
        yield chroma, replicas[0], replicas[1], root
    finally:
        for r in replicas:
            r.stop()
        chroma.stop()
        redis.stop()


def _sources(raw) -> list[dict]:
    return raw.parse().model_extra["kvrag_sources"]


def test_ingested_through_a_is_retrieved_and_answered_through_b(cluster):
    _, a, b, _ = cluster
    r = a.http("POST", "/v1/chunks", json={"chunks": FACTS})
    assert r.status_code == 200 and r.json()["indexed"] == 3, r.text
    raw = b.ask("When do owls hunt?")
    body = raw.parse()
    assert [s["id"] for s in _sources(raw)][0] == "owl" and body.choices[0].message.content is not None
    assert raw.headers["x-kvrag-sources"].startswith('["owl"')
    stats = body.model_extra["kvrag_stats"]
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0 and stats["chunk_prefill_tokens"] == 0  # A's KV, via Redis
    health = b.http("GET", "/health", key=None).json()
    assert health["index"] == {"kind": "chroma://", "state": "ok"} and health["chunks"]["retrievable"] == 3
    assert str(cluster[0].port) not in str(health)  # the kind only, no host or port


def test_kvrag_ingest_with_the_shared_index_names_files_relative_to_the_folder(cluster, monkeypatch):
    from kvrag.cli.app import main

    chroma, a, b, root = cluster
    docs = root / "docs"
    (docs / "rail").mkdir(parents=True)
    (docs / "rail" / "brannoch.md").write_text("The Brannoch Line opened in 1893 between Brannoch and the coast.\n")
    monkeypatch.setenv("KVRAG_HOME", str(root / "cli-home"))
    monkeypatch.setenv("KVRAG_API_KEY", WRITE_KEY)  # what the CLI sends a keyed server
    assert main(["ingest", str(docs), "--server", a.url, "--index", chroma.url()]) == 0
    sources = _sources(b.ask("When did the Brannoch Line open?"))
    assert sources[0]["source"] == "rail/brannoch.md" and sources[0]["title"] == "brannoch"
    assert str(root) not in str(sources)


def test_an_id_one_replica_holds_is_not_rewritten_through_the_other(cluster):
    _, a, b, _ = cluster
    other = [{**FACTS[0], "text": "Owls hunt at noon in the busy market."}]
    r = b.http("POST", "/v1/chunks", json={"chunks": other})
    assert r.status_code == 409 and r.json()["error"]["code"] == "chunk_exists", r.text
    assert b.http("POST", "/v1/chunks", key=READ_KEY, json={"chunks": other, "replace": True}).status_code == 403
    assert a.http("POST", "/v1/chunks", key=None, json={"chunks": other}).status_code == 401
    assert "noon" not in str(a.http("POST", "/v1/chat/completions", key=READ_KEY,
                                    json={"model": "kvrag", "messages": [{"role": "user", "content": "owls"}],
                                          "kvrag": {"chunk_ids": ["owl"]}}).json())


def test_deleted_through_b_is_gone_from_as_retrieval(cluster):
    _, a, b, _ = cluster
    assert "bee" in [s["id"] for s in _sources(a.ask("What do bees make?"))]
    assert b.http("DELETE", "/v1/chunks/bee", key=READ_KEY).status_code == 403
    r = b.http("DELETE", "/v1/chunks/bee")
    assert r.status_code == 200 and r.json()["unindexed"] is True, r.text
    assert "bee" not in [s["id"] for s in _sources(a.ask("What do bees make?"))]
    assert "bee" not in [s["id"] for s in _sources(b.ask("What do bees make?"))]


def test_the_index_server_killed_is_a_503_then_right_again_nothing_lost(cluster):
    chroma, a, b, _ = cluster
    before = a.http("GET", "/health", key=None).json()["chunks"]["retrievable"]
    chroma.kill()
    try:
        for replica in (a, b):
            with pytest.raises(openai.InternalServerError) as refused:
                replica.ask("When do owls hunt?")
            assert refused.value.status_code == 503 and refused.value.body["code"] == "index_unavailable"
            health = replica.http("GET", "/health", key=None).json()
            assert health["status"] == "degraded" and health["index"]["state"] == "unreachable"
        r = a.http("POST", "/v1/chunks", json={"chunks": [{"id": "wasp", "text": "Wasps build paper nests.", "title": "Wasps"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "index_unavailable" and "retry-after" in r.headers
        assert b.http("DELETE", "/v1/chunks/ant").status_code == 503
        for replica in (a, b):  # two refusals each (a question, and an ingest or a delete), and the state
            seen = replica.http("GET", "/metrics", key=READ_KEY).text
            assert metric(seen, "kvrag_index_unavailable_total") == 2.0 and states(seen)["unreachable"] == 1.0
        own = a.http("POST", "/v1/chat/completions", key=READ_KEY, json={  # a request's own context needs no index
            "model": "kvrag", "messages": [{"role": "user", "content": "owls?"}], "max_tokens": 2,
            "kvrag": {"chunks": [FACTS[0]]}})
        assert own.status_code == 200, own.text
    finally:
        chroma.start()
    for replica in (a, b):
        assert [s["id"] for s in _sources(replica.ask("When do owls hunt?"))][0] == "owl"
        assert replica.http("GET", "/health", key=None).json()["chunks"]["retrievable"] == before
        assert states(replica.http("GET", "/metrics", key=READ_KEY).text) == {"ok": 1.0, "unreachable": 0.0, "mismatch": 0.0, "off": 0.0}
    assert "ant" in [s["id"] for s in _sources(a.ask("Where do ants build nests?"))]  # the refused DELETE changed nothing
    assert a.http("POST", "/v1/chunks", json={"chunks": [{"id": "wasp", "text": "Wasps build paper nests.", "title": "Wasps"}]}).status_code == 200
    assert "wasp" in [s["id"] for s in _sources(b.ask("Which insects build paper nests?"))]


def test_chat_openai_sees_what_the_answer_read_when_it_asks(cluster):
    """LangChain's ChatOpenAI drops kvrag_sources; `"kvrag": {"cite": true}` puts them in the text it shows."""
    langchain_openai = pytest.importorskip("langchain_openai")
    _, _, b, _ = cluster
    llm = langchain_openai.ChatOpenAI(base_url=b.url + "/v1", api_key=READ_KEY, model="kvrag", max_tokens=4, temperature=0,
                                      max_retries=0, http_client=httpx.Client(trust_env=False, timeout=60))
    assert "Sources:" not in llm.invoke("When did the Brannoch Line open?").content  # off unless asked
    cited = llm.bind(extra_body={"kvrag": {"cite": True}})
    content = cited.invoke("When did the Brannoch Line open?").content
    assert "Sources:\n[1] brannoch (rail/brannoch.md)" in content, content
    assert "".join(str(c.content) for c in cited.stream("When did the Brannoch Line open?")) == content  # streamed: a last piece


def test_a_replica_with_another_embedding_model_refuses_to_start(cluster, monkeypatch, capsys):
    import chromadb

    chroma, _, _, root = cluster
    client = chromadb.HttpClient(host="127.0.0.1", port=chroma.port, settings=chromadb.Settings(anonymized_telemetry=False))
    client.get_or_create_collection("other_model", metadata={"kvrag_embedding": "bge-large-en/1024/normalized"})
    monkeypatch.setenv("KVRAG_HOME", str(root / "mismatch-home"))
    from kvrag.cli.app import main

    assert main(["serve", "--port", str(free_port()), "--index", chroma.url("other_model")]) == 2  # the CLI's error exit
    err = capsys.readouterr().err
    assert "bge-large-en/1024/normalized" in err and "embedding model" in err
    assert "loading model" not in err  # refused before any model loads


# -- an id one replica holds in its own table, replaced or deleted through the other ---------------------------
def _by_id(replica: Replica, chunk_id: str) -> httpx.Response:
    return replica.http("POST", "/v1/chat/completions", key=READ_KEY, json={
        "model": "kvrag", "messages": [{"role": "user", "content": "What is it?"}], "max_tokens": 1,
        "kvrag": {"chunk_ids": [chunk_id]}})


def _prompt_tokens_inline(replica: Replica, chunk: dict) -> int:
    r = replica.http("POST", "/v1/chat/completions", key=READ_KEY, json={
        "model": "kvrag", "messages": [{"role": "user", "content": "What is it?"}], "max_tokens": 1, "kvrag": {"chunks": [chunk]}})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_an_id_b_holds_replaced_through_a_is_answered_from_the_new_text_by_both(cluster):
    _, a, b, _ = cluster
    old = {"id": "kiwi", "text": "Kiwis are flightless birds.", "title": "Kiwis"}
    new = {**old, "text": "Kiwi fruit grows on woody vines in New Zealand; it has a fuzzy brown skin, green flesh and "
                          "rows of small black seeds around a pale core."}
    assert b.http("POST", "/v1/chunks", json={"chunks": [old]}).status_code == 200  # B's own table holds "kiwi" now
    before = _by_id(b, "kiwi")
    assert before.status_code == 200 and before.json()["usage"]["prompt_tokens"] == _prompt_tokens_inline(b, old)
    r = a.http("POST", "/v1/chunks", json={"chunks": [new], "replace": True})
    assert r.status_code == 200, r.text
    want = _prompt_tokens_inline(a, new)
    assert want != before.json()["usage"]["prompt_tokens"]
    for replica in (a, b):
        after = _by_id(replica, "kiwi")
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["prompt_tokens"] == want  # the new text, never the one B registered
        assert after.json()["kvrag_stats"]["cache_hits"] == 1  # A's KV of the new text, through Redis


def test_an_id_b_holds_deleted_through_a_is_chunk_not_found_on_both(cluster):
    _, a, b, _ = cluster
    fig = {"id": "fig", "text": "Fig trees are pollinated by tiny wasps.", "title": "Figs"}
    assert b.http("POST", "/v1/chunks", json={"chunks": [fig]}).status_code == 200  # B's own table holds "fig"
    assert _by_id(b, "fig").status_code == 200
    assert a.http("DELETE", "/v1/chunks/fig").status_code == 200
    for replica in (a, b):
        gone = _by_id(replica, "fig")
        assert gone.status_code == 400 and gone.json()["error"]["code"] == "chunk_not_found", gone.text
    assert b.http("DELETE", "/v1/chunks/fig").status_code == 404  # nothing left anywhere to delete
