"""Distillation's inputs fail clearly and lose nothing: a malformed training row is named by its line, and the
teacher's cached targets are keyed by the model and the prompt's ids (its layout and data), so another model's
cache or a changed prompt is computed afresh, never read as this one's."""

import json

import pytest
import torch

from kvrag.kv.layout import Links
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


def test_two_turn_examples_are_conversations_the_teacher_reads_as_the_chat_template_does():
    import random

    from kvrag.chat import Conversation
    from kvrag.kv.layout import PromptLayout
    from kvrag.training.data import FOLLOW_UPS, build_distill_example, example_kind
    from kvrag.training.distill import teacher_prompt_ids
    from kvrag.types import Chunk
    from tiny import qa_rows, tiny_tokenizer

    rows = qa_rows(40)
    before = [example_kind(0, 0, i, 0.5, r) for i, r in enumerate(rows)]
    after = [example_kind(0, 0, i, 0.5, r, turn_share=0.3) for i, r in enumerate(rows)]
    assert before == [example_kind(0, 0, i, 0.5, r, turn_share=0.0) for i, r in enumerate(rows)]  # off: the kinds of earlier runs
    assert [k == "continue" for k in before] == [k == "continue" for k in after]  # only qa examples become conversations
    assert "turn2" in after and "qa" in after and "turn2" not in before
    no_answer = {**rows[0], "answers": []}
    assert "turn2" not in {example_kind(0, 0, i, 0.0, no_answer, turn_share=1.0) for i in range(10)}

    tok = tiny_tokenizer()
    layout = PromptLayout(tok)
    i = after.index("turn2")
    ex = build_distill_example(layout, rows[i], random.Random(f"0:0:{i}"), "turn2", Links(2, "chunk"), 4, 2048, 8)
    qa = build_distill_example(layout, rows[i], random.Random(f"0:0:{i}"), "qa", 2, 4, 2048, 8)
    assert ex.kind == "turn2" and ex.answer == [] and [c.text for c in ex.chunks] == [c.text for c in qa.chunks]  # the qa draws
    assert ex.segments.links == 2 and ex.segments.link_scope == "chunk"
    follow = next(f for f in FOLLOW_UPS if f in tok.decode(ex.segments.question))
    text = tok.decode(ex.segments.question)
    assert rows[i]["question"] in text and rows[i]["answers"][0] in text and text.index(rows[i]["question"]) < text.index(follow)
    conv = Conversation(turns=(("user", rows[i]["question"]), ("assistant", rows[i]["answers"][0]), ("user", follow)))
    chunks = [Chunk(id=c.id, text=c.text, title=c.title) for c in ex.chunks]
    template = tok.apply_chat_template(layout.conversation_messages(chunks, conv), add_generation_prompt=True, tokenize=True)
    template = template["input_ids"] if hasattr(template, "keys") else template
    assert teacher_prompt_ids(ex) == list(template)  # the teacher reads the conversation as Full Attention over it does
