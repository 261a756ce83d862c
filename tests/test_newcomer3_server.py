"""Issue 70, item 5: a server whose index holds nothing says so. A chat request it retrieves for and finds
nothing for answers with the `X-KVRag-Warning` header, the `kvrag_warning` field and, unless the request opts
out (`"kvrag": {"warn_in_answer": false}`), a first line saying no document matched; /metrics counts it.

Real HTTP (uvicorn on a loopback port, as tests/test_server.py), a real Chroma index that starts empty, the
real `openai` client and LangChain's ChatOpenAI unchanged; a tiny model.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import create_app  # noqa: E402
from test_server import SETTINGS, LiveServer, chunk_json, tiny_rag  # noqa: E402
from test_server_retrieval import FACTS  # noqa: E402

WARNING_HEADER = "x-kvrag-warning"
QUESTION = "Who founded the company?"
FIRST_LINE = "[kvrag: no document matched"


@pytest.fixture
def served(tmp_path):
    """A tiny engine behind a server whose retrieval index is empty; the openai client and plain HTTP on it."""
    index = ChunkIndex(tmp_path / "chroma")
    with LiveServer(create_app(tiny_rag(), SETTINGS, index)) as live, \
            httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0,
                               http_client=httpx.Client(trust_env=False, timeout=60))
        yield live, client, http


def _ask(client, **extra):
    raw = client.chat.completions.with_raw_response.create(
        model="kvrag", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, **extra)
    return raw.headers, raw.parse()


def _counted(http, reason: str) -> float:
    text = http.get("/metrics").text
    found = re.search(rf'^kvrag_answers_without_documents_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_an_empty_index_says_so_in_the_header_the_field_and_the_first_line(served):
    _, client, http = served
    headers, completion = _ask(client)
    assert "no document matched" in headers[WARNING_HEADER] and "ingested" in headers[WARNING_HEADER]
    assert completion.model_extra["kvrag_warning"] == headers[WARNING_HEADER]
    assert completion.model_extra["kvrag_sources"] == []
    content = completion.choices[0].message.content
    assert content.startswith(FIRST_LINE) and "not from your documents" in content.split("\n")[0]
    assert _counted(http, "empty") == 1.0


def test_a_client_can_keep_the_answer_text_clean(served):
    _, client, http = served
    headers, completion = _ask(client, extra_body={"kvrag": {"warn_in_answer": False}})
    assert WARNING_HEADER in headers and "kvrag_warning" in completion.model_extra  # still said where it costs nothing
    assert not completion.choices[0].message.content.startswith("[kvrag:")
    assert _counted(http, "empty") == 1.0


def test_streaming_opens_with_the_warning(served):
    _, client, http = served
    with client.chat.completions.with_streaming_response.create(
            model="kvrag", messages=[{"role": "user", "content": QUESTION}], max_tokens=4, stream=True) as response:
        assert "no document matched" in response.headers[WARNING_HEADER]
        chunks = list(response.parse())
    assert chunks[0].model_extra["kvrag_warning"] and chunks[-1].model_extra["kvrag_warning"]
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces[0].startswith(FIRST_LINE) and "".join(pieces).startswith(FIRST_LINE)
    assert _counted(http, "empty") == 1.0


def test_chat_openai_shows_the_warning(served):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    live, _, _ = served
    llm = langchain_openai.ChatOpenAI(base_url=f"{live.url}/v1", api_key="dummy", model="kvrag", max_tokens=4,
                                      temperature=0, max_retries=0, timeout=60)
    assert llm.invoke(QUESTION).content.startswith(FIRST_LINE)


def test_no_warning_once_documents_match_or_when_plain_chat_is_asked(served):
    _, client, http = served
    headers, completion = _ask(client, extra_body={"kvrag": {"retrieve": False}})  # plain chat, asked for: nothing to warn of
    assert WARNING_HEADER not in headers and "kvrag_warning" not in completion.model_extra
    assert http.post("/v1/chunks", json={"chunks": chunk_json(FACTS)}).status_code == 200
    headers, completion = _ask(client)
    assert WARNING_HEADER not in headers and "kvrag_warning" not in (completion.model_extra or {})
    assert [s["id"] for s in completion.model_extra["kvrag_sources"]]
    assert not completion.choices[0].message.content.startswith("[kvrag:")
    assert _counted(http, "empty") == 0.0 and "kvrag_answers_without_documents_total" in http.get("/metrics").text
