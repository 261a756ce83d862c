"""Issue #17: on the bundled model, the three-document Eiffel question is answered "1889" through
the CLI by Full Attention, plain reuse and every method at r = 0.15 (the default stop rule on)."""

import pytest

from kvrag.cli import main

pytestmark = pytest.mark.smollm

DOCS = {
    "eiffel.txt": "The Eiffel Tower in Paris was completed in 1889.",
    "fuji.txt": "Mount Fuji is the highest mountain in Japan.",
    "wall.txt": "The Great Wall of China is thousands of kilometres long.",
}
METHODS = ["full", "reuse", "cacheblend", "epic", "a3", "fusionrag", "samkv"]


def test_eiffel_question_through_the_cli(tmp_path, capsys, smollm):
    for name, text in DOCS.items():
        (tmp_path / name).write_text(text + "\n", encoding="utf-8")
    common = ["--collection", "eiffel_docs", "--store", f"disk://{tmp_path / 'kv'}", "--device", "cpu"]
    assert main(["ingest", *common, str(tmp_path)]) == 0
    answers = {}
    for method in METHODS:
        capsys.readouterr()
        assert main(["ask", *common, "When was the Eiffel Tower completed?", "-k", "3", "--method", method,
                     "--recompute-ratio", "0.15", "--json"]) == 0
        answers[method] = capsys.readouterr().out
    wrong = {m: a for m, a in answers.items() if "1889" not in a}
    assert not wrong, wrong
