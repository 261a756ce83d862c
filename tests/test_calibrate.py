"""Calibration per model (kvrag.check.calibrate): the default a request naming no method gets.

Real runs on tiny random models: one whose answers hang on its context (weights scaled up), where reuse fails
and the default is Full Attention with the exact prefix cache, and one whose answers barely read it (default
init), where reuse passes and the default is an approximate method. The set is the shipped one's shape, only
short (a byte-level tokenizer makes the shipped contexts longer than the tiny models' positions)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvrag.check.calibrate as calibrate
from kvrag import Chunk, KVRag, from_model
from kvrag.check import calibration_store as store
from kvrag.check.answers import parted
from kvrag.check.default import default_for, forget_in_process
from kvrag.defaults import DEFAULT_RATIO, DEFAULT_SHORT_CONTEXT, FIXED_DEFAULT, Ape, DefaultSetting
from kvrag.errors import KVRagError
from kvrag.eval import synthetic
from kvrag.options import AnswerOptions
from tiny import tiny_model, tiny_tokenizer

TESTS = Path(__file__).resolve().parent
WORDS = "cat mat sun sea red owl fig jam dog log pen hen".split()


def tiny_prompts(groups: int = 2, questions: int = 2) -> list[calibrate.Prompt]:
    rng = random.Random(0)
    out = []
    for g in range(groups):
        chunks = [Chunk(f"t{g}-{i}", " ".join(rng.choice(WORDS) for _ in range(30)), f"T{i}") for i in range(3)]
        out += [calibrate.Prompt(g, f"Which word comes after {rng.choice(WORDS)} in part {j}?", chunks) for j in range(questions)]
    return out


def tiny_lm(reads_context: bool):
    """Default init: the answer barely depends on the context, so reuse gives Full's. Scaled up 4x: it hangs on it."""
    model = tiny_model("llama", seed=0)
    if reads_context:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(4.0)
    return from_model(model, tiny_tokenizer())


@pytest.fixture
def runs(monkeypatch, tmp_path, calibrated_defaults):
    """Calibration on, over the short set, results kept under this test's own model cache; counts the runs."""
    monkeypatch.setenv("KVRAG_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.setattr(calibrate, "load_prompts", lambda: tiny_prompts())
    real = calibrate.run_calibration
    count = []

    def counted(lm, **kwargs):
        count.append(lm.fingerprint)
        return real(lm, **kwargs)

    monkeypatch.setattr(calibrate, "run_calibration", counted)
    forget_in_process()
    yield count
    forget_in_process()


# -- the set ------------------------------------------------------------------------------------
def test_the_shipped_set_is_what_the_generator_builds():
    assert json.loads(store.SET_PATH.read_text(encoding="utf-8")) == synthetic.calibration_set()


def test_no_calibration_row_is_a_training_or_evaluation_row():
    kinds = synthetic.QUESTION_TEMPLATES
    own = {t for k in kinds for t in kinds[k]["calibration"]}
    assert own and not own & {t for k in kinds for g in ("train", "heldout") for t in kinds[k][g]}
    shipped = synthetic.calibration_set()["groups"]
    questions = {q["question"] for g in shipped for q in g["questions"]}
    titles = {c["title"] for g in shipped for c in g["ctxs"]}
    from kvrag.eval.suite import SETS

    for name in ("facts", "facts-one", "facts-long"):
        rows = SETS[name].build(Path("unused"), SETS[name].n)
        assert not questions & {r.question for r in rows}, name
        assert not titles & {c.title for r in rows for c in r.chunks}, name
    assert len(questions) == sum(len(g["questions"]) for g in shipped)  # every question its own
    assert {q["kind"] for g in shipped for q in g["questions"]} == set(synthetic.KINDS)  # every kind of fact


@pytest.mark.smollm
def test_every_calibration_context_is_one_the_default_reuses(smollm):
    """Neither read-whole policy applies: longer than short_context, and not records of one kind."""
    from kvrag.kv.layout import PromptLayout
    from kvrag.methods.alike import records_of_one_kind

    layout = PromptLayout(smollm.tokenizer)
    sizes = []
    for group in synthetic.calibration_set()["groups"]:
        chunks = [Chunk(str(i), c["text"], c["title"]) for i, c in enumerate(group["ctxs"])]
        sizes.append(sum(len(layout.chunk_ids(c)) for c in chunks))
        assert not records_of_one_kind([f"{c.title}\n{c.text}" for c in chunks]), group["id"]
    assert min(sizes) > DEFAULT_SHORT_CONTEXT and max(sizes) > 1.4 * min(sizes), sizes  # two sizes, both reused


def test_an_answer_is_cut_off_only_once_it_can_no_longer_be_the_same():
    assert not parted("The Eiff", "The Eiffel Tower.")  # the last word may still grow
    assert not parted("the  Eiffel Tower", "The Eiffel Tower.")  # case, articles and punctuation do not count
    assert not parted("In 18", "In 1863.")
    assert parted("In 1864 it", "In 1863.")  # a finished word differs
    assert parted("Paris is", "Paris.")  # longer than the reference
    assert parted("In 1864", "In 1863.")  # a last word that cannot grow into the reference's
    assert not parted("Paris th", "Paris.")  # ... unless it may become an article


# -- the choice -----------------------------------------------------------------------------------
def test_a_model_that_fails_calibration_gets_full_attention_with_the_prefix_cache(runs):
    lm = tiny_lm(reads_context=True)
    rag = KVRag(lm, store="memory://", check=False)
    setting = rag.default_setting
    assert (setting.method, setting.source) == ("full", "calibrated") and "no reuse setting" in setting.why
    assert runs == [lm.fingerprint]
    chunks = tiny_prompts()[0].chunks
    first = rag.answer("Which word comes first?", chunks=chunks, max_new_tokens=4)
    again = rag.answer("Which word comes first?", chunks=chunks, max_new_tokens=4)
    assert first.stats.method == again.stats.method == "full"
    assert again.stats.prefix_hit_tokens > 0  # Full Attention with the exact prefix cache
    assert first.stats.default == "full (calibrated)" and first.stats.default_reason.startswith("no reuse setting")
    summary = first.stats.summary()
    assert "default=full" in summary and "no reuse setting" not in summary  # the long reason: where asked, not every answer
    result = store.read_result(lm.fingerprint, "cpu")
    search = result["ape_search"]  # APE's temperature and scale, searched first; its settings measured too where active
    ape = Ape(search["temperature"], search["scale"])
    assert result is not None and [r["setting"] for r in result["settings"]] == [
        calibrate._name(*s) for s in calibrate.candidate_settings(ape)]
    assert result["rule"]["by"] == "agreement"  # no gold here: Full answers none right, agreement with it rules


def test_a_model_that_passes_calibration_gets_the_approximate_method(runs, monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_MIN_SPEEDUP", 0.0)  # TTFT on a tiny model is noise: any speed qualifies
    lm = tiny_lm(reads_context=False)
    rag = KVRag(lm, store="memory://", check=False)
    setting = rag.default_setting
    assert setting.source == "calibrated" and setting.method in ("reuse", *calibrate.METHODS), setting
    result = store.read_result(lm.fingerprint, "cpu")
    row = next(r for r in result["settings"] if r["setting"] == setting.name)
    assert row["status"] == "passed" and row["same"] == row["asked"] == len(tiny_prompts())
    passed_at = {}  # each method's smallest passing ratio: its larger ratios are skipped, never run
    for r in result["settings"]:
        if r["status"] == "passed":
            passed_at.setdefault(r["method"], r["ratio"])
    assert passed_at and all(r["status"] == "skipped" for r in result["settings"] if r["ratio"] > passed_at.get(r["method"], 1.0))
    ans = rag.answer("Which word comes first?", chunks=tiny_prompts()[0].chunks, max_new_tokens=4, short_context=0)
    assert ans.stats.method == setting.method and ans.stats.default.startswith(setting.name + " (calibrated")


def test_a_named_method_wins_and_never_calibrates(runs, monkeypatch):
    monkeypatch.setattr(calibrate, "run_calibration", lambda *a, **k: pytest.fail("calibrated for a named method"))
    rag = KVRag(tiny_lm(reads_context=True), store="memory://", check=False)
    ans = rag.answer("Which word comes first?", chunks=tiny_prompts()[0].chunks, method="reuse", max_new_tokens=4, short_context=0)
    assert ans.stats.method == "reuse" and ans.stats.default == ""


def test_calibration_off_keeps_the_fixed_default(runs, monkeypatch):
    lm = tiny_lm(reads_context=True)
    assert KVRag(lm, store="memory://", check=False, calibrate=False).default_setting == FIXED_DEFAULT
    monkeypatch.setenv("KVRAG_CALIBRATE", "0")
    assert KVRag(lm, store="memory://", check=False).default_setting == FIXED_DEFAULT
    assert runs == []


def test_a_kept_calibration_is_reused_by_another_process(runs, tmp_path):
    lm = tiny_lm(reads_context=True)
    chosen = KVRag(lm, store="memory://", check=False).default_setting
    assert len(runs) == 1
    script = (
        "import sys, json; sys.path.insert(0, %r)\n"
        "import torch, kvrag.check.calibrate as c\n"
        "c.run_calibration = lambda *a, **k: sys.exit('calibrated again')\n"
        "from test_calibrate import tiny_lm\n"
        "from kvrag import KVRag\n"
        "print(json.dumps(KVRag(tiny_lm(True), store='memory://', check=False).default_setting.as_dict()))\n"
    ) % str(TESTS)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env={**os.environ})
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == chosen.as_dict()


def _fabricated(method: str = "a3", ratio: float = 0.3) -> dict:
    """A result whose choice is among the rows that passed (a choice that is not is refused: trust tests)."""
    row = {"setting": calibrate._name(method, ratio), "method": method, "ratio": ratio, "status": "passed"}
    return {"chosen": {"method": method, "ratio": ratio, "why": "made up"}, "settings": [{"setting": "reuse"}, row]}


@pytest.mark.parametrize("damage", ["truncated", "edited", "old version", "unknown method", "not json"])
def test_a_damaged_calibration_is_run_again_never_trusted(runs, monkeypatch, damage):
    lm = tiny_lm(reads_context=True)
    made = []
    monkeypatch.setattr(calibrate, "run_calibration", lambda lm, **k: made.append(1) or _fabricated())
    assert default_for(lm).name == "a3@0.3" and len(made) == 1
    path = store.calibration_path(lm.fingerprint)
    data = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif damage == "edited":  # a changed choice without its checksum
        data["devices"]["cpu"]["result"]["chosen"]["method"] = "reuse"
        path.write_text(json.dumps(data))
    elif damage == "old version":
        data["versions"]["calibration"] = "0"
        path.write_text(json.dumps(data))
    elif damage == "unknown method":  # even with a matching checksum
        result = data["devices"]["cpu"]["result"]
        result["chosen"]["method"] = "kvlink"
        data["devices"]["cpu"]["sha256"] = store._checksum(result)
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(b"\x00\xff not json")
    forget_in_process()  # as a new process would start
    assert store.read_result(lm.fingerprint, "cpu") is None
    assert default_for(lm).name == "a3@0.3" and len(made) == 2  # measured again
    assert store.read_result(lm.fingerprint, "cpu") is not None  # and kept whole


# -- what says it -----------------------------------------------------------------------------------
def test_the_calibrated_ratio_applies_only_where_no_other_is_named():
    chosen = DefaultSetting("a3", 0.3, "calibrated", "why")
    opts = AnswerOptions().with_default_method(chosen)
    assert (opts.method, opts.recompute_ratio, opts.default_note, opts.default_reason) == ("a3", 0.3, "a3@0.3 (calibrated)", "why")
    assert AnswerOptions(recompute_ratio=0.5).with_default_method(chosen).recompute_ratio == 0.5
    named = AnswerOptions(method="epic").with_default_method(chosen)
    assert (named.method, named.recompute_ratio, named.default_note) == ("epic", DEFAULT_RATIO, "")
    assert AnswerOptions.from_kwargs(opts, method="reuse").default_note == ""  # a method named later is the caller's


def test_the_server_says_and_uses_the_calibrated_default(runs, monkeypatch):
    from fastapi.testclient import TestClient

    from kvrag.server.app import create_app
    from kvrag.server.schemas import ChatRequest, answer_options
    from kvrag.server.settings import ServerSettings

    req = ChatRequest(model="kvrag", messages=[{"role": "user", "content": "q"}], kvrag={"chunk_ids": ["a"]})
    opts = answer_options(req, ServerSettings(), DefaultSetting("cacheblend", 0.3, "calibrated", "why"))
    assert (opts.method, opts.recompute_ratio) == ("cacheblend", 0.3)
    assert answer_options(req, ServerSettings(method="epic"), DefaultSetting("cacheblend", 0.3)).recompute_ratio == DEFAULT_RATIO
    monkeypatch.setattr(calibrate, "run_calibration", lambda lm, **k: _fabricated("epic", 0.5))
    rag = KVRag(tiny_lm(reads_context=True), store="memory://", check=False)
    with TestClient(create_app(rag)) as client:
        assert client.get("/health").json()["default"] == {"state": "calibrating"}  # /health never runs it
        rag.default_setting
        health = client.get("/health").json()["default"]
    assert (health["state"], health["name"], health["source"], health["why"]) == ("ok", "epic@0.5", "calibrated", "made up")


def test_kvrag_methods_names_the_kept_choice(runs, monkeypatch, capsys):
    from kvrag.cli import main
    from kvrag.check.default import calibrate_model

    monkeypatch.setattr(calibrate, "run_calibration", lambda lm, **k: _fabricated("fusionrag", 0.5))
    lm = tiny_lm(reads_context=True)
    lm.source = "tiny-llama-for-methods"
    assert main(["methods", "--model", "tiny-llama-for-methods"]) == 0
    assert "tiny-llama-for-methods: not calibrated yet" in capsys.readouterr().out
    calibrate_model(lm)
    assert main(["methods", "--model", "tiny-llama-for-methods"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama-for-methods on cpu: fusionrag@0.5 (calibrated: made up)" in out
    marked = [line for line in out.splitlines() if "<- the default now" in line]  # the calibrated choice is marked
    assert len(marked) == 1 and marked[0].startswith("fusionrag ") and "fusionrag@0.5 on cpu" in marked[0]


def test_check_model_calibrate_prints_every_setting_and_keeps_the_choice(runs, monkeypatch, tmp_path, capsys):
    import argparse

    from kvrag.cli.check import add_check_model_parser

    monkeypatch.setattr(calibrate, "CALIBRATION_MIN_SPEEDUP", 0.0)
    folder = tmp_path / "tiny"
    tiny_model("llama", seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    parser = argparse.ArgumentParser(prog="kvrag")
    add_check_model_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["check-model", str(folder), "--device", "cpu", "--calibrate"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "calibration on cpu (float32): 4 questions" in out
    assert all(name in out for name in ("reuse", "fusionrag@0.15", "a3@0.5")) and "\ndefault: " in out
    assert len(runs) == 1 and len(list(store.calibration_dir().glob("*.json"))) == 2  # the result, and sources.json


def test_the_judge_pairs_the_default_with_full_and_says_whether_it_keeps_up(tmp_path, monkeypatch):
    """`kvrag eval calibration` on two rows: records paired per question, the table and its verdict."""
    from kvrag.eval.calibration_eval import answer_pairs, calibration_markdown, collect
    from kvrag.eval.data import example_from_row
    from tiny import qa_rows

    monkeypatch.setattr("kvrag.eval.calibration_eval.SETS", {"qa": type("S", (), {"kind": "tiny rows"})()})
    rag = KVRag(tiny_lm(reads_context=False), store="memory://", check=False, calibrate=False)
    examples = [example_from_row(r) for r in qa_rows(n=2)]
    answer_pairs(rag, examples, tmp_path / "qa" / "len4", 4, progress=False)
    answer_pairs(rag, examples, tmp_path / "qa" / "len4", 4, progress=False)  # resumed: nothing answered twice
    records = [json.loads(line) for line in (tmp_path / "qa" / "len4" / "records.jsonl").read_text().splitlines()]
    assert [r["setting"] for r in records] == ["full", "default"] * 2
    assert {r["answered_with"] for r in records if r["setting"] == "default"} == {FIXED_DEFAULT.method}
    result = collect(tmp_path, ["qa"], [4])
    block = result["blocks"][0]
    assert block["n"] == 2 and block["keeps_up"] == (block["default_contains"] >= block["full_contains"] - 1 / 30 - 1e-9)
    md = calibration_markdown(result, {"command": "kvrag eval calibration", "model": "tiny"})
    assert "| qa | 4 | 2 |" in md and f"Default chosen: {FIXED_DEFAULT.label()}: {FIXED_DEFAULT.why}" in md


@pytest.mark.parametrize("bad", [dict(chunk_ids=[]), dict(chunk_ids=["no-such-id"]), dict(chunk_ids=["a"], recompute_ratio=7)])
def test_bad_input_fails_at_once_never_after_a_calibration(runs, monkeypatch, bad):
    """A first request that names no method calibrates the model, but only once its input is checked."""
    monkeypatch.setattr(calibrate, "run_calibration", lambda *a, **k: pytest.fail("calibrated before checking the input"))
    rag = KVRag(tiny_lm(reads_context=True), store="memory://", check=False)
    with pytest.raises((KVRagError, ValueError)):
        rag.answer("Which word comes first?", **bad)
    assert runs == []


# -- kvlink with the engine's link adapter ------------------------------------------------------------
def _links(lm, seed=0):
    from kvrag.kv.layout import make_layout
    from kvlink_helpers import random_adapter

    return random_adapter(lm, k=1, max_chunks=4, seed=seed, layout_identity=make_layout(lm.tokenizer, None).identity)


def test_kvlink_with_the_engines_adapter_is_measured_last_and_names_its_adapter(runs, monkeypatch):
    monkeypatch.setattr(calibrate, "CALIBRATION_MIN_SPEEDUP", 0.0)
    lm = tiny_lm(reads_context=False)
    adapter = _links(lm)
    rag = KVRag(lm, store="memory://", check=False, link_adapter=adapter)
    assert rag.calibration_adapter is adapter
    setting = rag.default_setting
    result = store.read_result(lm.fingerprint, "cpu")
    methods = [r["method"] for r in result["settings"]]
    assert "kvlink" in methods and methods[methods.index("kvlink"):] == ["kvlink"] * methods.count("kvlink")  # last
    assert result["adapter"]["digest"] == adapter.digest() and result["adapter"]["mode"] == "links"
    fallback = store.setting_of(result, "")
    assert fallback.method != "kvlink"  # the best without the adapter, measured beside it
    assert setting == store.setting_of(result, adapter.digest())
    # an engine without this adapter never gets kvlink from this result, and does not calibrate again
    assert KVRag(lm, store="memory://", check=False, link_adapter=None).default_setting == fallback
    assert KVRag(lm, store="memory://", check=False, link_adapter=_links(lm, seed=1)).default_setting == fallback
    assert len(runs) == 1


def test_a_result_that_chose_kvlink_serves_it_only_with_that_adapter(runs):
    lm = tiny_lm(reads_context=True)
    adapter = _links(lm)
    result = _fabricated("kvlink", 0.0)
    result["settings"].append({"setting": "fusionrag@0.15", "method": "fusionrag", "ratio": 0.15, "status": "passed"})
    result["fallback"] = {"method": "fusionrag", "ratio": 0.15, "why": "made up too"}
    result["adapter"] = {"digest": adapter.digest(), "mode": "links"}
    store.write_result(lm.fingerprint, "cpu", result)
    forget_in_process()
    assert KVRag(lm, store="memory://", check=False, link_adapter=adapter).default_setting.method == "kvlink"
    assert KVRag(lm, store="memory://", check=False, link_adapter=None).default_setting.name == "fusionrag@0.15"
    assert runs == []
    for broken in ({"adapter": None}, {"fallback": {"method": "kvlink", "ratio": 0.0, "why": "x"}},
                   {"fallback": {"method": "epic", "ratio": 0.5, "why": "never measured"}}):
        store.write_result(lm.fingerprint, "cpu", {**result, **broken})
        assert store.read_result(lm.fingerprint, "cpu") is None, broken  # refused: measured again


def test_kvlink_is_a_candidate_only_with_an_adapter_and_never_with_ape():
    ape = Ape(0.9, 1.0)
    assert all(m != "kvlink" for m, _, _ in calibrate.candidate_settings(ape))
    with_adapter = calibrate.candidate_settings(ape, adapter=True)
    assert with_adapter[-1] == ("kvlink", 0.0, None) and [m for m, _, _ in with_adapter].count("kvlink") == 1
    assert with_adapter[:-1] == calibrate.candidate_settings(ape)
