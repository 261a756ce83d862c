"""Objective distill: the teacher (base weights, Full Attention) and the student (reused KV) on tiny random models."""

import argparse
import copy
import json
import math
import random

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.decode.stream import eos_ids
from kvrag.link_adapter import read_adapter_header
from kvrag.model.rope import Rotary
from kvrag.cli.train import add_train_links_parser
from kvrag.training.config import DISTILL_KEYS, TrainConfig
from kvrag.training.data import CONTINUE_INSTRUCTION, example_kind
from kvrag.training.distill import Teacher, compress, distill_example, distill_loss, kl_to_teacher, teacher_prompt_ids
from kvrag.training.loop import train
from kvrag.training.passes import batch_context, batch_logits, pass_batch
from kvrag.training.trainables import prepare_model
from tiny import qa_rows, tiny_model, tiny_tokenizer

peft = pytest.importorskip("peft")


def peaked_model(seed=0):
    """A tiny random llama whose output distributions are peaked (a random tiny model's are nearly
    uniform, where every KL is small): the lm head scaled up."""
    model = tiny_model("llama", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


def make_rag(model=None):
    return KVRag(from_model(model if model is not None else peaked_model(), tiny_tokenizer()), store="memory://", check=False)


def distill_cfg(**kw):
    base = dict(out="unused", mode="lora", link_tokens=2, max_chunks=4, lora_r=4, objective="distill", teacher_tokens=6)
    return TrainConfig(**{**base, **kw})


def student_kl(model, teacher, examples, k, max_chunks, links=None):
    """KL(teacher || student) at every continuation position, the student reading the reused KV (lora mode)."""
    examples, targets = teacher.attach(examples)
    rotary = Rotary(model.get_base_model() if hasattr(model, "get_base_model") else model)
    links = links if links is not None else torch.zeros(max_chunks, k, model.config.hidden_size)
    with torch.no_grad():
        ctx = batch_context(model, examples, None, rotary)
        logits = batch_logits(model, ctx, pass_batch(examples, ctx, max_chunks, torch.float32), links)
    return kl_to_teacher(logits, targets)


# -- the teacher ------------------------------------------------------------------------------------
@pytest.mark.parametrize("share", [0.0, 1.0])
def test_the_teacher_reads_what_full_attention_reads_with_the_base_weights(share):
    """The teacher's prompt is the one `method="full"` reads for the same chunks and question (no
    link slots, though the student has K = 2), and its first log-probs are Full Attention's, from the
    base weights even with a trained (non-zero) LoRA in the model it is given."""
    rag = make_rag()
    cfg = distill_cfg(continue_share=share)
    model, named = prepare_model(copy.deepcopy(rag.lm.model), cfg)
    with torch.no_grad():
        for n, p in named:
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    teacher = Teacher(model, eos_ids(rag.lm), cfg.teacher_tokens)
    for i, row in enumerate(qa_rows(3)):
        ex = distill_example(rag.layout, row, cfg, 0, i)
        assert ex.kind == ("continue" if share else "qa") and ex.answer == [] and ex.segments.links == 2
        question = CONTINUE_INSTRUCTION if ex.kind == "continue" else row["question"]
        pre = rag.prefill(question, chunks=ex.chunks, method="full")
        ids = teacher_prompt_ids(ex)
        assert pre.segments.links == 0 and pre.segments.all_ids() == ids
        assert len(ids) == ex.segments.total_len - 2 * len(ex.chunks)
        target = teacher.targets(ex)
        assert 1 <= len(target.tokens) <= cfg.teacher_tokens and target.logp.shape[0] == len(target.tokens)
        assert (torch.log_softmax(pre.logits.float(), -1) - target.logp[0]).abs().max().item() <= 1e-4
        assert target.tokens[0] == int(pre.logits.argmax())
    assert teacher.generated == 3
    teacher.targets(ex)  # computed once per example
    assert teacher.generated == 3


def test_top_k_targets_keep_the_rest_of_the_mass():
    logp = torch.log_softmax(torch.randn(3, 50), -1)
    kept, index = compress(logp, 5)
    assert kept.shape == (3, 6) and index.shape == (3, 5)
    assert torch.allclose(kept.exp().sum(-1), torch.ones(3), atol=1e-6)
    whole, none = compress(logp, 0)
    assert none is None and whole is logp


# -- the plumbing: one chunk after the prefix is exact ------------------------------------------------
@pytest.mark.parametrize("topk", [0, 8])
def test_identity_lora_and_no_links_over_one_chunk_imitate_the_teacher_exactly(topk):
    """Step 0 (peft's B = 0), K = 0 and one chunk: the chunk's KV computed after the prefix alone is
    what Full Attention computes, so the student's distribution is the teacher's at every position."""
    rag = make_rag()
    cfg = distill_cfg(link_tokens=0, max_chunks=1, continue_share=0.0, teacher_topk=topk, teacher_tokens=8)
    model, _ = prepare_model(copy.deepcopy(rag.lm.model), cfg)
    teacher = Teacher(model, eos_ids(rag.lm), cfg.teacher_tokens, cfg.teacher_topk)
    examples = [distill_example(rag.layout, r, cfg, 0, i) for i, r in enumerate(qa_rows(2))]
    assert all(len(e.chunks) == 1 for e in examples)
    kl = student_kl(model, teacher, examples, 0, 1)
    assert kl.numel() == sum(len(teacher.targets(e).tokens) for e in examples) > 2
    assert kl.abs().max().item() <= 1e-4, kl
    # not a vacuous check: three chunks (reused without each other), or two untrained link tokens, move the student
    three = distill_cfg(link_tokens=0, max_chunks=3, continue_share=0.0, teacher_topk=topk)
    many = [distill_example(rag.layout, r, three, 0, i) for i, r in enumerate(qa_rows(2))]
    assert student_kl(model, teacher, many, 0, 3).max().item() > 1e-3
    two = distill_cfg(link_tokens=2, max_chunks=1, continue_share=0.0, teacher_topk=topk)
    linked = [distill_example(rag.layout, r, two, 0, i) for i, r in enumerate(qa_rows(2))]
    rows = torch.randn(1, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert student_kl(model, teacher, linked, 2, 1, links=rows).max().item() > 1e-3


def test_a_few_distill_steps_bring_the_student_closer_to_the_teacher():
    rag = make_rag()
    cfg = distill_cfg(continue_share=0.5, lr=1e-4)  # the peaked tiny model is sharp: small steps
    model, named = prepare_model(copy.deepcopy(rag.lm.model), cfg)
    links = torch.nn.Parameter(torch.randn(4, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0)))
    opt = torch.optim.AdamW([{"params": [links], "lr": 3e-3}, {"params": [p for _, p in named], "lr": cfg.lr}])
    teacher = Teacher(model, eos_ids(rag.lm), cfg.teacher_tokens)
    examples = [distill_example(rag.layout, r, cfg, 0, i) for i, r in enumerate(qa_rows(2))]
    rotary = Rotary(model.get_base_model())
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = distill_loss(model, teacher, examples, links, 4, rotary=rotary)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert teacher.generated == 2  # the teacher ran once per example, with the LoRA off however it moved
    assert losses[-1] < 0.5 * losses[0], losses


# -- the data mix ------------------------------------------------------------------------------------
def test_continue_examples_come_at_their_share_and_are_a_pure_function_of_the_seed():
    kinds = [example_kind(0, e, i, 0.3) for e in range(2) for i in range(1000)]
    assert abs(kinds.count("continue") / len(kinds) - 0.3) < 0.03
    assert kinds == [example_kind(0, e, i, 0.3) for e in range(2) for i in range(1000)]
    assert kinds != [example_kind(1, e, i, 0.3) for e in range(2) for i in range(1000)]
    assert {example_kind(0, 0, i, 0.0) for i in range(100)} == {"qa"}
    assert {example_kind(0, 0, i, 1.0) for i in range(100)} == {"continue"}
    assert example_kind(0, 0, 0, 0.0, {"question": "", "ctxs": []}) == "continue"  # no question: nothing to answer

    rag = make_rag()
    cfg = distill_cfg(continue_share=0.5, max_chunks=4)
    rows = qa_rows(8)
    seen = set()
    for e in range(3):
        for i, row in enumerate(rows):
            ex = distill_example(rag.layout, row, cfg, e, i)
            again = distill_example(rag.layout, row, cfg, e, i)
            assert ex.segments == again.segments and [c.text for c in ex.chunks] == [c.text for c in again.chunks]
            assert ex.kind == example_kind(cfg.seed, e, i, cfg.continue_share)
            seen.add(ex.kind)
            if ex.kind == "continue":  # the row's own text, no question, no gold
                assert ex.segments.question == rag.layout.question_ids(CONTINUE_INSTRUCTION) and ex.gold is None
                source = " ".join(f"{c['title']}\n{c['text']}" for c in row["ctxs"])
                assert ex.chunks and all(ch.text in source for ch in ex.chunks)
            else:
                assert ex.segments.question == rag.layout.question_ids(row["question"])
                assert ex.chunks[ex.gold].text == row["ctxs"][row["gold_index"]]["text"]
    assert seen == {"qa", "continue"}


# -- training ------------------------------------------------------------------------------------------
def test_gold_answers_never_reach_the_distill_loss():
    rag = make_rag()
    cfg = distill_cfg(continue_share=0.5, max_tokens=200)
    rows = qa_rows(6)
    other = [{**r, "answers": ["a far longer answer than before " * 20]} for r in rows]
    model, _ = prepare_model(copy.deepcopy(rag.lm.model), cfg)
    rotary = Rotary(model.get_base_model())
    links = torch.randn(4, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    losses = []
    for data in (rows, other):
        teacher = Teacher(model, eos_ids(rag.lm), cfg.teacher_tokens)
        examples = [distill_example(rag.layout, r, cfg, 0, i) for i, r in enumerate(data)]
        with torch.no_grad():
            losses.append(distill_loss(model, teacher, examples, links, 4, rotary=rotary).item())
    assert math.isfinite(losses[0]) and losses[0] > 0 and losses[0] == losses[1]


def test_a_distill_run_trains_saves_and_resumes_exactly(tmp_path, monkeypatch):
    import kvrag.training.loop as train_mod

    rag = make_rag()
    data = qa_rows(6)
    labels = []
    real_plot = train_mod.plot_losses
    monkeypatch.setattr(train_mod, "plot_losses", lambda *a, **kw: labels.append(kw.get("ylabel")) or real_plot(*a, **kw))
    base = dict(mode="lora", link_tokens=1, max_chunks=4, lora_r=2, batch_size=2, grad_accum=2, max_steps=4, save_every=2,
                progress=False, warmup=1, objective="distill", teacher_tokens=4, continue_share=0.5)
    straight = train(TrainConfig(out=str(tmp_path / "a"), **base), lm=rag.lm, rows=data)
    assert straight.steps == 4 and all(math.isfinite(x) and x >= 0 for x in straight.losses)
    print("distill losses", straight.losses)
    assert set(labels) == {"KL to base Full Attention"}
    header = read_adapter_header(straight.adapter_path)
    assert header["mode"] == "lora" and header["training"]["objective"] == "distill"
    assert header["training"]["teacher_tokens"] == 4 and header["training"]["continue_share"] == 0.5
    assert header["training"]["teacher_generated"] == 4 * 2 * 2  # one teacher continuation per example
    assert json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())["key"]["objective"] == "distill"

    # interrupted during step 3 (after the step-2 checkpoint), then resumed: the same losses and adapter;
    # this run keeps its teacher targets on disk and the resumed run reads them back
    real, calls = train_mod.distill_loss, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2 * 2 + 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "distill_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "b"), teacher_cache=True, **base), lm=rag.lm, rows=data)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 2
    cached = len(list((tmp_path / "b" / "teacher").glob("*.safetensors")))
    assert cached >= 2 * 2 * 2
    monkeypatch.setattr(train_mod, "distill_loss", real)
    resumed = train(TrainConfig(out=str(tmp_path / "b"), resume=True, teacher_cache=True, **base), lm=rag.lm, rows=data)
    assert resumed.losses == straight.losses
    assert resumed.adapter.lora.keys() == straight.adapter.lora.keys()
    assert all(torch.equal(resumed.adapter.lora[k], straight.adapter.lora[k]) for k in straight.adapter.lora)
    assert torch.equal(resumed.adapter.embeds, straight.adapter.embeds)
    with pytest.raises(ValueError, match="other settings"):
        train(TrainConfig(out=str(tmp_path / "b"), resume=True, **{**base, "continue_share": 0.25}), lm=rag.lm, rows=data)
    # the adapter serves kvlink
    tuned = KVRag(rag.lm, store="memory://", link_adapter=straight.adapter_path, check=False)
    assert tuned.answer(data[0]["question"], chunks=distill_example(rag.layout, data[0], TrainConfig(out="x", **base), 0, 0).chunks,
                        method="kvlink", max_new_tokens=2).stats.generated_tokens > 0


@pytest.mark.parametrize("mode", ["links", "full"])
def test_links_and_full_modes_distill_from_the_untouched_base_weights(tmp_path, mode):
    rag = make_rag()
    before = {n: p.detach().clone() for n, p in rag.lm.model.named_parameters()}
    res = train(TrainConfig(out=str(tmp_path), mode=mode, link_tokens=1, max_chunks=4, max_steps=2, grad_accum=1, store="memory://",
                            progress=False, objective="distill", teacher_tokens=3), lm=rag.lm, rows=qa_rows(2))
    assert all(math.isfinite(x) for x in res.losses) and res.adapter.mode == mode
    assert all(torch.equal(p, before[n]) for n, p in rag.lm.model.named_parameters())


def test_distill_settings_and_their_command_line(tmp_path, monkeypatch):
    gold = TrainConfig(out="x")
    assert gold.objective == "gold" and not set(DISTILL_KEYS) & set(gold.resume_key())  # gold runs resume unchanged
    key = TrainConfig(out="x", objective="distill").resume_key()
    assert {k: key[k] for k in DISTILL_KEYS} == {"objective": "distill", "teacher_tokens": 32, "teacher_topk": 0, "ce_weight": 0.0,
                                                  "continue_share": 0.5}
    for bad in ({"objective": "kl"}, {"teacher_tokens": 0}, {"continue_share": 1.5}, {"ce_weight": -1.0}, {"teacher_topk": -1}):
        with pytest.raises(ValueError):
            TrainConfig(out="x", **bad)

    rag = make_rag()
    res = train(TrainConfig(out=str(tmp_path), link_tokens=1, max_chunks=4, max_steps=1, grad_accum=1, store="memory://", progress=False),
                lm=rag.lm, rows=qa_rows(1))
    recorded = read_adapter_header(res.adapter_path)["training"]
    assert recorded["objective"] == "gold" and not {"teacher_tokens", "continue_share", "teacher_generated"} & set(recorded)

    import kvrag.cli.train as cli
    import kvrag.training.loop as loop

    seen = []
    monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or type("R", (), {"losses": [1.0], "adapter_path": "a", "steps": 1,
                                                                                   "seconds": 0.0, "stopped_early": False})())
    parser = argparse.ArgumentParser()
    add_train_links_parser(parser.add_subparsers())
    args = parser.parse_args(["train-links", "--data", "d.jsonl", "--out", "o", "--objective", "distill", "--teacher-tokens", "16",
                              "--teacher-topk", "50", "--continue-share", "0.25", "--ce-weight", "0.1", "--teacher-cache"])
    assert args.func(args) == 0
    cfg = seen[0]
    assert (cfg.objective, cfg.teacher_tokens, cfg.teacher_topk, cfg.continue_share, cfg.ce_weight, cfg.teacher_cache) == (
        "distill", 16, 50, 0.25, 0.1, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["links", "lora"])
def test_distill_runs_on_cuda(tmp_path, mode, dtype):
    lm = from_model(tiny_model("llama").to("cuda", dtype), tiny_tokenizer())
    cfg = TrainConfig(out=str(tmp_path), mode=mode, link_tokens=2, max_chunks=4, max_steps=2, grad_accum=2, lora_r=2, store="memory://",
                      progress=False, objective="distill", teacher_tokens=4, teacher_topk=16 if dtype == torch.bfloat16 else 0)
    res = train(cfg, lm=lm, rows=qa_rows(3))
    assert res.steps == 2 and all(math.isfinite(x) and x >= 0 for x in res.losses)
    tuned = KVRag(lm, store="memory://", check=False, link_adapter=res.adapter_path)
    ans = tuned.answer("What is answer 0?", chunks=distill_example(tuned.layout, qa_rows(1)[0], cfg, 0, 0).chunks, method="kvlink",
                       max_new_tokens=2)
    assert ans.stats.generated_tokens > 0 and tuned.lm.device.type == "cuda"


@pytest.mark.parametrize("topk", [0, 8])
def test_batched_teacher_gives_each_prompt_its_own_targets(topk):
    """The step's teacher runs its prompts together (left-padded): each prompt's continuation and
    log-probs are the ones it gets alone, an early end of turn included (one row stops, the rest go on)."""
    from kvrag.training.distill import generate_targets, generate_targets_many

    rag = make_rag()
    cfg = distill_cfg(min_chunks=1, teacher_tokens=6)
    prompts = [teacher_prompt_ids(distill_example(rag.layout, row, cfg, 0, i)) for i, row in enumerate(qa_rows(4))]
    assert len({len(p) for p in prompts}) > 1  # different lengths: padding is exercised
    model = rag.lm.model
    free = [generate_targets(model, p, 6, [], topk).tokens for p in prompts]
    b, j = next((b, j) for b, toks in enumerate(free) for j in range(1, 6) if toks[j] not in toks[:j])
    eos = [free[b][j]]  # a later token of prompt b ends its turn there
    alone = [generate_targets(model, p, 6, eos, topk) for p in prompts]
    together = generate_targets_many(model, prompts, 6, eos, topk, batched=True)
    assert len(alone[b].tokens) == j + 1 and any(len(a.tokens) > j + 1 for a in alone)
    for a, t in zip(alone, together):
        assert t.tokens == a.tokens and t.logp.shape == a.logp.shape
        torch.testing.assert_close(t.logp, a.logp, rtol=1e-4, atol=1e-4)
        if topk:
            assert torch.equal(t.index, a.index)


def test_a_step_generates_its_targets_once_and_together(monkeypatch):
    """One batched generation per optimizer step for all its micro-batches; the micro-batches then
    read them from memory, and a repeated example is generated once."""
    import kvrag.training.distill as distill_mod

    rag = make_rag()
    cfg = distill_cfg(min_chunks=1)
    teacher = Teacher(rag.lm.model, eos_ids(rag.lm), cfg.teacher_tokens)
    calls = []
    real = distill_mod.generate_targets_many
    monkeypatch.setattr(distill_mod, "generate_targets_many", lambda m, prompts, *a: calls.append(len(prompts)) or real(m, prompts, *a))
    examples = [distill_example(rag.layout, row, cfg, 0, i) for i, row in enumerate(qa_rows(3))]
    first = teacher.targets_many(examples + examples[:1])
    assert calls == [3] and teacher.generated == 3 and first[0] is first[3]
    _, again = teacher.attach(examples[1:])
    assert calls == [3] and again[0] is first[1]
