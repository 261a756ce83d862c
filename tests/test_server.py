"""`kvrag serve` over real HTTP: uvicorn on a free loopback port, a tiny random model behind it."""

from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
import uvicorn  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvrag import Chunk, KVRag, from_model  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from kvrag.server.errors import APIError  # noqa: E402
from kvrag.server.schemas import ChatRequest, answer_options  # noqa: E402
from kvrag.client import ServerError, ask_via_server, delete_via_server, health, ingest_via_server  # noqa: E402
from test_backends import REDIS, RedisServer, free_port  # noqa: E402
from tiny import THREE_CHUNKS, THREE_Q, tiny_model, tiny_tokenizer  # noqa: E402

SETTINGS = ServerSettings(max_body_bytes=64 * 1024, max_chunks=4, max_request_tokens=6000, max_new_tokens=8)


class LiveServer:
    """uvicorn serving an app in a thread, on a free loopback port; `stop()` sets `should_exit`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def tiny_rag(store: str = "memory://") -> KVRag:
    return KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=store)


@pytest.fixture(scope="module")
def rag() -> KVRag:
    return tiny_rag()


@pytest.fixture(scope="module")
def live(rag):
    with LiveServer(create_app(rag, SETTINGS)) as server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60, trust_env=False) as client:
        yield client


def chunk_json(chunks: list[Chunk]) -> list[dict[str, str]]:
    return [{"id": c.id, "text": c.text, "title": c.title} for c in chunks]


def chat(question: str = THREE_Q, **extra: Any) -> dict[str, Any]:
    return {"model": "kvrag", "messages": [{"role": "user", "content": question}], "max_tokens": 6, **extra}


def sse_events(response: httpx.Response) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# -- chat, ingest, delete ----------------------------------------------------------------------------
def test_ingest_then_chat_by_id(http):
    r = http.post("/v1/chunks", json={"chunks": chunk_json(THREE_CHUNKS)})
    assert r.status_code == 200, r.text
    assert r.json()["chunks"] == 3 and r.json()["computed"] + r.json()["already_cached"] == 3
    again = http.post("/v1/chunks", json={"chunks": chunk_json(THREE_CHUNKS)}).json()
    assert again["already_cached"] == 3 and again["computed"] == 0

    r = http.post("/v1/chat/completions", json=chat(kvrag={"chunk_ids": ["a", "b"], "method": "a3", "recompute_ratio": 0.5}))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(body["choices"][0]["message"]["content"], str)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    stats = body["kvrag_stats"]
    assert stats["method"] == "a3" and stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    assert stats["recomputed_tokens"] > 0
    assert body["usage"]["prompt_tokens"] == stats["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == stats["generated_tokens"] <= 6


def test_chat_with_inline_chunks_and_plain_chat(http):
    chunks = [Chunk("inline-1", "Owls hunt at night in the quiet forest.", title="Owls")]
    first = http.post("/v1/chat/completions", json=chat("When do owls hunt?", kvrag={"chunks": chunk_json(chunks)})).json()
    assert first["kvrag_stats"]["cache_misses"] == 1
    second = http.post("/v1/chat/completions", json=chat("When do owls hunt?", kvrag={"chunks": chunk_json(chunks)})).json()
    assert second["kvrag_stats"]["cache_hits"] == 1
    plain = http.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hello there"}], "max_tokens": 3})
    assert plain.status_code == 200 and plain.json()["kvrag_stats"]["path"] == "plain"


def test_streaming_matches_non_streaming(http):
    req = chat(kvrag={"chunk_ids": ["a", "c"]}, max_tokens=8, temperature=0)
    whole = http.post("/v1/chat/completions", json=req).json()
    with http.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == chunks[0]["id"] for e in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
    assert text.strip() == whole["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    assert last["kvrag_stats"]["cache_hits"] == 2 and last["usage"]["completion_tokens"] == last["kvrag_stats"]["generated_tokens"]


def test_delete_forgets_a_chunk(http):
    c = Chunk("to-delete", "Lighthouses guide ships along rocky coasts.")
    assert http.post("/v1/chunks", json={"chunks": chunk_json([c])}).status_code == 200
    r = http.delete("/v1/chunks/to-delete")
    assert r.status_code == 200 and r.json()["kv_entries_removed"] >= 1
    gone = http.post("/v1/chat/completions", json=chat(kvrag={"chunk_ids": ["to-delete"]}))
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "chunk_not_found"
    assert http.delete("/v1/chunks/to-delete").status_code == 404
    assert http.delete("/v1/chunks/never-seen").json()["error"]["code"] == "chunk_not_found"


# -- bad input: 4xx with the engine's message, never a 500 ---------------------------------------------
@pytest.mark.parametrize(
    "body, code, needle",
    [
        ({"messages": []}, "invalid_request", "messages"),
        (chat(kvrag={"chunk_ids": ["nope"]}), "chunk_not_found", "unknown chunk id"),
        (chat(kvrag={"chunk_ids": ["a"], "method": "magic"}), "invalid_method", "unknown method 'magic'"),
        (chat(kvrag={"chunk_ids": ["a"], "recompute_ratio": 1.5}), "invalid_request", "recompute_ratio"),
        (chat(kvrag={"chunk_ids": ["a"], "method": "a3", "params": {"bogus": 1}}), "invalid_method", "bogus"),
        (chat(kvrag={"chunk_ids": []}), "no_chunks", "no chunks"),
        (chat("   "), "invalid_request", "non-empty"),
        (chat("x" * 4500), "context_length_exceeded", "context"),
        (chat(max_tokens=10**6), "invalid_request", "max_tokens"),
        ({"messages": [{"role": "assistant", "content": "hi"}], "kvrag": {"chunk_ids": ["a"]}}, "invalid_request", "human message"),
    ],
)
def test_bad_input_is_a_400_with_a_clear_message(http, body, code, needle):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code and needle in err["message"]


def test_a_request_naming_no_method_is_checked_against_the_engines_default():
    """Over a tuned model the engine answers with kvlink: its own parameters pass the early check,
    while the same request over a cacheblend engine is a 400 naming the parameter."""
    req = ChatRequest(**chat(kvrag={"chunk_ids": ["a"], "params": {"link_tokens": 5}}))
    opts = answer_options(req, SETTINGS, "kvlink")
    assert opts.method == "kvlink" and dict(opts.method_params) == {"link_tokens": 5}
    with pytest.raises(APIError) as caught:
        answer_options(req, SETTINGS, "cacheblend")
    assert caught.value.status == 400 and "link_tokens" in str(caught.value)


def test_request_limits_are_413(http):
    too_many = [Chunk(f"m{i}", f"chunk number {i}") for i in range(5)]
    r = http.post("/v1/chunks", json={"chunks": chunk_json(too_many)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_chunks"
    r = http.post("/v1/chat/completions", json=chat(kvrag={"chunk_ids": [f"m{i}" for i in range(5)]}))
    assert r.status_code == 413
    r = http.post("/v1/chunks", json={"chunks": chunk_json([Chunk("long", "y" * 7000)])})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens"
    big = {"chunks": chunk_json([Chunk("big", "z" * (80 * 1024))])}
    r = http.post("/v1/chunks", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    def chunked():  # no Content-Length: refused once the body runs past the limit
        yield b'{"chunks": [{"id": "c", "text": "'
        for _ in range(80):
            yield b"w" * 1024
        yield b'"}]}'

    r = http.post("/v1/chunks", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413


# -- health and metrics --------------------------------------------------------------------------------
def test_health_and_metrics(http, live):
    assert http.post("/v1/chunks", json={"chunks": chunk_json(THREE_CHUNKS)}).status_code == 200  # "a" exists whatever ran before
    h = http.get("/health").json()
    assert h["status"] == "ok" and h["store"] == "memory://" and h["uptime_s"] >= 0
    assert h["queue"] == {"running": 0, "waiting": 0, "max_concurrency": 8, "max_queue": 16}
    assert health(live.url)["status"] == "ok"
    answered = ("kvrag_ttft_seconds_count", ())  # the histogram's count: answers observed, not a time
    before = metric_samples(http.get("/metrics").text).get(answered, 0)
    http.post("/v1/chat/completions", json=chat(kvrag={"chunk_ids": ["a"]}))
    http.post("/v1/chat/completions", json=chat(kvrag={"chunk_ids": ["a"], "method": "magic"}))
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = metric_samples(r.text)
    assert m[("kvrag_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200")))] >= 1
    assert m[("kvrag_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "400")))] >= 1
    assert m[answered] - before == 1  # the one answered request (the 400 one is not observed)
    assert m[("kvrag_cache_hits_total", ())] >= 1
    assert m[("kvrag_bytes_loaded_total", ())] > 0
    assert ("kvrag_recomputed_tokens_total", ()) in m and ("kvrag_cache_misses_total", ()) in m
    assert m[("kvrag_queue_depth", ())] == 0
    # the batched decoder's counts: the answers above decoded through it (issue #35)
    assert m[("kvrag_decode_steps", ())] >= 1 and m[("kvrag_decode_rows", ())] >= m[("kvrag_decode_steps", ())]
    assert m[("kvrag_decode_batch_largest", ())] >= 1
    assert ("kvrag_draft_tokens_served_total", ()) in m  # prompt-lookup drafts the model agreed with (issue #39)


def test_two_apps_in_one_process_have_their_own_metrics(rag):
    a, b = create_app(rag, SETTINGS), create_app(rag, SETTINGS)
    assert a.state.kvrag.metrics.registry is not b.state.kvrag.metrics.registry


# -- admission: queue, 503, disconnects ----------------------------------------------------------------
class Held:
    """An engine proxy whose `complete`/`complete_chat` wait for `release` (hold the slot), and whose streams
    yield `pieces` slow pieces: a request that lasts as long as a test needs."""

    def __init__(self, rag: KVRag, pieces: int = 0, delay: float = 0.0) -> None:
        self._rag, self.pieces, self.delay = rag, pieces, delay
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def complete(self, prompt: str, **kwargs: Any):
        return self._held(self._rag.complete, prompt, **kwargs)

    def complete_chat(self, messages: Any, **kwargs: Any):  # what the server calls for plain chat
        return self._held(self._rag.complete_chat, messages, **kwargs)

    def _held(self, call: Any, arg: Any, **kwargs: Any):
        self.entered.set()
        assert self.release.wait(30)
        stream = call(arg, **kwargs)
        if self.pieces:
            def slow():
                for _ in range(self.pieces):
                    time.sleep(self.delay)
                    yield "tok "
            stream._pieces = slow()
        return stream


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.02)


def test_full_queue_answers_503_with_retry_after(rag):
    held = Held(rag)
    settings = ServerSettings(max_concurrency=1, max_queue=1, retry_after_s=3)
    with LiveServer(create_app(held, settings)) as server, httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
        results: dict[str, int] = {}

        def post(name: str) -> None:
            results[name] = http.post("/v1/chat/completions", json=chat("Hi", max_tokens=2)).status_code

        first = threading.Thread(target=post, args=("first",))
        first.start()
        assert held.entered.wait(10)  # running, holding the only slot
        second = threading.Thread(target=post, args=("second",))
        second.start()
        wait_for(lambda: http.get("/health").json()["queue"]["waiting"] == 1)
        r = http.post("/v1/chat/completions", json=chat("Hi", max_tokens=2))
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "queue_full" and "busy" in r.json()["error"]["message"]
        held.release.set()
        first.join(30), second.join(30)
        assert results == {"first": 200, "second": 200}
        m = metric_samples(http.get("/metrics").text)
        assert m[("kvrag_rejected_busy_total", ())] == 1
        assert m[("kvrag_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "503")))] == 1


def test_abandoned_stream_frees_its_slot(rag):
    held = Held(rag, pieces=500, delay=0.02)  # ~10 s of streaming if nobody hangs up
    held.release.set()
    with LiveServer(create_app(held, ServerSettings(max_concurrency=1, max_queue=0))) as server, \
            httpx.Client(base_url=server.url, timeout=60, trust_env=False) as http:
        t0 = time.time()
        with http.stream("POST", "/v1/chat/completions", json=chat("Hi", stream=True, max_tokens=2)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert http.get("/health").json()["queue"]["running"] == 1
        # the client hung up: the slot is free long before the 10 s stream would have ended
        wait_for(lambda: http.get("/health").json()["queue"]["running"] == 0, timeout=5)
        assert time.time() - t0 < 6
        held.pieces = 0
        assert http.post("/v1/chat/completions", json=chat("Hi", max_tokens=2)).status_code == 200


# -- clients ---------------------------------------------------------------------------------------------
def test_langchain_chat_openai_works_unchanged(live):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    llm = langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="dummy", model="kvrag", max_tokens=4,
                                      temperature=0, max_retries=0, timeout=60)
    msg = llm.invoke("Say hello")
    assert isinstance(msg.content, str)
    assert msg.usage_metadata and msg.usage_metadata["output_tokens"] <= 4
    pieces = list(llm.stream("Say hello"))
    assert "".join(p.content for p in pieces).strip() == msg.content.strip()


def test_client_functions_and_unreachable_server(live):
    report = ingest_via_server(live.url, [Chunk("cli-1", "Glaciers carve valleys over thousands of years.")])
    assert report["chunks"] == 1
    text, stats = ask_via_server(live.url, "What do glaciers carve?", ["cli-1"], method="epic", max_new_tokens=3)
    assert isinstance(text, str) and stats.method == "epic" and stats.cache_hits == 1
    assert delete_via_server(live.url, "cli-1")["deleted"] is True
    with pytest.raises(ServerError, match="unknown chunk id"):
        ask_via_server(live.url, "What do glaciers carve?", ["cli-1"])
    with pytest.raises(ServerError, match="cannot reach the kvrag server"):
        ask_via_server(f"http://127.0.0.1:{free_port()}", "anything?", timeout=5)


# -- scale-out: two replicas over one Redis store --------------------------------------------------------
@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_two_replicas_share_a_redis_store():
    pytest.importorskip("redis")
    redis = RedisServer()
    redis.start()
    try:
        one, two = tiny_rag(redis.url), tiny_rag(redis.url)  # two engines, two registries, one store
        assert one.lm.fingerprint == two.lm.fingerprint and one.lm.lock is not two.lm.lock
        with LiveServer(create_app(one, SETTINGS)) as s1, LiveServer(create_app(two, SETTINGS)) as s2:
            report = ingest_via_server(s1.url, THREE_CHUNKS)
            assert report["computed"] == 3
            assert "b" not in two.repo.chunks  # replica two never saw the text
            text, stats = ask_via_server(s2.url, THREE_Q, ["a", "b"], max_new_tokens=3)
            assert stats.cache_hits == 2 and stats.cache_misses == 0 and stats.chunk_prefill_tokens == 0
            assert health(s2.url)["store"] == "redis://"  # the kind only: no host (issue #37 item 13)
            # forgetting through replica two (which knows the chunk only through the store) removes its KV
            assert delete_via_server(s2.url, "b")["kv_entries_removed"] >= 1
            with pytest.raises(ServerError, match="unknown chunk id"):
                ask_via_server(s2.url, THREE_Q, ["b"], max_new_tokens=3)
    finally:
        redis.stop()


# -- CLI --------------------------------------------------------------------------------------------------
def test_serve_parser_defaults_and_help(capsys):
    from kvrag.cli.serve import add_serve_parser, settings_from_args

    parser = argparse.ArgumentParser(prog="kvrag")
    add_serve_parser(parser.add_subparsers(dest="command"))
    settings = settings_from_args(parser.parse_args(["serve"]))
    assert settings.host == "127.0.0.1" and settings.port == 8600 and settings.max_concurrency == 8 and settings.max_queue == 16
    assert settings_from_args(parser.parse_args(["serve", "--host", "0.0.0.0", "--allow-no-auth", "--max-queue", "4"])).max_queue == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    assert "(default: 8600)" in out and "examples:" in out and "kvrag serve --store redis://" in out
    assert settings.retrieval and settings.top_k == 5
    off = settings_from_args(parser.parse_args(["serve", "--no-retrieval", "--top-k", "3"]))
    assert not off.retrieval and off.top_k == 3


def test_non_loopback_bind_warns_about_authentication(rag, monkeypatch, capsys):
    from kvrag.server import runner

    calls = []
    monkeypatch.setattr(runner, "run_beside_home", lambda server: calls.append(server.config))
    runner.serve(ServerSettings(host="0.0.0.0", port=9, allow_no_auth=True), rag=rag)  # refused without it
    assert calls and calls[0].host == "0.0.0.0"
    assert "NO API key" in capsys.readouterr().err
    runner.serve(ServerSettings(), rag=rag)
    assert "NO API key" not in capsys.readouterr().err and calls[1].host == "127.0.0.1"
    runner.serve(ServerSettings(host="0.0.0.0", port=9, api_keys=("sk-secret-key",)), rag=rag)  # keyed: no warning, no key shown
    err = capsys.readouterr().err
    assert "NO API key" not in err and "sk-secret-key" not in err and "1 read+write" in err


def test_kvrag_serve_runs_the_model_on_its_own_thread_and_stops_cleanly(rag):
    """`kvrag serve` runs HTTP in a thread and every model call on the thread that loaded the model."""
    import threading

    from kvrag.model.home_thread import HOME
    from kvrag.server import runner

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(rag, SETTINGS), host="127.0.0.1", port=port, log_level="warning"))
    seen = {}

    def client() -> None:
        while not server.started:
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, trust_env=False) as h:
            seen["status"] = h.post("/v1/chat/completions", json=chat("Hi", max_tokens=3)).status_code
            seen["serving"] = HOME.serving
        server.should_exit = True

    t = threading.Thread(target=client)
    t.start()
    runner.run_beside_home(server)  # this thread is the model's home until the server stops
    t.join(30)
    assert seen == {"status": 200, "serving": True} and not HOME.serving


def test_stream_via_server_mirrors_the_local_engine(live, rag):
    from kvrag.options import AnswerOptions
    from kvrag.client import stream_via_server

    opts = AnswerOptions.from_kwargs(method="epic", recompute_ratio=0.3, max_new_tokens=5)
    remote = stream_via_server(live.url, THREE_Q, chunks=THREE_CHUNKS[:2], options=opts)
    stats = remote.stats  # the same object, filled at the end (integrations keep a reference early)
    answer = remote.answer()
    local = rag.stream(THREE_Q, chunks=THREE_CHUNKS[:2], options=opts).answer()
    assert answer.text == local.text and stats is answer.stats
    assert stats.method == "epic" and stats.recomputed_tokens == local.stats.recomputed_tokens
    plain = stream_via_server(live.url, "Hello", options=opts).answer()
    assert plain.stats.path == "plain" and plain.stats.generated_tokens >= 1


def test_auto_ratio_and_stop_rule_travel_through_the_client(live):
    from kvrag.options import AnswerOptions
    from kvrag.client import stream_via_server

    opts = AnswerOptions.from_kwargs(method="a3", recompute_ratio="auto", stop_at="none", max_new_tokens=3)
    out = stream_via_server(live.url, THREE_Q, chunks=THREE_CHUNKS, options=opts).answer()
    assert out.stats.method == "a3" and 0 < out.stats.recompute_ratio <= 0.31
