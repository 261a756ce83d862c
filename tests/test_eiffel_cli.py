"""Issue #17: on the bundled model, the three-document Eiffel question is answered "1889" through
the CLI by Full Attention, plain reuse and every method at r = 0.15 (the default stop rule on), over
the weights an engine serves by default (the shipped LoRA K = 5 adapter merged in, where kvlink is
the default method) and over the base weights with the links-only adapter.
A3 and SamKV recite a chunk header first ("Document: eiffel"); that line is left out of the answer
(decode.leading_echo), so their answer is the line after it."""

import json

import pytest

from kvrag.cli import main

pytestmark = pytest.mark.smollm

DOCS = {
    "eiffel.txt": "The Eiffel Tower in Paris was completed in 1889.",
    "fuji.txt": "Mount Fuji is the highest mountain in Japan.",
    "wall.txt": "The Great Wall of China is thousands of kilometres long.",
}
METHODS = ["full", "reuse", "cacheblend", "epic", "a3", "fusionrag", "samkv"]
# (`--link-adapter`, method): kvlink reads its link tokens well over the tuned weights only
CASES = [("auto", m) for m in [*METHODS, "kvlink"]] + [("links", m) for m in METHODS]


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


@pytest.mark.parametrize(("weights", "method"), CASES)
def test_eiffel_question_through_the_cli(ingest, capsys, weights, method):
    common = ingest(weights)
    capsys.readouterr()
    assert main(["ask", *common, "When was the Eiffel Tower completed?", "-k", "3", "--method", method,
                 "--recompute-ratio", "0.15", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)["answer"]
    assert "1889" in answer, (weights, method, answer)
