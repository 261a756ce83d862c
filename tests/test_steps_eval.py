"""`kvrag eval steps`: a training run's adapter snapshots judged against base Full and plain reuse, per step."""

import json

import pytest

from kvrag.cli.app import main
from kvrag.eval.data import Example
from kvrag.eval.steps_eval import collect, mean_agreement, run_steps, snapshots, steps_markdown, write
from kvrag.link_adapter import save_adapter
from kvrag.types import Chunk
from kvlink_helpers import make_rag, random_adapter

R = "reuse[records_whole=False,short_context=0]"  # the read-whole policies off: every context is reused
K = "kvlink@0[records_whole=False,short_context=0]{{{}}}"
EXAMPLES = [
    Example(f"ex{i}", f"What does document {i} say?", [f"fact {i}"],
            [Chunk(f"c{i}-{j}", f"Document {i}.{j} states fact {i * 10 + j} about topic {j}.") for j in range(3)])
    for i in range(2)
]


def _run_with_snapshots(tmp_path, steps=(0, 10, 5)):
    rag = make_rag()
    (tmp_path / "run" / "snaps").mkdir(parents=True)
    for s in steps:  # a different adapter per step; step 10 repeats step 0's, so their answers must match
        adapter = random_adapter(rag.lm, k=2, seed=0 if s in (0, 10) else 1, layout_identity=rag.layout.identity)
        save_adapter(tmp_path / "run" / "snaps" / f"step-{s}.safetensors", adapter)
    (tmp_path / "run" / "snaps" / "step-x.safetensors").write_bytes(b"not a snapshot name")
    return rag, snapshots(tmp_path / "run")


def test_snapshots_are_found_by_step_and_a_run_without_any_is_a_clear_error(tmp_path):
    _, snaps = _run_with_snapshots(tmp_path)
    assert [(label, step) for label, step, _ in snaps] == [("run", 0), ("run", 5), ("run", 10)]
    with pytest.raises(FileNotFoundError, match="step-N.safetensors"):
        snapshots(tmp_path / "nothing")


def test_each_snapshot_is_judged_against_the_same_full_answers(tmp_path):
    rag, snaps = _run_with_snapshots(tmp_path)
    out = tmp_path / "out"
    result = run_steps(rag, snaps, {"tiny": EXAMPLES}, [3], out, progress=False)
    (block,) = result["blocks"]
    assert block["n"] == 2 and {"full", R, K.format("run:0"), K.format("run:5"), K.format("run:10")} <= set(block["rows"])
    records = [json.loads(line) for line in (out / "tiny" / "len3" / "records.jsonl").read_text().splitlines()]
    texts = {(r["example"], r["setting"]): r["answer"] for r in records}
    for ex in EXAMPLES:  # the same adapter gives the same answer, whichever step it was saved at
        assert texts[(ex.id, K.format("run:0"))] == texts[(ex.id, K.format("run:10"))]
    assert block["rows"]["full"]["agree"] == 1.0
    # the read-whole policies are off: these short contexts are reused, not answered by Full Attention for every column
    assert {r["answered_with"] for r in records if r["setting"] != "full"} == {"reuse", "kvlink"}
    # resumable: a second run adds no record, and the report reads back what is there
    run_steps(rag, snaps, {"tiny": EXAMPLES}, [3], out, progress=False)
    assert len((out / "tiny" / "len3" / "records.jsonl").read_text().splitlines()) == len(records)
    assert collect(out, ["tiny"], [3], [("run", 0), ("run", 5), ("run", 10)])["blocks"][0]["rows"].keys() == block["rows"].keys()
    write(result, out, {"command": "kvrag eval steps --run run"})
    text = (out / "README.md").read_text()
    assert "| tiny | 3 | 2 |" in text and "step 0" in text and "step 10" in text
    assert set(mean_agreement(result)) == {"reuse", "step 0", "step 5", "step 10"}
    assert json.loads((out / "steps.json").read_text())["columns"] == [["run", 0], ["run", 5], ["run", 10]]
    assert (out / "steps.png").is_file()


def _record(example, setting, method):
    return {"example": example, "setting": setting, "method": method, "ratio": 0.0, "answer": "x", "f1": 1.0, "contains": 1.0,
            "agree": 1.0, "kl": 0.0, "ttft_s": 1.0, "full_ttft_s": 2.0, "decode_tok_s": 10.0, "recomputed_tokens": 0,
            "context_tokens": 10}


def test_the_report_of_a_block_keeps_only_questions_every_setting_answered(tmp_path):
    folder = tmp_path / "s" / "len16"
    folder.mkdir(parents=True)
    rows = [_record("a", st, m) for st, m in (("full", "full"), (R, "reuse"), (K.format("a:0"), "kvlink"), (K.format("b:0"), "kvlink"))]
    rows.append(_record("b", "full", "full"))  # b was not answered by every setting: left out, rows stay paired
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = collect(tmp_path, ["s"], [16], [("a", 0), ("b", 0)])
    assert result["blocks"][0]["n"] == 1
    text = steps_markdown(result, {})  # two runs: each column names its run
    assert "| set | tokens | n | reuse | a step 0 | b step 0 | Full contained |" in text
    assert "| s | 16 | 1 | 1.00 · 0.000 · 1.00 | 1.00 · 0.000 · 1.00 | 1.00 · 0.000 · 1.00 | 1.00 |" in text


def test_eval_steps_without_a_run_folder_says_what_it_needs(tmp_path, capsys):
    assert main(["eval", "steps", "--out", str(tmp_path / "o")]) != 0
    assert "--run" in capsys.readouterr().err
    assert main(["eval", "steps", "--run", str(tmp_path), "--out", str(tmp_path / "o")]) != 0
    assert "step-N.safetensors" in capsys.readouterr().err
