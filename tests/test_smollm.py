"""A few checks on the real bundled SmolLM2-135M-Instruct."""

import json

import pytest

from kvrag import Chunk, KVRag
from kvrag.cli.app import main

pytestmark = pytest.mark.smollm

EIFFEL = Chunk("eiffel", "The Eiffel Tower is a wrought-iron tower in Paris, the capital of France. It was completed in 1889.", "Eiffel Tower")
DISTRACTORS = [
    Chunk("bees", "Honeybees turn flower nectar into honey by evaporating its water inside the hive.", "Honeybees"),
    Chunk("rail", "The old mountain railway climbs through three tunnels before reaching the summit station.", "Railway"),
]


@pytest.fixture(scope="module")
def rag(smollm):
    r = KVRag(smollm, store="memory://")
    r.precompute([EIFFEL, *DISTRACTORS], progress=False)
    return r


@pytest.mark.parametrize("method", ["full", "reuse"])
def test_single_document_question_is_answered(rag, method):
    out = rag.answer("In which city is the Eiffel Tower?", ["eiffel"], method=method, max_new_tokens=24)
    assert "Paris" in out.text
    assert out.stats.method == method


def test_single_chunk_reuse_matches_full_on_the_real_model(rag):
    full = rag.prefill("When was the Eiffel Tower completed?", ["eiffel"], method="full")
    reuse = rag.prefill("When was the Eiffel Tower completed?", ["eiffel"], method="reuse")
    assert (full.logits - reuse.logits).abs().max().item() <= 1e-3  # 30 layers of fp32: a little more slack
    assert int(full.logits.argmax()) == int(reuse.logits.argmax())


@pytest.mark.parametrize("method", ["full", "reuse"])
def test_answer_found_among_distractors(rag, method):
    out = rag.answer("When was the Eiffel Tower completed?", ["bees", "eiffel", "rail"], method=method, max_new_tokens=24)
    assert "1889" in out.text


def test_cli_ingest_then_ask(tmp_path, kvrag_home, capsys):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "eiffel.md").write_text("# Eiffel Tower\n\n" + EIFFEL.text + "\n")
    (corpus / "bees.txt").write_text(DISTRACTORS[0].text + "\n")
    store = f"disk://{tmp_path}/kv"
    assert main(["ingest", "--store", store, "--collection", "cli_test", str(corpus)]) == 0
    assert "ingested 2 chunks (2 computed" in capsys.readouterr().err
    assert main(["ask", "--store", store, "--collection", "cli_test", "-k", "2", "--json", "In which city is the Eiffel Tower?"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "Paris" in result["answer"]
    assert result["stats"]["cache_hits"] == 2 and result["stats"]["chunk_prefill_tokens"] == 0
    # what the answer read: each chunk's id, title, source file and text (issue #38)
    by_id = {s["id"]: s for s in result["sources"]}
    assert list(by_id) == result["chunk_ids"]
    eiffel = next(s for s in result["sources"] if "Eiffel" in s["text"])
    assert eiffel["title"] == "Eiffel Tower" and eiffel["source"].endswith("eiffel.md") and "1889" in eiffel["text"]
    # --sources: the same, after the plain answer (title, file, id, first line)
    assert main(["ask", "--store", store, "--collection", "cli_test", "-k", "2", "--sources", "In which city is the Eiffel Tower?"]) == 0
    answer, listing = capsys.readouterr().out.split("sources:\n")
    assert "Paris" in answer and "'Eiffel Tower' (" in listing and "eiffel.md) id=" in listing and f"id={eiffel['id']}" in listing


def test_cli_reports_errors_without_a_traceback(tmp_path, kvrag_home, capsys):
    assert main(["ingest", str(tmp_path / "missing")]) == 2
    assert "kvrag: error:" in capsys.readouterr().err


def test_similarity_guided_preprocessing_lowers_kv_deviation(smollm, kvrag_home):
    """FusionRAG §3.1 on the real model: chunks precomputed with their 2 most similar neighbours."""
    from pathlib import Path

    from kvrag.eval.data import load_examples
    from kvrag.eval.deviation import kv_deviation
    from kvrag.kv.similarity import neighbours_by_embedding

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "nq10_dev.jsonl"
    if not data.exists():
        pytest.skip("shared/data not beside the repository")
    ex = load_examples(data, n=1, seed=3)[0]
    r = KVRag(smollm, store="memory://")
    ids = [c.id for c in ex.chunks]
    r.precompute(ex.chunks, progress=False)
    r.precompute(ex.chunks, kind="similarity", neighbours=neighbours_by_embedding(ex.chunks, 2), progress=False)
    plain = kv_deviation(r, ex.question, ids)
    sim = kv_deviation(r, ex.question, ids, kv_kind="similarity")
    print(f"KV deviation layer 1: plain {plain[1]:.3f} similarity {sim[1]:.3f}; all layers {plain.mean():.2f} vs {sim.mean():.2f}")
    assert sim[1] < 0.7 * plain[1]
    assert sim.mean() < plain.mean()
