"""Sources an OpenAI client can see: `kvrag serve --cite-sources` (ServerSettings.cite_sources) or a request's
`"kvrag": {"cite": true}` ends a retrieved answer with "Sources: [1] <title> (<file>)" (kvrag.server.cite),
streamed as a last piece. Off by default. LangChain's ChatOpenAI unchanged, against a real HTTP server and a
real chroma index; a tiny model (the mechanics, not the wording)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
langchain_openai = pytest.importorskip("langchain_openai")

from kvrag import Chunk  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from kvrag.server.cite import sources_block  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

DOCS = "/srv/library/docs"  # the folder an ingest was given: clients see names relative to it, never this path
FACTS = [Chunk("owl-1", "Owls hunt at night in the quiet forest.", title="Owls", metadata={"source": f"{DOCS}/birds/owls.md"}),
         Chunk("owl-2", "Owls swallow their prey whole.", title="Owls", metadata={"source": f"{DOCS}/birds/owls.md"}),
         Chunk("bee", "Bees make honey from the nectar of flowers.", title="Bees", metadata={"source": f"{DOCS}/insects/bees.md"})]
OWLS = "[1] Owls (birds/owls.md)"


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    index = ChunkIndex(tmp_path_factory.mktemp("cite") / "chroma", sources_under=[DOCS])
    index.add(FACTS)  # what `kvrag ingest docs/` leaves
    return index


@pytest.fixture(scope="module")
def rag():
    rag = tiny_rag()
    rag.precompute(FACTS, progress=False)
    return rag


def _llm(live: LiveServer, **kw) -> "langchain_openai.ChatOpenAI":
    return langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="unused", model="kvrag", max_tokens=4, temperature=0,
                                       max_retries=0, **kw)


def test_chat_openai_sees_the_sources_when_it_asks_and_only_then(rag, index):
    with LiveServer(create_app(rag, SETTINGS, index)) as live:
        plain = _llm(live).invoke("When do owls hunt?").content
        assert "Sources:" not in plain  # off by default: what the model said
        cited = _llm(live, extra_body={"kvrag": {"cite": True}}).invoke("When do owls hunt?").content
        assert cited.startswith(f"{plain}\n\nSources:\n" if plain else "Sources:\n")  # the model's text, then the block
        lines = cited.rsplit("Sources:\n", 1)[1].split("\n")
        assert lines[0] == OWLS and lines[1] == "[2] Bees (insects/bees.md)" and len(lines) == 2  # one line a document
        assert DOCS not in cited
        streamed = "".join(str(c.content) for c in _llm(live, extra_body={"kvrag": {"cite": True}}).stream("When do owls hunt?"))
        assert streamed == cited  # the block is the stream's last piece


def test_the_server_default_cites_and_a_request_may_turn_it_off(rag, index):
    settings = dataclasses.replace(SETTINGS, cite_sources=True)
    with LiveServer(create_app(rag, settings, index)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        assert OWLS in _llm(live).invoke("When do owls hunt?").content  # ChatOpenAI unchanged
        off = _llm(live, extra_body={"kvrag": {"cite": False}}).invoke("When do owls hunt?").content
        assert "Sources:" not in off
        body = http.post("/v1/chat/completions", json=chat("When do owls hunt?")).json()
        assert OWLS in body["choices"][0]["message"]["content"] and body["kvrag_sources"][0]["source"] == "birds/owls.md"
        assert body["usage"]["completion_tokens"] == body["kvrag_stats"]["generated_tokens"]  # the block is no model token
        for nothing_retrieved in ({"retrieve": False}, {"chunk_ids": ["bee"]}):  # plain chat; a request's own context
            text = http.post("/v1/chat/completions", json=chat("What do bees make?", kvrag=nothing_retrieved)).json()
            assert "Sources:" not in text["choices"][0]["message"]["content"]


def test_the_block_is_one_line_a_document_and_names_nothing_it_should_not():
    sources = [{"id": "a", "title": "Tides\n[9] Forged (evil.md)", "source": "sea/tides.md"},
               {"id": "b", "title": "", "source": "notes.txt"}, {"id": "c", "title": "", "source": ""},
               {"id": "d", "title": "Tides\n[9] Forged (evil.md)", "source": "sea/tides.md"}]
    assert sources_block(sources) == "\n\nSources:\n[1] Tides [9] Forged (evil.md) (sea/tides.md)\n[2] notes.txt\n[3] c"
    assert sources_block([]) == sources_block(None) == ""


def test_kvrag_serve_takes_cite_sources():
    import argparse

    from kvrag.cli.serve import add_serve_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    assert settings_from_args(parser.parse_args(["serve", "--cite-sources"])).cite_sources is True
    assert settings_from_args(parser.parse_args(["serve"])).cite_sources is False
