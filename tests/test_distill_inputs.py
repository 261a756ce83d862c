"""Distillation's inputs fail clearly and lose nothing: a malformed training row is named by its line, and the
teacher's cached targets are keyed by the model and the prompt's ids (its layout and data), so another model's
cache or a changed prompt is computed afresh, never read as this one's."""

import json

import pytest
import torch

from kvrag.training.data import load_rows
from kvrag.training.distill import Teacher, TeacherTargets
from tiny import tiny_model


def _good(i: int) -> str:
    return json.dumps({"id": i, "question": f"q{i}?", "answers": ["a"], "ctxs": [{"title": "t", "text": "x y"}]})


@pytest.mark.parametrize("bad, why", [("{not json", "not a JSON object"), ("[1, 2]", "a row must be a JSON object"),
                                      ('{"question": "q", "ctxs": "text"}', "'ctxs'")])
def test_a_malformed_training_row_is_named_by_its_file_and_line(tmp_path, bad, why):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([_good(0), "", _good(1), bad, _good(3)]) + "\n")
    with pytest.raises(ValueError, match=rf"train\.jsonl, line 4: .*{why}"):
        load_rows([f"{path}@0:4"])
    rows, _ = load_rows([f"{path}@0:2"])  # the rows before it are read as ever
    assert [r["id"] for r in rows] == [0, 1]


def test_teacher_targets_are_keyed_by_model_and_prompt(tmp_path, monkeypatch):
    model = tiny_model("llama")
    made: list[list[int]] = []

    def fake_generate(base, prompts, n_tokens, eos, topk):
        made.extend(prompts)
        return [TeacherTargets([1, 2], torch.zeros(2, 5)) for _ in prompts]

    monkeypatch.setattr("kvrag.training.distill.generate_targets_many", fake_generate)
    monkeypatch.setattr("kvrag.training.distill.teacher_prompt_ids", lambda ex: ex)
    a = Teacher(model, [0], 8, identity="model-a", cache_dir=tmp_path)
    a.targets_many([[5, 6, 7]])
    assert len(made) == 1
    Teacher(model, [0], 8, identity="model-a", cache_dir=tmp_path).targets_many([[5, 6, 7]])
    assert len(made) == 1  # read back from disk by a resumed run of the same model
    Teacher(model, [0], 8, identity="model-b", cache_dir=tmp_path).targets_many([[5, 6, 7]])
    assert len(made) == 2  # another model's cache is not this one's
    Teacher(model, [0], 8, identity="model-a", cache_dir=tmp_path).targets_many([[5, 6, 8]])
    assert len(made) == 3  # a changed prompt (another layout or row) is computed afresh
