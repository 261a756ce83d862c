"""Issue #37, the server and chunk-id items: what one client sends must not change what the others
get, leave state behind when refused, or cost work after the client has gone; answers say what
happened (a store that kept nothing, an unknown model, unsupported fields); /health names no paths
or hosts; chunk ids round-trip. Tiny random models: nothing here depends on the answers' quality."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag import Chunk, KVRag, from_model  # noqa: E402
from kvrag.cache_backends import MemoryStore  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from kvrag.client import ServerError, delete_via_server, ingest_via_server  # noqa: E402
from test_backends import REDIS, RedisServer  # noqa: E402
from test_server import SETTINGS, LiveServer, chunk_json, metric_samples, tiny_rag, wait_for  # noqa: E402
from tiny import THREE_Q, tiny_model, tiny_tokenizer  # noqa: E402

ORIGINAL = "The Brannoch Line opened to passengers on 4 March 1921 after years of delay."
HOSTILE = "The Brannoch Line opened on 9 September 1999."


def ask(question: str = THREE_Q, **extra: Any) -> dict[str, Any]:
    return {"model": "kvrag", "messages": [{"role": "user", "content": question}], "max_tokens": 3, **extra}


def index_key(rag: KVRag, chunk_id: str) -> str | None:
    """What the store's node-id index maps this id to (None: not linked)."""
    return rag.repo.guarded.resolve([f"{rag.repo.namespace}/{chunk_id}"])[0]


def client(server: LiveServer, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=timeout, trust_env=False)


@pytest.fixture(scope="module")
def rag() -> KVRag:
    return tiny_rag()


@pytest.fixture(scope="module")
def live(rag):
    with LiveServer(create_app(rag, SETTINGS)) as server:
        yield server


@pytest.fixture(scope="module")
def http(live):
    with client(live) as c:
        yield c


# -- item 4: inline chunks are the request's own; deleting an id keeps what another id shares -----------
def test_an_inline_chunk_never_rebinds_a_registered_id(http, rag):
    assert http.post("/v1/chunks", json={"chunks": [{"id": "rebind-a", "text": ORIGINAL}]}).status_code == 200
    key = index_key(rag, "rebind-a")
    before = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["rebind-a"]})).json()["kvrag_stats"]
    hostile = http.post("/v1/chat/completions", json=ask(kvrag={"chunks": [{"id": "rebind-a", "text": HOSTILE}]}))
    assert hostile.status_code == 200, hostile.text  # answered from its own text
    assert rag.repo.chunks["rebind-a"].text == ORIGINAL and index_key(rag, "rebind-a") == key
    after = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["rebind-a"]})).json()["kvrag_stats"]
    assert after["prompt_tokens"] == before["prompt_tokens"] and after["cache_hits"] == 1


def test_inline_chunks_leave_nothing_behind(http, rag):
    memo = len(rag.layout._chunk_ids_memo)
    registered = len(rag.repo.chunks)
    for i in range(5):
        text = f"Inline fact number {i}: the lighthouse keeper's cat is named Biscuit {i}."
        r = http.post("/v1/chat/completions", json=ask(kvrag={"chunks": [{"id": f"only-inline-{i}", "text": text, "title": "T"}]}))
        assert r.status_code == 200, r.text
    again = http.post("/v1/chat/completions", json=ask(kvrag={"chunks": [{"id": "x", "text": text, "title": "T"}]})).json()
    assert again["kvrag_stats"]["cache_hits"] == 1  # the KV is still cached, by content
    assert len(rag.repo.chunks) == registered and "only-inline-0" not in rag.repo.chunks
    assert index_key(rag, "only-inline-0") is None
    assert len(rag.layout._chunk_ids_memo) == memo  # nothing kept per inline chunk
    by_id = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["only-inline-0"]}))
    assert by_id.status_code == 400 and by_id.json()["error"]["code"] == "chunk_not_found"
    plain = http.post("/v1/chat/completions", json=ask(f"{text}\n\nWhat is the cat named?"))
    assert plain.json()["kvrag_stats"]["path"] == "plain"  # not prompt-matched against a registered chunk


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_an_inline_chunk_never_rebinds_an_id_in_a_shared_redis_index():
    pytest.importorskip("redis")
    redis = RedisServer()
    redis.start()
    try:
        one, two, three = tiny_rag(redis.url), tiny_rag(redis.url), tiny_rag(redis.url)
        with LiveServer(create_app(one, SETTINGS)) as s1, LiveServer(create_app(two, SETTINGS)) as s2, client(s2) as h2:
            ingest_via_server(s1.url, [Chunk("shared-a", ORIGINAL)])
            r = h2.post("/v1/chat/completions", json=ask(kvrag={"chunks": [{"id": "shared-a", "text": HOSTILE}]}))
            assert r.status_code == 200, r.text
        resolved = three.repo.lookup(["shared-a"], None)  # a replica that never saw either text
        assert "4 March 1921" in resolved.chunks[0].text and "1999" not in resolved.chunks[0].text
    finally:
        redis.stop()


def test_deleting_an_id_keeps_the_entry_another_id_shares(http):
    same = "Owls hunt at night in the quiet forest near the old mill."
    assert http.post("/v1/chunks", json={"chunks": [{"id": "twin-x", "text": same}, {"id": "twin-y", "text": same}]}).status_code == 200
    gone = http.delete("/v1/chunks/twin-x")
    assert gone.status_code == 200 and gone.json()["kv_entries_removed"] == 0
    y = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["twin-y"]}))
    assert y.status_code == 200 and y.json()["kvrag_stats"]["cache_hits"] == 1 and y.json()["kvrag_stats"]["cache_misses"] == 0
    x = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["twin-x"]}))
    assert x.status_code == 400 and x.json()["error"]["code"] == "chunk_not_found"
    last = http.delete("/v1/chunks/twin-y").json()
    assert last["kv_entries_removed"] == 1 and last["unlinked"] is True


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_deleting_an_id_keeps_the_entry_another_id_shares_in_the_store_index(kind, tmp_path):
    """A restarted server (or another replica) knows ids only through the store's index: deleting x
    there must not take the KV that y, known only to the index, shares."""
    redis = None
    if kind == "redis":
        if REDIS is None:
            pytest.skip("redis-server is not installed")
        pytest.importorskip("redis")
        redis = RedisServer()
        redis.start()
    url = redis.url if redis else f"disk://{tmp_path}"
    try:
        same = "Glaciers carve deep valleys over many thousands of years."
        first = tiny_rag(url)
        first.precompute([Chunk("twin-x", same), Chunk("twin-y", same)], progress=False)
        restarted = tiny_rag(url)  # an empty registry: the ids are known to the store's index only
        with LiveServer(create_app(restarted, SETTINGS)) as server, client(server) as h:
            out = h.delete("/v1/chunks/twin-x").json()
            assert out["kv_entries_removed"] == 0 and out["kv_entries_kept"] == 1 and out["unlinked"] is True
            y = h.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["twin-y"]}))
            assert y.status_code == 200, y.text
            assert y.json()["kvrag_stats"]["cache_hits"] == 1
            assert h.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["twin-x"]})).status_code == 400
            assert h.delete("/v1/chunks/twin-y").json()["kv_entries_removed"] == 1
    finally:
        if redis:
            redis.stop()


# -- item 5: a request whose client has gone does no work ---------------------------------------------------
class Blocking:
    """An engine proxy whose first `complete_chat` holds its slot until `release`; counts every call."""

    def __init__(self, rag: KVRag) -> None:
        self._rag = rag
        self.calls = 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def complete_chat(self, messages: Any, **kwargs: Any):  # what the server calls for plain chat
        self.calls += 1
        self.entered.set()
        assert self.release.wait(60)
        return self._rag.complete_chat(messages, **kwargs)


def test_queued_requests_whose_clients_left_never_start(rag):
    engine = Blocking(rag)
    with LiveServer(create_app(engine, ServerSettings(max_concurrency=1, max_queue=8, max_new_tokens=2))) as server, \
            client(server) as h:
        done: dict[str, int] = {}
        first = threading.Thread(target=lambda: done.update(first=h.post("/v1/chat/completions", json=ask("Hi")).status_code))
        first.start()
        assert engine.entered.wait(20)

        def impatient() -> None:
            with client(server, timeout=1.0) as c:
                with pytest.raises(httpx.TimeoutException):
                    c.post("/v1/chat/completions", json=ask("Hello?"))

        quitters = [threading.Thread(target=impatient) for _ in range(4)]
        for t in quitters:
            t.start()
        wait_for(lambda: h.get("/health").json()["queue"]["waiting"] == 4)
        for t in quitters:
            t.join(20)
        # gone clients leave the queue at once, while the first request still holds the engine
        wait_for(lambda: h.get("/health").json()["queue"]["waiting"] == 0, timeout=5)
        assert h.get("/health").json()["queue"]["running"] == 1
        engine.release.set()
        first.join(30)
        assert done == {"first": 200}
        time.sleep(0.5)
        assert engine.calls == 1  # no prefill for the four that left
        m = metric_samples(h.get("/metrics").text)
        assert m[("kvrag_abandoned_requests_total", (("stage", "queued"),))] == 4


class Slowed:
    """An engine proxy whose answers decode for real, `delay` seconds a piece: a client can hang up mid-answer."""

    def __init__(self, rag: KVRag, delay: float) -> None:
        self._rag, self.delay = rag, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def complete_chat(self, messages: Any, **kwargs: Any):  # what the server calls for plain chat
        stream = self._rag.complete_chat(messages, **kwargs)
        real = stream._pieces

        def slow():
            for piece in real:
                time.sleep(self.delay)
                yield piece
        stream._pieces = slow()
        return stream


@pytest.mark.parametrize("streamed", [True, False])
def test_tokens_of_abandoned_answers_are_counted(rag, streamed):
    """Item 13: an answer whose client hung up counted 0 generated tokens (its stats were filled only
    when decoding ran to the end)."""
    engine = Slowed(rag, delay=0.05)
    body = ask("Tell me a long story.", max_tokens=400, stream=streamed, kvrag={"stop_at": "none"})
    with LiveServer(create_app(engine, ServerSettings(max_concurrency=1, max_queue=0, max_new_tokens=400))) as server, \
            client(server) as h:
        if streamed:
            with h.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
                assert len(got) >= 3
        else:
            with client(server, timeout=1.0) as impatient, pytest.raises(httpx.TimeoutException):
                impatient.post("/v1/chat/completions", json=body)
        wait_for(lambda: h.get("/health").json()["queue"]["running"] == 0, timeout=10)
        m = metric_samples(h.get("/metrics").text)
        assert m[("kvrag_abandoned_requests_total", (("stage", "decoding"),))] == 1
        assert 2 <= m[("kvrag_generated_tokens_total", ())] < 100  # what was decoded before the hang-up, not 0 nor 400


# -- item 6: size limits count every text field and are checked before anything is kept -----------------
def _nothing_kept(rag: KVRag, chunk_id: str) -> bool:
    return chunk_id not in rag.repo.chunks and index_key(rag, chunk_id) is None


def test_a_title_counts_towards_the_token_limit_and_a_refused_ingest_keeps_nothing(http, rag):
    memo = len(rag.layout._chunk_ids_memo)
    r = http.post("/v1/chunks", json={"chunks": [{"id": "big-title", "text": "short", "title": "t" * 7000}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert _nothing_kept(rag, "big-title")
    r = http.post("/v1/chat/completions", json=ask(kvrag={"chunks": [{"id": "big-inline-title", "text": "short", "title": "t" * 7000}]}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_tokens", r.text
    assert _nothing_kept(rag, "big-inline-title")
    assert len(rag.layout._chunk_ids_memo) == memo


@pytest.mark.parametrize(
    "chunk, code",
    [
        ({"id": "too-long", "text": "x" * 4500}, "context_length_exceeded"),  # within the token limit, not the context
        ({"id": "blank", "text": "   "}, "invalid_request"),
    ],
)
def test_an_ingest_refused_after_the_limits_keeps_nothing(http, rag, chunk, code):
    good = {"id": f"{chunk['id']}-neighbour", "text": "A perfectly good chunk about tides."}
    r = http.post("/v1/chunks", json={"chunks": [good, chunk]})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert _nothing_kept(rag, chunk["id"]) and _nothing_kept(rag, good["id"])  # the whole request is refused


# -- item 10: an ingest whose KV the store did not keep is not a 200 -----------------------------------------
class KeepsNothing(MemoryStore):
    """A store that accepts writes and keeps none (a frozen or full Redis, as the engine sees it)."""

    def put(self, key: str, entry: Any) -> None:
        return None


def test_an_ingest_the_store_did_not_keep_is_a_503_naming_the_chunks():
    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=KeepsNothing())
    with LiveServer(create_app(rag, SETTINGS)) as server, client(server) as h:
        r = h.post("/v1/chunks", json={"chunks": [{"id": "lost-1", "text": "Tides follow the moon."}]})
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["error"]["code"] == "kv_not_stored" and "lost-1" in body["error"]["message"]
        assert body["not_stored"] == ["lost-1"] and body["computed"] == 1 and r.headers["retry-after"]
        with pytest.raises(ServerError, match="did not keep"):
            ingest_via_server(server.url, [Chunk("lost-2", "Rivers run to the sea.")])


# -- item 12: OpenAI's conventions ---------------------------------------------------------------------------
def test_an_unknown_model_is_a_404_unless_the_server_accepts_any(http, live, rag):
    r = http.post("/v1/chat/completions", json={**ask(), "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
    served = http.get("/v1/models").json()["data"]
    assert {m["id"] for m in served} >= {"kvrag"}
    for m in served:
        assert http.post("/v1/chat/completions", json={**ask(), "model": m["id"]}).status_code == 200
    no_model = ask()
    del no_model["model"]
    assert http.post("/v1/chat/completions", json=no_model).status_code == 200
    with LiveServer(create_app(rag, ServerSettings(max_new_tokens=2, accept_any_model=True))) as server, client(server) as h:
        assert h.post("/v1/chat/completions", json={**ask(), "model": "gpt-4o"}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_an_out_of_range_seed_is_a_400_before_any_answer(http, seed, stream):
    r = http.post("/v1/chat/completions", json=ask(seed=seed, stream=stream))
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert "seed" in r.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json=ask(seed=2**63 - 1)).status_code == 200


RAW = ("not supported between", "invalid literal", "Overflow", "object has no attribute", "unexpected keyword")


@pytest.mark.parametrize(
    "method, params, param",
    [
        ("a3", {"layer": 10**9}, "layer"),
        ("a3", {"layer": "x"}, "layer"),
        ("a3", {"layer": True}, "layer"),
        ("fusionrag", {"layer": -4}, "layer"),
        ("cacheblend", {"layer": 3}, "layer"),
        ("cacheblend", {"steps": "x"}, "steps"),
        ("cacheblend", {"steps": 10**9}, "steps"),
        ("cacheblend", {"start": "x"}, "start"),
        ("samkv", {"block_size": -1}, "block_size"),
        ("samkv", {"block_size": "x"}, "block_size"),
        ("samkv", {"stable_layers": [99]}, "stable_layers[0]"),
        ("samkv", {"initial_blocks": -1}, "initial_blocks"),
        ("samkv", {"sparsify": "no"}, "sparsify"),
        ("kvlink", {"link_tokens": 10**9}, "link_tokens"),
        ("kvlink", {"link_tokens": "x"}, "link_tokens"),
        ("kvlink+a3", {"layer": 7}, "layer"),
    ],
)
def test_method_parameters_are_checked_before_any_work(http, method, params, param):
    """One chunk: the methods would never read these (no tokens to select), so only an up-front check sees them."""
    assert http.post("/v1/chunks", json={"chunks": [{"id": "param-1", "text": ORIGINAL}]}).status_code == 200
    waits = ("kvrag_queue_wait_seconds_count", ())
    before = metric_samples(http.get("/metrics").text)[waits]
    r = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["param-1"], "method": method, "params": params}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_method" and err["param"] == f"kvrag.params.{param}" and param in err["message"]
    assert not any(raw in err["message"] for raw in RAW), err["message"]
    assert metric_samples(http.get("/metrics").text)[waits] == before  # refused before it queued


def test_null_method_parameters_mean_the_default(http):
    assert http.post("/v1/chunks", json={"chunks": [{"id": "param-1", "text": ORIGINAL}]}).status_code == 200
    r = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["param-1"], "method": "a3", "params": {"layer": None}}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("response_format", {"type": "json_object"}),
        ("logprobs", True),
        ("top_logprobs", 3),
        ("n", 2),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1),
        ("logit_bias", {"50256": -100}),
    ],
)
def test_unsupported_openai_fields_are_a_400_not_ignored(http, field, value):
    r = http.post("/v1/chat/completions", json=ask(**{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported" and err["param"] == field and "not" in err["message"]


def test_openai_fields_that_ask_for_nothing_are_accepted(http):
    r = http.post("/v1/chat/completions", json=ask(n=1, logprobs=False, top_logprobs=0, tools=[], tool_choice="none",
                                                    response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0,
                                                    logit_bias={}, user="u1", stream_options={"include_usage": True}))
    assert r.status_code == 200, r.text


# -- item 13: /health names no path or host; chunk ids round-trip over HTTP ------------------------------------
def test_health_names_the_store_kind_not_its_path(tmp_path):
    folder = tmp_path / "secret-store-folder"
    for url, kind in [(f"disk://{folder}", "disk://"), (f"tiered://?tiers=memory://|disk://{folder}", "tiered://?tiers=memory://|disk://")]:
        rag = tiny_rag(url)
        with LiveServer(create_app(rag, SETTINGS)) as server, client(server) as h:
            r = h.get("/health")
            assert r.json()["store"] == kind and "secret-store-folder" not in r.text


@pytest.mark.parametrize("bad", ["line\nbreak", "tab\there", "nul\x00", "del\x7f", "c1\x85", "cr\r", "\ud800"])
def test_chunk_ids_with_control_characters_are_refused_at_ingest(http, rag, bad):
    def post(path: str, body: dict) -> httpx.Response:  # escaped JSON: a lone surrogate has no UTF-8
        return http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

    r = post("/v1/chunks", {"chunks": [{"id": bad, "text": "Some text."}]})
    assert r.status_code == 400, r.text
    assert "chunk ids must not contain" in r.json()["error"]["message"]  # the lone surrogate too, in these words
    assert bad not in rag.repo.chunks
    r = post("/v1/chat/completions", ask(kvrag={"chunks": [{"id": bad, "text": "Some text."}]}))
    assert r.status_code == 400


@pytest.mark.parametrize("odd", ["with space", "slash/inside/it", "pct%20and+plus", "q?x=1#frag", "ünïcødé 😀", ".", "..", "a" * 1024])
def test_printable_chunk_ids_round_trip_over_http(live, http, odd):
    assert http.post("/v1/chunks", json={"chunks": [{"id": odd, "text": "Round trips are good."}]}).status_code == 200
    out = delete_via_server(live.url, odd)
    assert out["id"] == odd and out["deleted"] is True
    with pytest.raises(ServerError, match="unknown chunk id"):
        delete_via_server(live.url, odd)


def test_an_id_registered_with_a_newline_elsewhere_can_still_be_deleted(http, rag):
    rag.precompute([Chunk("library\nid", "Registered through the library.")], progress=False)
    r = http.delete("/v1/chunks/library%0Aid")
    assert r.status_code == 200 and r.json()["id"] == "library\nid", r.text
    assert "library\nid" not in rag.repo.chunks


def test_an_unknown_chunk_id_is_explained_in_http_terms(http):
    r = http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": ["never-ingested"]}))
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "chunk_not_found"
    assert "never-ingested" in message and "POST /v1/chunks" in message and "precompute()" not in message


def test_malformed_json_is_named_as_such(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "kvrag", "messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "body is not valid JSON" in r.json()["error"]["message"]
