"""A follow-up answered from its history through `kvrag serve` and the `openai` client, on the bundled model, with the
default prompt layout (kvrag.kv.layout_options; chosen by `kvrag eval layout`, docs/bench/layout). The conversation is
one of the layout eval's: under the layout kvrag used before (the documents at the head of the first user turn
under "Document:" headers, "Question: " before every turn) the model answered its turn two with turn one's topic."""

from __future__ import annotations

import json
from importlib import resources

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvrag import Chunk, KVRag  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from test_server import LiveServer  # noqa: E402

CONVERSATION = "fennick-b"


def conversation(case_id: str) -> tuple[list[Chunk], list[tuple[str, list[str]]]]:
    """The case's document and the two the layout eval puts beside it, and its two turns."""
    from kvrag.eval.layout_eval import load_conversations

    case = next(c for c in load_conversations() if c.id == case_id)
    return case.chunks, case.turns


def follow_up_through_the_server(smollm, tmp_path, layout=None) -> tuple[str, str, list[str]]:
    """Both turns sent by the `openai` package to a server that retrieves from its own index (all three documents)."""
    openai = pytest.importorskip("openai")
    chunks, ((q1, _), (q2, _)) = conversation(CONVERSATION)
    rag = KVRag(smollm, store="memory://", check=False, layout=layout)
    index = ChunkIndex(tmp_path / "chroma")
    rag.precompute(chunks, progress=False)
    index.add(chunks)
    with LiveServer(create_app(rag, ServerSettings(), index)) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        m = [{"role": "user", "content": q1}]
        one = client.chat.completions.create(model="kvrag", messages=m).choices[0].message.content
        m += [{"role": "assistant", "content": one}, {"role": "user", "content": q2}]
        two = client.chat.completions.create(model="kvrag", messages=m)
    return one, two.choices[0].message.content, [s["id"] for s in two.model_extra["kvrag_sources"]]


@pytest.mark.smollm
def test_a_follow_up_is_answered_from_its_history_through_kvrag_serve(smollm, tmp_path, shipped_defaults):
    _, ((_, gold1), (_, gold2)) = conversation(CONVERSATION)
    one, two, sources = follow_up_through_the_server(smollm, tmp_path)
    assert len(sources) == 3  # every document retrieved: the follow-up's "it" is resolved by the history alone
    assert any(g.lower() in one.lower() for g in gold1), one
    assert any(g.replace(",", "") in two.replace(",", "") for g in gold2), two


def test_the_conversation_is_in_the_bundled_set():
    spec = json.loads(resources.files("kvrag.eval").joinpath("layout_conversations.json").read_text(encoding="utf-8"))
    assert CONVERSATION in {c["id"] for c in spec["conversations"]}
    assert len(spec["conversations"]) >= 30
