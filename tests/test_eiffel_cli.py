"""Issues #17 and #34: on the bundled model, the three-document Eiffel question, in two phrasings,
is answered "1889" through the CLI by Full Attention, plain reuse, every method at its default ratio
and the default (no method named), as users get them: three one-line documents are within
`min_recompute`, so every method reads them whole over the base weights (the stats say so). With
the reuse-tuned adapter asked for (`--link-adapter tuned`), Full Attention is still the base model's
and kvlink answers right too.
A3 and SamKV recite a chunk header first ("Document: eiffel"); that line is left out of the answer
(decode.leading_echo), so their answer is the line after it."""

import json

import pytest

from kvrag.cli.app import main

pytestmark = pytest.mark.smollm

DOCS = {
    "eiffel.txt": "The Eiffel Tower in Paris was completed in 1889.",
    "fuji.txt": "Mount Fuji is the highest mountain in Japan.",
    "wall.txt": "The Great Wall of China is thousands of kilometres long.",
}
METHODS = ["full", "reuse", "cacheblend", "epic", "a3", "fusionrag", "samkv", "kvlink", None]  # None: the default
QUESTIONS = ["In which year was the Eiffel Tower completed?", "When was the Eiffel Tower completed?"]
CASES = [("auto", m, q) for m in METHODS for q in QUESTIONS] + [("tuned", m, q) for m in ("full", "kvlink", None) for q in QUESTIONS]


@pytest.fixture(scope="module")
def ingest(tmp_path_factory, smollm):
    """The CLI options of a store holding the three documents under the given weights, ingested once each."""
    folder = tmp_path_factory.mktemp("eiffel")
    for name, text in DOCS.items():
        (folder / name).write_text(text + "\n", encoding="utf-8")
    done: dict[str, list[str]] = {}

    def options(weights: str) -> list[str]:
        if weights not in done:
            common = ["--collection", "eiffel_docs", "--store", f"disk://{folder / 'kv'}", "--device", "cpu",
                      "--link-adapter", weights]
            assert main(["ingest", *common, str(folder)]) == 0
            done[weights] = common
        return done[weights]

    return options


@pytest.mark.parametrize(("weights", "method", "question"), CASES)
def test_eiffel_question_through_the_cli(ingest, capsys, shipped_defaults, weights, method, question):
    common = ingest(weights)
    capsys.readouterr()
    named = ["--method", method] if method else []
    assert main(["ask", *common, question, "-k", "3", *named, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "1889" in out["answer"], (weights, method, question, out["answer"])
    assert out["stats"]["full_reason"] or method == "full"  # read whole: 3 sentences are within min_recompute
    assert out["stats"]["weights"] == "base"
