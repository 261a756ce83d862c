"""Fictional-fact question sets (kvrag.eval.synthetic): deterministic, loadable, answerable only from the gold document."""

from __future__ import annotations

import re

import pytest

from kvrag.eval import synthetic
from kvrag.eval.data import load_examples
from kvrag.eval.synthetic import KINDS, QUESTION_TEMPLATES, STYLES, normalize, rows, write_jsonl


def _contains(text: str, phrase: str) -> bool:
    return f" {normalize(phrase)} " in f" {normalize(text)} "


@pytest.mark.parametrize("style", STYLES)
def test_same_arguments_give_byte_identical_files(tmp_path, style):
    a = write_jsonl(rows(24, seed=7, style=style, docs=4, phrasings="train"), tmp_path / "a.jsonl")
    b = write_jsonl(rows(24, seed=7, style=style, docs=4, phrasings="train"), tmp_path / "b.jsonl")
    assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl"]  # no temporary file left behind


def test_rows_load_through_load_examples(tmp_path):
    made = rows(18, seed=1000, style="short", docs=3, phrasings="heldout")
    examples = load_examples(write_jsonl(made, tmp_path / "facts.jsonl"))
    assert [e.id for e in examples] == [r["id"] for r in made]
    for ex, row in zip(examples, made):
        assert ex.question == row["question"] and ex.answers == row["answers"]
        assert len(ex.chunks) == 3 and ex.gold_index == row["gold_index"]
        assert ex.chunks[ex.gold_index].title == row["ctxs"][row["gold_index"]]["title"]
    assert made[0]["id"] == "facts-short-1000-0000"
    assert made[0]["source"].startswith("kvrag.eval.synthetic style=short seed=1000 phrasings=heldout")


@pytest.mark.parametrize("style", STYLES)
def test_only_the_gold_document_holds_the_answer(style):
    made = rows(60, seed=3, style=style, docs=5)
    for row in made:
        gold = row["ctxs"][row["gold_index"]]["text"]
        assert row["answers"][0] in gold  # the exact fact as the document writes it
        assert _contains(gold, row["answers"][0])
        for j, ctx in enumerate(row["ctxs"]):
            if j != row["gold_index"]:
                assert not _contains(ctx["text"], row["answers"][0]), (row["id"], ctx["text"])
    assert {len(r["ctxs"]) for r in made} == {5}
    assert len({r["gold_index"] for r in made}) > 1  # the gold document is not always in the same place


def test_answer_forms():
    by_kind = {k: [r for i, r in enumerate(rows(36, seed=5)) if KINDS[i % len(KINDS)] == k] for k in KINDS}
    assert all(re.fullmatch(r"\d{4}", r["answers"][0]) and len(r["answers"]) == 1 for r in by_kind["year"])
    for r in by_kind["number"]:
        value, unit = r["answers"][0].split(" ", 1)
        assert r["answers"] == [f"{value} {unit}", value] and value.isdigit()
    for r in by_kind["person"]:
        assert r["answers"][1] == r["answers"][0].split()[-1]
    assert all(re.fullmatch(r"\w+, \w+ and \w+", r["answers"][0]) and len(r["answers"]) == 1 for r in by_kind["list"])


def test_train_and_heldout_templates_are_disjoint_and_cover_every_kind():
    assert set(QUESTION_TEMPLATES) == set(KINDS)
    train = {t for k in KINDS for t in QUESTION_TEMPLATES[k]["train"]}
    heldout = {t for k in KINDS for t in QUESTION_TEMPLATES[k]["heldout"]}
    assert not train & heldout
    for kind in KINDS:
        assert QUESTION_TEMPLATES[kind]["train"] and QUESTION_TEMPLATES[kind]["heldout"]
        assert len(synthetic.templates(kind, "all")) >= 4
    assert {i % len(KINDS) for i in range(len(rows(12)))} == set(range(len(KINDS)))


def test_phrasing_group_changes_questions_not_entities():
    train, heldout = rows(30, seed=11, phrasings="train"), rows(30, seed=11, phrasings="heldout")
    assert [r["ctxs"] for r in train] == [r["ctxs"] for r in heldout]
    assert [r["answers"] for r in train] == [r["answers"] for r in heldout]
    assert all(a["question"] != b["question"] for a, b in zip(train, heldout))


def test_one_style_documents_are_a_single_sentence():
    for row in rows(30, seed=2, style="one", docs=4):
        for ctx in row["ctxs"]:
            assert ctx["text"].endswith(".") and len(re.findall(r"[.!?](\s|$)", ctx["text"])) == 1, ctx["text"]


@pytest.mark.parametrize("style,low,high", [("short", 2, 5), ("long", 6, 10)])
def test_document_lengths(style, low, high):
    for row in rows(30, seed=4, style=style):
        for ctx in row["ctxs"]:
            assert low <= len(re.findall(r"[.!?](\s|$)", ctx["text"])) <= high, ctx["text"]


def test_ids_unique_and_seeds_give_different_entities():
    made = rows(120, seed=0)
    assert len({r["id"] for r in made}) == len(made)
    gold = {r["ctxs"][r["gold_index"]]["title"] for r in made}
    other = {r["ctxs"][r["gold_index"]]["title"] for r in rows(120, seed=1000)}
    assert not gold & other
    assert rows(10, seed=0) == made[:10]  # a longer set extends a shorter one


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        rows(3, style="medium")
    with pytest.raises(ValueError):
        rows(3, phrasings="test")


def test_cli_writes_the_file(tmp_path):
    out = tmp_path / "facts.jsonl"
    assert synthetic.main(["--n", "6", "--seed", "1000", "--style", "long", "--docs", "2", "--phrasings", "heldout", "--out", str(out)]) == 0
    assert len(load_examples(out)) == 6
    assert out.read_bytes() == write_jsonl(rows(6, 1000, "long", 2, "heldout"), tmp_path / "same.jsonl").read_bytes()
