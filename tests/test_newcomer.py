"""A newcomer's run (fresh clone, README only), item by item: what a user reads in `stats.summary()`,
what `kvrag serve` does before it reports healthy, and which store `kvrag demo` reads.

(The damaged `.kv` entry: tests/test_damaged_entries.py.)
"""

from __future__ import annotations

import pytest

from kvrag.server.warmup import warm_up
from test_server import tiny_rag
from tiny import THREE_CHUNKS, THREE_Q


def test_summary_names_the_read_whole_policy_when_it_applied(monkeypatch):
    rag = tiny_rag()
    rag.precompute(THREE_CHUNKS, progress=False)
    whole = rag.answer(THREE_Q, chunk_ids=["a"], max_new_tokens=1, short_context=768).stats
    assert whole.full_reason and 'read_whole="' in whole.summary() and "short_context=768" in whole.summary()
    assert whole.summary().startswith("method=")
    reused = rag.answer(THREE_Q, chunk_ids=["a"], max_new_tokens=1, short_context=0, min_recompute=0).stats
    assert not reused.full_reason and "read_whole" not in reused.summary()


def test_the_warm_up_answers_once_and_keeps_nothing():
    rag = tiny_rag()
    puts = rag.store.stats().puts
    assert warm_up(rag) > 0
    assert rag.prefix_cache.snapshot().entries == 0  # no turn kept
    assert len(rag.store) <= 1 and rag.store.stats().puts - puts <= 1  # the system prefix's entry at most: no chunk KV


def test_the_demo_answers_from_the_store_and_index_the_quickstart_filled(tmp_path, monkeypatch):
    """`kvrag demo` used to ingest the sample into a store and index of its own and compute every chunk's
    KV again; it now opens those `kvrag ingest` and the quickstart fill, and computes nothing they hold."""
    pytest.importorskip("streamlit")
    from kvrag import KVRag
    from kvrag.cache_backends import open_store
    from kvrag.demo import ingest, stores
    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.ingest.samples import sample_corpus_dir

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    monkeypatch.delenv("KVRAG_DEMO_DIR", raising=False)
    cli = tiny_rag(None)  # the engine's default store under $KVRAG_HOME/kv, as `kvrag ingest` opens it
    chunks = load_documents([sample_corpus_dir()])[:6]  # as the quickstart loads them
    ChunkIndex().add(chunks)  # the default index under $KVRAG_HOME/chroma
    cli.precompute(chunks, progress=False)

    folder = stores.data_dir()
    url = stores.default_store_url(folder)
    stores.check_store_url(url, folder)  # the page may open it
    demo = KVRag(cli.lm, store=open_store(url))
    index = ChunkIndex(tmp_path / "chroma")
    monkeypatch.setattr(ingest, "ingest_registry", lambda: ingest._IngestRegistry())
    ingest.ensure_ingested(demo, index, folder, ())
    assert len(index) == len(chunks) and demo.store.stats().puts == 0  # nothing indexed or computed again
    found = index.query(chunks[0].text, k=2)
    out = demo.answer("When did it open?", chunks=found, max_new_tokens=1, short_context=0, min_recompute=0)
    assert out.stats.cache_hits == 2 and out.stats.cache_misses == 0  # the quickstart's KV, read as it was stored
