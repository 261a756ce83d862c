"""A distill run trained in pieces (issue #55): stopped by the mechanism --max-minutes uses, resumed
from its checkpoint, it trains the same steps as one run: the same data order, learning rates and
final weights; the teacher's targets, computed ahead once, are read back and never generated again."""

import json

import pytest
import torch

import kvrag.training.distill as distill_mod
import kvrag.training.loop as loop_mod
from kvrag import KVRag, from_model
from kvrag.training.ahead import precompute_teacher
from kvrag.training.config import TrainConfig
from kvrag.training.loop import train
from tiny import qa_rows, tiny_model, tiny_tokenizer

pytest.importorskip("peft")

STEPS = 4
PER_STEP = 2  # examples a step: batch_size x grad_accum
BASE = dict(mode="lora", link_tokens=1, max_chunks=4, lora_r=2, batch_size=1, grad_accum=2, max_steps=STEPS, save_every=0,
            progress=False, warmup=1, objective="distill", teacher_tokens=3, teacher_topk=8, continue_share=0.5, seed=3,
            system_prompt="Answer briefly.")  # short prompts: a fast test


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    monkeypatch.setattr(loop_mod, "plot_losses", lambda *a, **kw: None)  # matplotlib's drawing: seconds, and untested here


@pytest.fixture(scope="module")
def lm():
    model = tiny_model("llama", seed=0, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked outputs: KLs that move the weights
    return KVRag(from_model(model, tiny_tokenizer()), store="memory://", check=False).lm


class Recorder:
    """What each step of a run read (its (epoch, row) picks) and the learning rates it stepped with,
    and every teacher generation (prompts generated)."""

    def __init__(self, monkeypatch):
        self.rows, self.lrs, self.generated = [], [], []
        real_example, real_step, real_many = loop_mod.distill_example, torch.optim.AdamW.step, distill_mod.generate_targets_many

        def example(layout, row, cfg, epoch, index):
            self.rows.append((epoch, index))
            return real_example(layout, row, cfg, epoch, index)

        def step(opt, *a, **kw):
            self.lrs.append([g["lr"] for g in opt.param_groups])
            return real_step(opt, *a, **kw)

        def many(model, prompts, *a, **kw):
            self.generated.append(len(prompts))
            return real_many(model, prompts, *a, **kw)

        monkeypatch.setattr(loop_mod, "distill_example", example)
        monkeypatch.setattr(torch.optim.AdamW, "step", step)
        monkeypatch.setattr(distill_mod, "generate_targets_many", many)

    def take(self):
        out = (self.rows, self.lrs, sum(self.generated))
        self.rows, self.lrs, self.generated = [], [], []
        return out


def test_a_run_in_two_pieces_trains_the_steps_of_one_run(tmp_path, lm, monkeypatch):
    data = qa_rows(6)
    rec = Recorder(monkeypatch)
    whole = train(TrainConfig(out=str(tmp_path / "whole"), **BASE), lm=lm, rows=data)
    rows_whole, lrs_whole, generated_whole = rec.take()
    assert whole.steps == STEPS and not whole.stopped_early and generated_whole == STEPS * PER_STEP
    assert len(rows_whole) == STEPS * PER_STEP and len(set(rows_whole[:6])) == 6  # an epoch's shuffled order, then the next's

    # the teacher's targets of the whole schedule, once, ahead of the student (and again: nothing to do)
    cfg = dict(out=str(tmp_path / "pieces"), teacher_cache=True, **BASE)
    ahead = precompute_teacher(TrainConfig(teacher_only=True, teacher_batch=3, **cfg), lm=lm, rows=data)
    assert (ahead.from_step, ahead.to_step, ahead.generated) == (0, STEPS, STEPS * PER_STEP) and ahead.complete
    rec.take()
    assert precompute_teacher(TrainConfig(teacher_only=True, **cfg), lm=lm, rows=data).generated == 0
    cache = sorted((tmp_path / "pieces" / "teacher").glob("*.safetensors"))
    mtimes = {p: p.stat().st_mtime_ns for p in cache}
    assert len(cache) == STEPS * PER_STEP

    # piece 1 stops at step 2 (the check --max-minutes shares), piece 2 resumes to the end
    first = train(TrainConfig(stop_at=2, **cfg), lm=lm, rows=data)
    assert first.steps == 2 and first.stopped_early
    state = json.loads((tmp_path / "pieces" / "checkpoint" / "state.json").read_text())
    assert (state["step"], state["total"], state["next_micro_batch"]) == (2, STEPS, 2 * BASE["grad_accum"])
    second = train(TrainConfig(resume=True, **cfg), lm=lm, rows=data)
    rows_pieces, lrs_pieces, generated_pieces = rec.take()
    assert second.steps == STEPS and not second.stopped_early

    assert rows_pieces == rows_whole  # the same data order, step for step
    assert lrs_pieces == lrs_whole  # the same warm-up/cosine schedule
    assert second.losses == pytest.approx(whole.losses, rel=1e-5, abs=1e-7)
    assert torch.allclose(second.adapter.embeds, whole.adapter.embeds, atol=1e-6)
    assert second.adapter.lora.keys() == whole.adapter.lora.keys()
    for k in whole.adapter.lora:
        assert torch.allclose(second.adapter.lora[k], whole.adapter.lora[k], atol=1e-6), k
    # the targets were read back: no teacher generation in either piece, the files untouched
    assert generated_pieces == 0
    assert {p: p.stat().st_mtime_ns for p in cache} == mtimes
    summary = json.loads((tmp_path / "pieces" / "train_summary.json").read_text())
    assert summary["teacher_generated"] == 0 and summary["examples_seen"] == STEPS * PER_STEP


def test_max_minutes_ends_a_piece_that_resume_continues(tmp_path, lm, monkeypatch):
    """--max-minutes, on a clock that moves a minute a step: a piece of 2 steps, then the rest."""
    data = qa_rows(6)
    clock = {"t": 0.0}

    class Clock:
        @staticmethod
        def perf_counter():
            return clock["t"]

    real_step = torch.optim.AdamW.step

    def step(opt, *a, **kw):
        clock["t"] += 60.0
        return real_step(opt, *a, **kw)

    monkeypatch.setattr(loop_mod, "time", Clock)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = dict(out=str(tmp_path / "r"), **{**BASE, "teacher_topk": 0, "grad_accum": 1})
    first = train(TrainConfig(max_minutes=2, **cfg), lm=lm, rows=data)
    assert first.steps == 2 and first.stopped_early
    rest = train(TrainConfig(max_minutes=2, resume=True, **cfg), lm=lm, rows=data)
    assert rest.steps == STEPS and not rest.stopped_early and len(rest.losses) == STEPS


def test_a_fitted_schedule_keeps_its_length_across_pieces(tmp_path, lm, monkeypatch):
    """--fit-schedule's shortened schedule is saved with the checkpoint: the next piece's learning
    rates continue that curve, not the planned one."""
    data = qa_rows(6)
    monkeypatch.setattr(loop_mod, "FIT_AFTER_STEPS", 1)
    monkeypatch.setattr(loop_mod, "fitted_total", lambda step, total, per_step, left: 3)
    cfg = dict(out=str(tmp_path / "f"), **{**BASE, "max_steps": 8, "grad_accum": 1})
    first = train(TrainConfig(max_minutes=60, fit_schedule=True, stop_at=2, **cfg), lm=lm, rows=data)
    assert first.steps == 2
    assert json.loads((tmp_path / "f" / "checkpoint" / "state.json").read_text())["total"] == 3
    rest = train(TrainConfig(resume=True, **cfg), lm=lm, rows=data)
    assert rest.steps == 3  # not 8: the fitted schedule's end
