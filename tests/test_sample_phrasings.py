"""Issue #34: the bundled sample is answered right, in every phrasing. The sample corpus is ingested
through the CLI and every question of kvrag/sample_questions.json is asked in each of its phrasings,
with Full Attention and with the default (no method named): every question base Full Attention
answers right, the default answers right too (and the default may answer more). The top-5 contexts
of this corpus (~570-650 tokens) are within the short-context limit (DEFAULT_SHORT_CONTEXT), so every
method reads them whole and answers as Full does: checked for each method on one phrasing of each
question. What the methods do on such contexts with the policy off is the suite's `sample` rows."""

import json

import pytest

from kvrag.cli.app import main
from kvrag.eval.metrics import contains
from kvrag.methods import METHODS
from kvrag.ingest.samples import sample_corpus_dir, sample_questions

pytestmark = pytest.mark.smollm

PHRASINGS = [(q["answer"], text) for q in sample_questions() for text in [q["question"], *q["phrasings"]]]


@pytest.fixture(scope="module")
def common(tmp_path_factory, smollm):
    folder = tmp_path_factory.mktemp("sample")
    opts = ["--collection", "sample_docs", "--store", f"disk://{folder / 'kv'}", "--device", "cpu"]
    assert main(["ingest", *opts, str(sample_corpus_dir())]) == 0
    return opts


def ask(capsys, common, question, *extra):
    capsys.readouterr()
    assert main(["ask", *common, question, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_phrasing_full_gets_right_the_default_gets_right(common, capsys, shipped_defaults):
    assert len(PHRASINGS) >= 2 * len(sample_questions())
    full_right, default_right, lost = 0, 0, []
    for answer, question in PHRASINGS:
        full = contains(ask(capsys, common, question, "--method", "full")["answer"], [answer])
        out = ask(capsys, common, question)
        default = contains(out["answer"], [answer])
        full_right += full
        default_right += default
        if full and not default:
            lost.append((question, out["answer"]))
    print(f"sample phrasings: base Full {full_right:.0f}/{len(PHRASINGS)}, default {default_right:.0f}/{len(PHRASINGS)}")
    assert not lost, lost


@pytest.mark.parametrize("method", [m for m in METHODS if m != "full"])
def test_every_method_reads_the_sample_whole(common, capsys, shipped_defaults, method):
    question = sample_questions()[0]["question"]
    out = ask(capsys, common, question, "--method", method)
    assert "short_context" in out["stats"]["full_reason"]
    assert out["answer"] == ask(capsys, common, question, "--method", "full")["answer"]
