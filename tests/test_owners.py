"""Documents have owners (issue #52): the hostile reproductions. A POST that brings other text for an id
`kvrag ingest` made is a 409 (nothing changes, for the index or the KV) unless it says `replace: true`,
and then the chunk's source and title are the writer's, never the old file's; sources name a file
relative to the folder ingested, never the server's path. Real HTTP, a real (embedded) chroma index,
a tiny engine."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag.ingest.documents import load_documents  # noqa: E402
from kvrag.ingest.retrieval import ChunkIndex, public_source, relative_source  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from kvrag.types import Chunk  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402

FACT = "The Brannoch Line opened in 1893 between Brannoch and the coast."
PLANTED = "The Brannoch Line opened in 1839 between Brannoch and the coast."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server over an index that `kvrag ingest` filled from docs/rail/brannoch.md (as it does: KV stored,
    then indexed with the paths it was given)."""
    root = tmp_path_factory.mktemp("owners")
    docs = root / "docs"
    (docs / "rail").mkdir(parents=True)
    (docs / "rail" / "brannoch.md").write_text(FACT + "\n")
    rag = tiny_rag()
    chunks = list(load_documents([docs]))
    rag.precompute(chunks, progress=False)
    index = ChunkIndex(root / "chroma", sources_under=[str(docs)])
    index.add(chunks)
    with LiveServer(create_app(rag, SETTINGS, ChunkIndex(root / "chroma"))) as live, \
            httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        yield http, index, rag, chunks[0]


def _post(http, chunk_id: str, text: str, title: str = "Planted", **extra):
    return http.post("/v1/chunks", json={"chunks": [{"id": chunk_id, "text": text, "title": title}], **extra})


def test_sources_name_the_file_relative_to_the_folder_ingested(served):
    http, _, _, ingested = served
    assert ingested.metadata["source"].startswith("/")  # what the index keeps for `kvrag remove`
    body = http.post("/v1/chat/completions", json=chat("When did the Brannoch Line open?")).json()
    [source] = body["kvrag_sources"]
    assert source == {"id": ingested.id, "title": ingested.title, "source": "rail/brannoch.md"}
    assert str(ingested.metadata["source"]) not in str(body)


def test_a_post_with_other_text_for_an_ingested_id_is_a_409_and_changes_nothing(served):
    http, index, rag, ingested = served
    r = _post(http, ingested.id, PLANTED, ingested.title)
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "chunk_exists" and r.json()["conflicts"] == [ingested.id]
    [kept] = index.get([ingested.id])
    assert kept.text == FACT and kept.metadata["source"] == ingested.metadata["source"]
    assert rag.repo.chunks[ingested.id].text == FACT  # the KV registry still binds the id to the file's text
    assert _post(http, ingested.id, FACT, "Another title").status_code == 409  # a title is part of what it holds


def test_the_same_text_again_is_idempotent_and_keeps_the_files_source(served):
    http, index, _, ingested = served
    r = _post(http, ingested.id, FACT, ingested.title)
    assert r.status_code == 200 and r.json()["indexed"] == 0, r.text
    assert index.get([ingested.id])[0].metadata["source"] == ingested.metadata["source"]


def test_replace_true_rewrites_and_the_source_is_the_writers_never_the_files(served):
    http, index, rag, _ = served
    other = Chunk("owned-by-api", "Trams ran in Brannoch until 1952.", title="Trams")
    assert _post(http, other.id, other.text, other.title).status_code == 200
    assert _post(http, other.id, "Trams ran until 1999.", "Trams").status_code == 409  # another writer's id too
    r = _post(http, other.id, "Trams ran in Brannoch until 1961.", "Trams (corrected)", replace=True)
    assert r.status_code == 200 and r.json()["indexed"] == 1, r.text
    [now] = index.get([other.id])
    assert now.text.endswith("1961.") and now.title == "Trams (corrected)" and public_source(now) == ""
    assert rag.repo.chunks[other.id].text.endswith("1961.")


def test_a_replaced_ingested_chunk_no_longer_credits_the_file(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "brannoch.md").write_text(FACT + "\n")
    rag, chunks = tiny_rag(), list(load_documents([docs]))
    rag.precompute(chunks, progress=False)
    index = ChunkIndex(tmp_path / "chroma", sources_under=[str(docs)])
    index.add(chunks)
    with LiveServer(create_app(rag, SETTINGS, index)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        assert _post(http, chunks[0].id, PLANTED, replace=True).status_code == 200
        [source] = http.post("/v1/chat/completions", json=chat("When did the Brannoch Line open?")).json()["kvrag_sources"]
    assert source == {"id": chunks[0].id, "title": "Planted", "source": ""}  # not brannoch.md


def test_without_an_index_the_stores_binding_is_the_owner(tmp_path):
    settings = ServerSettings(**{**SETTINGS.__dict__, "retrieval": False})
    with LiveServer(create_app(tiny_rag(), settings)) as live, httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        assert _post(http, "x1", FACT).status_code == 200
        assert _post(http, "x1", FACT).status_code == 200
        r = _post(http, "x1", PLANTED)
        assert r.status_code == 409 and r.json()["conflicts"] == ["x1"]
        assert _post(http, "x1", PLANTED, replace=True).status_code == 200


def test_relative_source_never_gives_an_absolute_path(tmp_path):
    assert relative_source(str(tmp_path / "d" / "a" / "b.md"), [tmp_path / "d"]) == "a/b.md"
    assert relative_source(str(tmp_path / "one.md"), [tmp_path / "one.md"]) == "one.md"
    assert relative_source("/elsewhere/x.txt", [tmp_path]) == "x.txt"
    assert public_source(Chunk("i", "t", metadata={"source": "/srv/secret/plan.md"})) == "plan.md"  # an older index
