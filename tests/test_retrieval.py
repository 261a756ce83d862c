"""Tests for kvrag.ingest.retrieval.ChunkIndex against the real Chroma and the bundled MiniLM."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrag.types import Chunk

CATS = Chunk(
    id="cats",
    text="Cats are small domesticated felines that purr, chase mice and sleep most of the day.",
    title="Cats",
    metadata={"source": "pets.txt", "rank": 3, "weight": 0.5, "ok": True, "tags": ["dropped"], "none": None},
)
VOLCANO = Chunk(
    id="volcano",
    text="A volcano erupts when molten magma and lava rise through the Earth's crust, spewing ash.",
    title="Volcanoes",
)
STOCKS = Chunk(
    id="stocks",
    text="The stock market lets investors buy and sell shares of public companies; prices rise and fall.",
    title="Stock market",
)


@pytest.fixture(scope="module", autouse=True)
def no_network() -> Iterator[None]:
    """Fail loudly if anything (model loading, telemetry) tries to reach the internet."""

    def refuse(self: socket.socket, address: Any, *args: Any, **kwargs: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"network access attempted: {address!r}")
        return real_connect(self, address, *args, **kwargs)

    real_connect = socket.socket.connect
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", refuse)
        mp.setattr(socket.socket, "connect_ex", refuse)
        yield


@pytest.fixture(scope="module")
def retrieval(no_network: None) -> Any:
    """The module, with the embedder loaded once for all tests here (loading takes seconds)."""
    from kvrag.ingest import retrieval as mod

    mod.embedding_function()
    return mod


@pytest.fixture()
def index(retrieval: Any, tmp_path: Path) -> Any:
    idx = retrieval.ChunkIndex(tmp_path / "db")
    idx.add([CATS, VOLCANO, STOCKS])
    return idx


def test_offline_env_is_set(retrieval: Any) -> None:
    assert os.environ.get("HF_HUB_OFFLINE") == "1"


def test_embedding_function_is_a_singleton(retrieval: Any) -> None:
    ef = retrieval.embedding_function()
    assert ef is retrieval.embedding_function()
    vecs = ef(["hello world", "volcano"])
    assert len(vecs) == 2 and len(vecs[0]) == 384


def test_empty_index_query_returns_empty(retrieval: Any, tmp_path: Path) -> None:
    idx = retrieval.ChunkIndex(tmp_path / "empty")
    assert len(idx) == 0
    assert idx.query("anything at all") == []
    assert idx.get(["missing"]) == []


def test_add_returns_count_and_len(index: Any) -> None:
    assert len(index) == 3
    assert index.add([]) == 0
    assert len(index) == 3


@pytest.mark.parametrize(
    ("question", "expected"),
    [
        ("Which pet purrs and hunts mice?", "cats"),
        ("What happens when lava and magma erupt from a mountain?", "volcano"),
        ("How do investors trade shares of companies?", "stocks"),
    ],
)
def test_query_returns_the_right_topic_first(index: Any, question: str, expected: str) -> None:
    results = index.query(question, k=3)
    assert [c.id for c in results][0] == expected
    assert sorted(c.id for c in results) == ["cats", "stocks", "volcano"]


def test_query_k_limits_results(index: Any) -> None:
    assert len(index.query("cats", k=1)) == 1
    assert len(index.query("cats", k=50)) == 3  # more than stored is fine
    assert index.query("cats", k=0) == []


def test_query_round_trips_text_title_and_simple_metadata(index: Any) -> None:
    top = index.query("purring feline", k=1)[0]
    assert top == CATS  # id, text and title (metadata is not part of equality)
    assert top.metadata == {"source": "pets.txt", "rank": 3, "weight": 0.5, "ok": True}


def test_persistence_across_instances(retrieval: Any, tmp_path: Path) -> None:
    path = tmp_path / "persist"
    retrieval.ChunkIndex(path).add([CATS, VOLCANO])
    reopened = retrieval.ChunkIndex(str(path))
    assert len(reopened) == 2
    assert reopened.query("eruption of molten lava", k=1)[0].id == "volcano"
    # A different collection name on the same path is a separate index.
    assert len(retrieval.ChunkIndex(path, collection="other")) == 0


def test_upsert_same_id_replaces_text(index: Any) -> None:
    new = Chunk(id="cats", text="Glaciers are slow rivers of ice that carve valleys.", title="Glaciers")
    assert index.add([new]) == 1
    assert len(index) == 3
    got = index.get(["cats"])[0]
    assert got.text == new.text and got.title == "Glaciers"
    assert index.query("moving ice carving valleys", k=1)[0].id == "cats"
    # The old text is no longer found under that id.
    assert index.query("purring feline pets", k=1)[0].id != "cats"


def test_duplicate_ids_in_one_add_keep_the_last(retrieval: Any, tmp_path: Path) -> None:
    idx = retrieval.ChunkIndex(tmp_path / "dups")
    assert idx.add([Chunk("a", "first"), Chunk("a", "second")]) == 1
    assert idx.get(["a"])[0].text == "second"


def test_get_keeps_requested_order_and_skips_missing(index: Any) -> None:
    got = index.get(["stocks", "nope", "cats", "volcano"])
    assert [c.id for c in got] == ["stocks", "cats", "volcano"]
    assert got[0].text == STOCKS.text and got[0].title == STOCKS.title
    assert index.get([]) == []


def test_small_batches(retrieval: Any, tmp_path: Path) -> None:
    idx = retrieval.ChunkIndex(tmp_path / "batches")
    chunks = [Chunk(f"c{i}", f"Sentence number {i} about topic {i % 3}.") for i in range(7)]
    assert idx.add(chunks, batch_size=2) == 7
    assert len(idx) == 7
    assert [c.id for c in idx.get(["c6", "c0"])] == ["c6", "c0"]


def test_short_collection_name_rejected(retrieval: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        retrieval.ChunkIndex(tmp_path / "x", collection="ab")
