"""KVLink training on tiny random models: data, the loss going down, padding, checkpoints and resume, the command."""

import argparse
import copy
import json
import random

import pytest
import torch


from kvrag import KVRag
from kvrag.fuse.links import default_link_embeds
from kvrag.link_adapter import load_adapter, read_adapter_header
from kvrag.model.rope import Rotary
from kvrag.train import (
    TrainConfig,
    add_train_links_parser,
    build_example,
    example_loss,
    load_rows,
    main,
    prepare_model,
    train,
)
from tiny import tiny_model, tiny_tokenizer
from kvlink_helpers import CHUNKS, IDS, Q, make_rag, rows


def test_min_chunks_varies_the_passage_count_and_keeps_the_gold_one():
    """`min_chunks` makes examples of 1..max passages, the gold one always among them; unset, an
    example is what it was before the option (same passages, same order: no extra draw)."""
    rag = make_rag()
    counts = set()
    for i, r in enumerate(rows(6)):
        for seed in range(12):
            ex = build_example(rag.layout, r, random.Random(f"{seed}:{i}"), 2, 4, 4096, min_chunks=1)
            counts.add(len(ex.chunks))
            gold_text = r["ctxs"][r["gold_index"]]["text"]
            assert ex.gold is not None and ex.chunks[ex.gold].text == gold_text
            assert len(ex.segments.chunks) == len(ex.chunks)
        before = build_example(rag.layout, r, random.Random(i), 2, 4, 4096)
        assert [c.text for c in before.chunks] == [c.text for c in build_example(rag.layout, r, random.Random(i), 2, 4, 4096, None).chunks]
        assert len(before.chunks) == 4
    assert counts == {1, 2, 3, 4}
    assert "min_chunks" not in TrainConfig(out="x").resume_key()  # runs from before the option resume
    assert TrainConfig(out="x", min_chunks=2).resume_key()["min_chunks"] == 2
    with pytest.raises(ValueError, match="min_chunks"):
        TrainConfig(out="x", max_chunks=4, min_chunks=5)


@pytest.mark.parametrize("mode", ["links", "lora", "full"])
def test_a_few_training_steps_lower_the_loss_on_a_fixed_batch(mode):
    if mode == "lora":
        pytest.importorskip("peft")
    rag = make_rag()
    cfg = TrainConfig(out="unused", mode=mode, link_tokens=2, max_chunks=4, lr=3e-3 if mode == "lora" else 5e-4, link_lr=5e-2)
    examples = [build_example(rag.layout, r, random.Random(i), 2, 4, 4096) for i, r in enumerate(rows(2))]
    model = rag.lm.model if mode == "links" else copy.deepcopy(rag.lm.model)
    model, named = prepare_model(model, cfg)
    links = torch.nn.Parameter(default_link_embeds(model, 2, 4))
    opt = torch.optim.AdamW([{"params": [links], "lr": cfg.link_lr}] + ([{"params": [p for _, p in named], "lr": cfg.lr}] if named else []))
    rotary = Rotary(model.get_base_model() if hasattr(model, "get_base_model") else model)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = example_loss(model, examples, links, 4, rag=rag if mode == "links" else None, rotary=rotary)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses
    # a random tiny model barely listens to a handful of link tokens: links alone move its loss a little
    assert losses[-1] < losses[0] - (5e-3 if mode == "links" else 0.05), losses
    if mode == "links":
        assert all(not p.requires_grad for p in rag.lm.model.parameters())
    else:
        assert named and all(p.grad is not None for _, p in named)


def test_a_padded_batch_gives_each_example_its_own_loss():
    rag = make_rag("qwen3")
    examples = [build_example(rag.layout, r, random.Random(i), 2, 4, 4096) for i, r in enumerate(rows(3))]
    assert len({e.segments.total_len for e in examples}) > 1
    links = default_link_embeds(rag.lm.model, 2, 4) + 0.1 * torch.randn(4, 2, 64)
    with torch.no_grad():
        for kw in ({"rag": rag}, {"rotary": rag.rotary}):
            batched = example_loss(rag.lm.model, examples, links, 4, **kw)
            one_by_one = [example_loss(rag.lm.model, [e], links, 4, **kw) for e in examples]
            weights = torch.tensor([len(e.answer) for e in examples], dtype=torch.float32)
            expected = (torch.stack(one_by_one) * weights).sum() / weights.sum()  # the mean over answer tokens
            assert (batched - expected).abs().item() <= 1e-5


def test_training_run_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    import kvrag.training.loop as train_mod

    rag = make_rag()
    data = rows(6)
    base = dict(mode="links", link_tokens=2, max_chunks=4, batch_size=2, grad_accum=2, max_steps=4, save_every=2, progress=False, store="memory://", warmup=1)
    straight = train(TrainConfig(out=str(tmp_path / "a"), **base), lm=rag.lm, rows=data)
    assert straight.steps == 4 and len(straight.losses) == 4
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0
    assert (tmp_path / "a" / "checkpoint" / "optimizer.safetensors").exists()
    header = read_adapter_header(straight.adapter_path)
    assert header["mode"] == "links" and header["link_tokens"] == 2 and header["training"]["steps"] == 4
    assert header["data"] and header["base_fingerprint"] == rag.lm.fingerprint
    # interrupted during step 3 (after the step-2 checkpoint), then resumed: the same adapter, bit for bit
    real, calls = train_mod.example_loss, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2 * 2 + 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "example_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "b"), **base), lm=rag.lm, rows=data)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(train_mod, "example_loss", real)
    resumed = train(TrainConfig(out=str(tmp_path / "b"), resume=True, **base), lm=rag.lm, rows=data)
    assert resumed.losses == straight.losses
    assert torch.equal(resumed.adapter.embeds, straight.adapter.embeds)
    with pytest.raises(ValueError, match="other settings"):
        train(TrainConfig(out=str(tmp_path / "b"), resume=True, **{**base, "seed": 1}), lm=rag.lm, rows=data)
    # the trained adapter is what kvlink uses
    tuned = KVRag(rag.lm, store=rag.store, link_adapter=straight.adapter_path, check=False)
    assert tuned.prefill(Q, IDS, method="kvlink").segments.links == 2


def test_lora_training_run_writes_a_loadable_adapter(tmp_path):
    pytest.importorskip("peft")
    rag = make_rag()
    res = train(
        TrainConfig(out=str(tmp_path), mode="lora", link_tokens=1, max_chunks=4, max_steps=2, grad_accum=1, lora_r=2, progress=False),
        lm=rag.lm,
        rows=rows(2),
    )
    adapter = load_adapter(res.adapter_path, rag.lm, rag.layout.identity)
    assert adapter.mode == "lora" and adapter.lora and adapter.meta["lora"]["r"] == 2
    tuned = KVRag(rag.lm, store="memory://", link_adapter=res.adapter_path, check=False)
    assert tuned.adapter_lm.fingerprint != rag.lm.fingerprint and tuned.lm is rag.lm
    assert tuned.answer(Q, chunks=CHUNKS, method="kvlink", max_new_tokens=2).stats.generated_tokens > 0


def test_data_rows_shuffle_the_gold_passage_and_keep_provenance(tmp_path):
    rag = make_rag()
    row = rows(1)[0]
    gold_text = row["ctxs"][row["gold_index"]]["text"]
    golds = set()
    for seed in range(12):
        ex = build_example(rag.layout, row, random.Random(seed), 1, 10, 4096)
        assert ex.chunks[ex.gold].text == gold_text
        assert ex.segments.links == 1 and len(ex.segments.chunks) == 4
        golds.add(ex.gold)
    assert len(golds) >= 3  # the gold passage moves around
    capped = build_example(rag.layout, row, random.Random(0), 1, 2, 4096)
    assert len(capped.chunks) == 2 and capped.chunks[capped.gold].text == gold_text
    path = tmp_path / "nq10_dev.jsonl"
    path.write_text("".join(json.dumps({**r, "id": str(i)}) + "\n" for i, r in enumerate(rows(1) * 1300)))
    picked, prov = load_rows([str(path)], "0:1200")
    assert len(picked) == 1200 and prov[0]["rows"] == "0:1200" and len(prov[0]["sha256"]) == 64 and prov[0]["sources"] == ["synthetic"]
    with pytest.raises(ValueError, match="evaluation split"):
        load_rows([str(path)], "1100:1300")
    with pytest.raises(ValueError, match="evaluation split"):
        load_rows([f"{path}@1200:"], "0:1200")


def test_train_links_command(tmp_path):
    pytest.importorskip("peft")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_train_links_parser(sub)
    args = parser.parse_args(["train-links", "--data", str(data), "--out", str(tmp_path / "run"), "--mode", "lora"])
    assert args.mode == "lora" and args.link_tokens == 5 and args.func.__name__ == "cmd_train_links"
    rc = main(
        ["--data", f"{data}@0:4", "--out", str(tmp_path / "run"), "--model", str(tmp_path / "model"), "--link-tokens", "1",
         "--max-chunks", "4", "--max-steps", "2", "--grad-accum", "1", "--store", "memory://", "--no-progress", "--device", "cpu"]
    )
    assert rc == 0
    header = read_adapter_header(tmp_path / "run" / "adapter.safetensors")
    assert header["data"][0]["rows"] == "0:4" and header["training"]["steps"] == 2
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "train_summary.json").exists()


def test_fitted_schedule_ends_inside_the_time_left_and_never_grows():
    from kvrag.training.loop import FIT_MARGIN_S, fitted_total

    # 10 s a step, 5 minutes left: 27 more steps fit once the margin for the last save is kept back
    assert fitted_total(4, 100, 10.0, 300.0) == 4 + int((300 - FIT_MARGIN_S) / 10)
    assert fitted_total(4, 20, 10.0, 3000.0) == 20  # never longer than planned
    assert fitted_total(4, 100, 10.0, 5.0) == 5  # out of time: one more step, then the schedule's end


def test_fit_schedule_shortens_a_run_to_its_budget(tmp_path, monkeypatch):
    import kvrag.training.loop as train_mod

    rag = make_rag()
    base = dict(mode="links", link_tokens=1, max_chunks=4, batch_size=1, grad_accum=1, max_steps=40, progress=False,
                store="memory://", warmup=1, save_every=0)
    seen, real = {}, train_mod.fitted_total

    def fit(step, total, per_step, left):  # the real formula on a fixed clock: 10 s a step, a minute left
        seen.update(step=step, total=total)
        return real(step, total, 10.0, 60.0)

    monkeypatch.setattr(train_mod, "fitted_total", fit)
    res = train(TrainConfig(out=str(tmp_path), max_minutes=5, fit_schedule=True, **base), lm=rag.lm, rows=rows(6))
    assert seen == {"step": train_mod.FIT_AFTER_STEPS, "total": 40}
    assert res.steps == train_mod.FIT_AFTER_STEPS + 3 and not res.stopped_early  # (60 - 30) / 10 more steps
    header = read_adapter_header(res.adapter_path)["training"]
    assert header["total_steps"] == res.steps and header["examples_seen"] == res.steps
