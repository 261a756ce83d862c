"""`kvrag serve` as a RAG endpoint for any OpenAI client: a chat request that brings no `kvrag` context
is answered from the top-k chunks of the server's own index, and the response names them.

Real HTTP (uvicorn on a loopback port), a real chroma index, the real OpenAI clients (LangChain's
`ChatOpenAI`, LlamaIndex's `OpenAILike`) unchanged; a tiny random model for the mechanics, the bundled
SmolLM2 for the answer itself.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag import Chunk, KVRag  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, chunk_json, sse_events, tiny_rag  # noqa: E402
from tiny import THREE_CHUNKS  # noqa: E402

FACTS = [Chunk("owl", "Owls hunt at night in the quiet forest.", title="Owls"),
         Chunk("bee", "Bees make honey from the nectar of flowers.", title="Bees"),
         Chunk("ant", "Ants build nests under the ground.", title="Ants")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny engine behind a server whose retrieval index starts empty; chunks go in through POST /v1/chunks."""
    index = ChunkIndex(tmp_path_factory.mktemp("retrieval") / "chroma")
    with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live, \
            httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        yield live, http, index


def test_an_empty_index_answers_as_plain_chat_and_says_it_found_nothing(served):
    _, http, index = served
    if len(index):
        pytest.skip("the module's index was filled by an earlier test")
    body = http.post("/v1/chat/completions", json=chat("When do owls hunt?")).json()
    assert body["kvrag_stats"]["path"] == "plain" and body["kvrag_sources"] == []


def test_ingested_chunks_are_retrieved_for_a_request_without_context(served):
    _, http, index = served
    r = http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    assert r.status_code == 200 and r.json()["indexed"] == 3 and len(index) == 3
    assert http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)}).json()["indexed"] == 0  # unchanged: not embedded again

    r = http.post("/v1/chat/completions", json=chat("When do owls hunt?"))
    assert r.status_code == 200, r.text
    body = r.json()
    sources = body["kvrag_sources"]
    assert [s["id"] for s in sources][0] == "owl" and len(sources) == 3  # top-5 of 3: all, the owl first
    assert sources[0] == {"id": "owl", "title": "Owls", "source": ""}
    assert json.loads(r.headers["x-kvrag-sources"]) == [s["id"] for s in sources]
    stats = body["kvrag_stats"]
    assert stats["path"] != "plain" and stats["cache_hits"] == 3 and stats["cache_misses"] == 0  # the ingested KV answered

    one = http.post("/v1/chat/completions", json=chat("When do owls hunt?", kvrag={"top_k": 1})).json()
    assert [s["id"] for s in one["kvrag_sources"]] == ["owl"] and one["kvrag_stats"]["cache_hits"] == 1

    off = http.post("/v1/chat/completions", json=chat("When do owls hunt?", kvrag={"retrieve": False}))
    assert off.json()["kvrag_stats"]["path"] == "plain" and "kvrag_sources" not in off.json()
    assert "x-kvrag-sources" not in off.headers

    own = http.post("/v1/chat/completions", json=chat("What did the cat do?", kvrag={"chunks": chunk_json(THREE_CHUNKS[:1])}))
    assert "kvrag_sources" not in own.json()  # a request's own context: nothing retrieved


def test_streaming_carries_the_sources_in_its_first_and_last_chunks(served):
    _, http, _ = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    with http.stream("POST", "/v1/chat/completions", json=chat("What do bees make?", stream=True)) as r:
        events = sse_events(r)
        header = json.loads(r.headers["x-kvrag-sources"])
    assert events[-1] == "[DONE]"
    first, last = events[0], events[-2]
    assert [s["id"] for s in first["kvrag_sources"]] == header == [s["id"] for s in last["kvrag_sources"]]
    assert header[0] == "bee"
    plain = http.post("/v1/chat/completions", json=chat("What do bees make?", max_tokens=6)).json()
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text.strip() == plain["choices"][0]["message"]["content"]


def test_delete_removes_a_chunk_from_retrieval_and_health_counts_the_index(served):
    _, http, index = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    chunks = http.get("/health").json()["chunks"]
    assert chunks["retrievable"] == len(index) >= 3 and chunks["ids_in_store"] >= 3 and chunks["registered_here"] >= 3
    out = http.delete("/v1/chunks/ant").json()
    assert out["deleted"] and out["unindexed"]
    sources = http.post("/v1/chat/completions", json=chat("Where do ants build nests?")).json()["kvrag_sources"]
    assert "ant" not in [s["id"] for s in sources]
    assert http.get("/health").json()["chunks"]["retrievable"] == chunks["retrievable"] - 1
    assert http.delete("/v1/chunks/ant").status_code == 404


def test_a_server_without_an_index_answers_plain_chat_and_refuses_retrieval_it_cannot_do():
    with LiveServer(create_app(tiny_rag(), SETTINGS)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        plain = http.post("/v1/chat/completions", json=chat("Hello")).json()
        assert plain["kvrag_stats"]["path"] == "plain" and "kvrag_sources" not in plain
        r = http.post("/v1/chat/completions", json=chat("Hello", kvrag={"retrieve": True}))
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_retrieval_index"
        assert http.get("/health").json()["chunks"]["retrievable"] is None


def test_retrieval_off_in_the_settings_is_plain_chat_even_with_an_index(tmp_path):
    index = ChunkIndex(tmp_path / "chroma")
    index.add(FACTS)
    settings = ServerSettings(**{**SETTINGS.__dict__, "retrieval": False})
    with LiveServer(create_app(tiny_rag(), settings, index)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        assert http.post("/v1/chat/completions", json=chat("When do owls hunt?")).json()["kvrag_stats"]["path"] == "plain"
        on = http.post("/v1/chat/completions", json=chat("When do owls hunt?", kvrag={"retrieve": True})).json()
        assert on["kvrag_sources"][0]["id"] == "owl"


def test_openai_clients_get_the_sources_unchanged(served):
    langchain_openai = pytest.importorskip("langchain_openai")
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    live, http, _ = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    llm = langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="unused", model="kvrag", max_tokens=4, temperature=0,
                                      max_retries=0, include_response_headers=True)
    msg = llm.invoke("When do owls hunt?")
    assert json.loads(msg.response_metadata["headers"]["x-kvrag-sources"])[0] == "owl"

    li = openai_like.OpenAILike(model="kvrag", api_base=f"{live.url}/v1", api_key="unused", is_chat_model=True, max_tokens=4,
                                context_window=2048, max_retries=0)
    resp = li.chat([ChatMessage(role="user", content="What do bees make?")])
    assert resp.raw.kvrag_sources[0]["id"] == "bee" and isinstance(resp.message.content, str)


@pytest.mark.smollm
def test_chat_openai_answers_from_the_ingested_sample_with_its_sources(smollm, tmp_path, shipped_defaults):
    """The issue's check: an OpenAI client pointed at the server, sending only the question."""
    langchain_openai = pytest.importorskip("langchain_openai")
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.llms import ChatMessage

    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.samples import sample_corpus_dir

    rag = KVRag(smollm, store="memory://", check=False)
    index = ChunkIndex(tmp_path / "chroma")
    sample = load_documents([sample_corpus_dir()])
    rag.precompute(sample, progress=False)
    index.add(sample)  # what `kvrag ingest` does with the sample
    with LiveServer(create_app(rag, ServerSettings(), index)) as live:
        llm = langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="unused", model="kvrag", temperature=0,
                                          max_retries=0, include_response_headers=True)
        msg = llm.invoke("When did the Brannoch Line open?")
        assert "1893" in msg.content, msg.content
        assert len(json.loads(msg.response_metadata["headers"]["x-kvrag-sources"])) == 5  # the top-5 chunks' ids

        li = openai_like.OpenAILike(model="kvrag", api_base=f"{live.url}/v1", api_key="unused", is_chat_model=True,
                                    context_window=8192, max_retries=0)
        resp = li.chat([ChatMessage(role="user", content="When did the Brannoch Line open?")])
        assert "1893" in resp.message.content, resp.message.content
        named = [f"{s['title']} {s['source']}".lower() for s in resp.raw.kvrag_sources]
        assert any("brannoch" in n for n in named), named


def test_kvrag_clients_without_chunks_still_ask_for_plain_chat(served):
    """ChatKVRag(server=...) and KVRagLLM(server=...) send a ready-made prompt when they have no documents:
    the server must read it as it is, not retrieve for it."""
    from kvrag.client import ask_via_server, stream_via_server

    live, http, _ = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    _, stats = ask_via_server(live.url, "When do owls hunt?", max_new_tokens=3)
    assert stats.path == "plain"
    stream = stream_via_server(live.url, "When do owls hunt?")
    "".join(stream)
    assert stream.stats.path == "plain"


def test_kvrag_ask_through_a_server_uses_its_retrieval_when_this_machine_has_no_index(served, tmp_path, monkeypatch, capsys):
    """`kvrag ask --server URL` on a machine that ingested nothing (`kvrag ingest --server` went to the
    server): the server retrieves from its own index, and --json/--sources show what it read."""
    from kvrag.cli.app import main

    live, http, _ = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "empty-home"))
    assert main(["ask", "--server", live.url, "--max-new-tokens", "3", "--json", "What do bees make?"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["chunk_ids"][0] == "bee" and out["sources"][0]["title"] == "Bees"
    assert main(["ask", "--server", live.url, "--max-new-tokens", "3", "--sources", "What do bees make?"]) == 0
    assert "'Bees'" in capsys.readouterr().out.split("sources:")[1]


def _rail_docs(tmp_path) -> "Path":
    docs = tmp_path / "docs"
    (docs / "rail").mkdir(parents=True)
    (docs / "rail" / "brannoch.md").write_text("The Brannoch Line opened in 1893 between Brannoch and the coast.\n")
    return docs


def test_kvrag_ingest_through_a_server_that_retrieves_is_indexed_once_by_the_server(served, tmp_path, monkeypatch, capsys):
    """The server's POST /v1/chunks indexes what it stores: the CLI writes no index of its own (nor the shared
    one a second time), reports the server's `indexed`; the file is recorded as a local ingest records it
    (the path given, which `kvrag remove` names) and shown by its name relative to the folder."""
    from kvrag.cli.app import main
    from kvrag.ingest.retrieval import public_source

    live, _, index = served
    docs = _rail_docs(tmp_path)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert main(["ingest", str(docs), "--server", live.url]) == 0
    assert "; 1 new or changed in the server's index" in capsys.readouterr().err
    [chunk] = index.by_source(str(docs / "rail" / "brannoch.md"))  # as a local ingest records it: what `kvrag remove` finds
    assert public_source(chunk) == "rail/brannoch.md" and chunk.title == "brannoch"
    assert not (tmp_path / "home" / "chroma").exists()  # this machine's index was never opened, let alone written
    assert main(["ingest", str(docs), "--server", live.url]) == 0
    assert "; 0 new or changed in the server's index" in capsys.readouterr().err  # unchanged: not embedded again


def test_kvrag_ingest_through_a_server_that_does_not_retrieve_indexes_on_this_machine(tmp_path, monkeypatch, capsys):
    from kvrag.cli.app import main
    from kvrag.ingest.retrieval import public_source

    docs = _rail_docs(tmp_path)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    settings = ServerSettings(**{**SETTINGS.__dict__, "retrieval": False})
    with LiveServer(create_app(tiny_rag(), settings)) as live:
        assert main(["ingest", str(docs), "--server", live.url]) == 0
    assert "; 1 indexed on this machine (the server does not retrieve)" in capsys.readouterr().err
    [chunk] = ChunkIndex(tmp_path / "home" / "chroma").query("When did the Brannoch Line open?", k=5)
    assert public_source(chunk) == "rail/brannoch.md"


def test_kvrag_ask_through_a_server_with_nothing_indexed_anywhere_is_an_error(tmp_path, monkeypatch, capsys):
    from kvrag.cli.app import main

    index = ChunkIndex(tmp_path / "server-chroma")
    with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live:
        monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "empty-home"))
        assert main(["ask", "--server", live.url, "--max-new-tokens", "3", "What do bees make?"]) == 2
    assert "neither this machine's index nor the server's" in capsys.readouterr().err


def test_kvrag_ask_through_a_server_sends_its_read_whole_flags(served, tmp_path, monkeypatch, capsys):
    """--short-context, --min-recompute and --records-whole reach the server with the request (they were
    refused through --server before); unset, the server's own defaults apply."""
    from kvrag.cli.app import main

    live, http, _ = served
    http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)})
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "empty-home"))
    ask = ["ask", "--server", live.url, "--max-new-tokens", "3", "--json", "--method", "reuse", "What do bees make?"]
    assert main(ask) == 0  # the policies are off for the test session (conftest), on the server too
    assert json.loads(capsys.readouterr().out)["stats"]["full_reason"] == ""
    assert main(ask[:-1] + ["--short-context", "1000", "--records-whole", "off", ask[-1]]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["full_reason"]  # three one-line facts: a short context


def test_remote_requests_carry_the_options_read_whole_policies_and_only_those_set():
    from kvrag.client import request_body
    from kvrag.options import AnswerOptions

    ctx = request_body("q", ["a"], options=AnswerOptions(short_context=0, records_whole=False))["kvrag"]
    assert ctx["short_context"] == 0 and ctx["records_whole"] is False and "min_recompute" not in ctx
    assert not {"short_context", "records_whole", "min_recompute"} & set(request_body("q", ["a"])["kvrag"])
