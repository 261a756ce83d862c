"""The benchmark harness: records, resume, the report and its plots, and `kvrag bench --quick` end to end."""

import json

import pytest

from kvrag import KVRag, from_model
from kvrag.cli.app import main
from kvrag.eval.data import Example, sample_examples
from kvrag.eval.report import load_records, markdown_table, summarize, write_report
from kvrag.eval.runner import Setting, make_settings, run
from kvrag.eval.speed import SweepOptions, corpus_chunks, load_share, parse_sizes, shape_config, shape_names, speed_markdown, speed_sweep
from kvrag.types import Chunk
from tiny import tiny_model, tiny_tokenizer

EXAMPLES = [
    Example(
        f"ex{i}",
        f"What does document {i} say?",
        [f"fact {i}"],
        [Chunk(f"c{i}-{j}", f"Document {i}.{j} states fact {i * 10 + j} about topic {j}.") for j in range(3)],
    )
    for i in range(3)
]


def tiny_rag():
    return KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://")


def test_run_writes_one_record_per_example_and_setting_and_resumes(tmp_path):
    settings = make_settings(["cacheblend", "fusionrag"], [0.15, 0.5])
    assert [s.name for s in settings] == ["full", "reuse", "cacheblend@0.15", "cacheblend@0.5", "fusionrag@0.15", "fusionrag@0.5"]
    rag = tiny_rag()
    path = run(rag, EXAMPLES[:2], settings, tmp_path, max_new_tokens=3, progress=False)
    assert len(load_records(path)) == 2 * len(settings)
    # An interrupted run (here: a third example added) picks up only what is missing.
    run(rag, EXAMPLES, settings, tmp_path, max_new_tokens=3, progress=False)
    records = load_records(path)
    assert len(records) == 3 * len(settings)
    assert len({(r["example"], r["setting"]) for r in records}) == len(records)


def test_summary_is_sane_and_the_report_has_tables_and_plot(tmp_path):
    rag = tiny_rag()
    path = run(rag, EXAMPLES, make_settings(["epic"], [0.3]), tmp_path, max_new_tokens=3, progress=False)
    rows = {r["setting"]: r for r in summarize(load_records(path))}
    assert rows["full"]["agree"] == 1.0 and rows["full"]["kl"] == 0.0 and rows["full"]["recomputed_share"] == 1.0
    assert rows["reuse"]["recomputed_share"] == 0.0 and rows["reuse"]["store_bytes_per_token"] > 0
    assert 0.25 <= rows["epic@0.3"]["recomputed_share"] <= 0.35
    lo, hi = rows["reuse"]["agree_ci"]
    assert 0.0 <= lo <= rows["reuse"]["agree"] <= hi <= 1.0
    summary, md = write_report(path, tmp_path, {"command": "kvrag bench test", "hardware": {"cpu": "x", "cores": 2}, "n": 3})
    text = md.read_text()
    assert "## Quality" in text and "## Speed and memory" in text and "epic@0.3" in text
    assert (tmp_path / "quality_vs_ratio.png").stat().st_size > 1000
    assert json.loads(summary.read_text())["rows"][0]["setting"] == "full"


def test_auto_ratio_and_gradual_settings_record_the_ratio_chosen(tmp_path):
    settings = make_settings(["cacheblend", "cacheblend:gradual=true"], [0.15, "auto"])
    names = [s.name for s in settings]
    assert names == ["full", "reuse", "cacheblend@0.15", "cacheblend@auto", "cacheblend@0.15[gradual=True]", "cacheblend@auto[gradual=True]"]
    own = make_settings(["cacheblend", "epic", "cacheblend:ratio=auto"], [0.15])
    assert [s.name for s in own] == ["full", "reuse", "cacheblend@0.15", "epic@0.15", "cacheblend@auto"]
    path = run(tiny_rag(), EXAMPLES[:2], settings[:4], tmp_path, max_new_tokens=3, progress=False)
    auto = [r for r in load_records(path) if r["setting"] == "cacheblend@auto"]
    assert len(auto) == 2 and all(0 < r["ratio"] <= 0.3 for r in auto)  # the share the engine chose, not "auto"
    rows = {r["setting"]: r for r in summarize(load_records(path))}
    assert 0 < rows["cacheblend@auto"]["recomputed_share"] <= 0.3


def test_speed_sweep_pairs_every_setting_with_full():
    rag = tiny_rag()
    rows = speed_sweep(rag, [64, 128], [Setting("reuse"), Setting("a3", 0.15)], SweepOptions(chunk_tokens=32, repeats=2, progress=False))
    assert [(r["setting"], r["chunks"]) for r in rows] == [(s, n) for n in (2, 4) for s in ("full", "reuse", "a3@0.15")]
    for r in rows:
        assert r["ttft_s"] > 0 and r["full_ratio"] > 0
        assert r["context_tokens"] >= r["chunks"] * 32
    assert {r["full_ratio"] for r in rows if r["setting"] == "full"} == {1.0}


def test_speed_sweep_times_layerwise_loading_both_ways_and_the_decode_rate():
    rag = tiny_rag()
    opts = SweepOptions(chunk_tokens=32, repeats=1, decode_tokens=6, layerwise="both", progress=False)
    rows = speed_sweep(rag, [64], [Setting("reuse"), Setting("cacheblend", 0.15)], opts)
    names = [r["setting"] for r in rows]
    assert names == ["full", "reuse [layer-wise]", "reuse [whole]", "cacheblend@0.15 [layer-wise]", "cacheblend@0.15 [whole]"]
    by = {r["setting"]: r for r in rows}
    assert by["reuse [layer-wise]"]["layerwise"] is True and by["reuse [whole]"]["layerwise"] is False
    assert by["full"]["layerwise"] is False  # Full Attention loads nothing
    assert rag.repo.layerwise is None  # the engine's own setting is back
    for r in rows:
        assert r["decode_tok_s"] > 0 and 1 <= r["decoded_tokens"] <= 6
        assert 0.0 <= load_share(r) <= 1.0
    md = speed_markdown(rows)
    assert "decode tok/s" in md and "reuse [whole]" in md
    with pytest.raises(ValueError, match="layerwise"):
        SweepOptions(layerwise="sometimes")


def test_speed_sweep_times_reuse_from_every_tier_of_the_stack(tmp_path):
    """Per-tier rows on the CUDA default stack's shape (memory | host | disk on the CPU): each row's KV
    comes from the tier it names (the tiers above emptied first), and the report says which."""
    from kvrag.eval.speed import write_speed
    from kvrag.eval.speed_tiers import TIERS, filesystem, parse_tiers, plan_tiers, tier_stack_url

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=tier_stack_url(tmp_path / "kv", "cpu"))
    assert rag.store.names == ["memory", "host", "disk"]
    reuse = Setting("reuse", params=(("short_context", 0),))  # 64 tokens: read whole by the shipped limit
    opts = SweepOptions(chunk_tokens=32, repeats=2, tiers=TIERS, progress=False)
    rows = speed_sweep(rag, [64], [reuse], opts)
    device = filesystem(tmp_path) not in ("tmpfs", "ramfs")  # on tmpfs there is no device to read from
    asked = ["hot", "warm", "cold"] + (["device"] if device else [])
    assert [r["setting"] for r in rows] == ["full"] + [f"{reuse.name}, {t}" for t in asked]
    by = {r["tier"]: r for r in rows}
    assert by[None]["served"] == {} and by[None]["kv_from"] == "– (computed)"
    expect = {"hot": "memory", "warm": "host", "cold": "disk", "device": "disk"}
    for tier in asked:
        r = by[tier]
        assert r["store"] == expect[tier] and r["served"] == {expect[tier]: 2}, r
        assert r["kv_from"].startswith(expect[tier]) and r["ttft_s"] > 0 and r["full_ratio"] > 0
    assert "cold, page cache warm" in by["cold"]["kv_from"]
    meta = {"store": rag.store.url, "tiers": plan_tiers(rag.store, TIERS).names, "tier_notes": []}
    md = write_speed(rows, tmp_path / "out", meta).read_text()
    assert "| KV from |" in md and "host (warm)" in md and "KV per tier (hot: memory" in md
    saved = json.loads((tmp_path / "out" / "speed.json").read_text())["rows"]
    assert [(r["tier"], r["store"]) for r in saved] == [(r["tier"], r["store"]) for r in rows]
    # a reuse setting that reads a short prompt whole loads nothing, and its row says so
    whole = Setting("reuse", params=(("short_context", 768),))  # the shipped limit (the suite turns it off)
    short = speed_sweep(rag, [64], [whole], SweepOptions(chunk_tokens=32, repeats=1, tiers=("cold",), progress=False))
    assert short[1]["served"] == {} and short[1]["kv_from"].startswith("– (read whole")
    # a store of one tier has no per-tier rows, and says why; --tiers is checked
    plain = plan_tiers(KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://").store, TIERS)
    assert plain.levels == {} and "no tiers" in plain.notes[0]
    assert parse_tiers("auto", store_given=False) == TIERS and parse_tiers("auto", store_given=True) == ()
    assert parse_tiers("cold,hot", store_given=True) == ("cold", "hot")
    with pytest.raises(ValueError, match="unknown tier"):
        parse_tiers("lukewarm", store_given=False)


def test_sizes_shapes_and_sample_data():
    assert parse_sizes("512, 1k,4K") == [512, 1024, 4096]
    assert {"llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b"} <= set(shape_names())
    cfg = shape_config("llama-3.1-8b")
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size) == (32, 8, 4096)
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("gpt-9")
    chunks = corpus_chunks(tiny_tokenizer(), 3, 50)
    assert len({c.text for c in chunks}) == 3
    examples = sample_examples(seed=1)
    assert len(examples) >= 10
    for ex in examples:
        assert len(ex.chunks) == 6 and any(ex.answers[0].lower() in c.text.lower() for c in ex.chunks)


@pytest.mark.smollm
def test_quick_bench_end_to_end(kvrag_home, tmp_path, capsys):
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--n", "2", "--contexts", "256,512", "--decode-tokens", "2", "--out", str(out)]) == 0
    for name in ("records.jsonl", "summary.json", "summary.md", "quality_vs_ratio.png", "speed.json", "speed.md", "ttft_vs_context.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = {r["setting"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert {"full", "reuse", "cacheblend@0.15", "epic@0.3", "a3@0.15", "fusionrag@0.3", "samkv@0.15"} <= set(rows)
    assert rows["full"]["agree"] == 1.0 and rows["reuse"]["recomputed_share"] == 0.0  # reuse skips the chunk prefill
    assert all(r["ttft_ratio"] > 0 for r in rows.values())  # every setting's ratio is reported (its size is the benchmark's to say)
    assert rows["samkv@0.15"]["kept_kv_ratio"] < 1.0
    speed = json.loads((out / "speed.json").read_text())
    assert {r["context_tokens"] // 100 for r in speed["rows"]} and speed["meta"]["random_weights"] is False
    assert all(r["decode_tok_s"] > 0 for r in speed["rows"]) and speed["meta"]["decode_tokens"] == 2
    assert "## Quality" in (out / "summary.md").read_text()
    assert not (out / "kv").exists() and "removed this run's KV store" in capsys.readouterr().err  # a completed run's cache


def test_a_completed_run_removes_only_its_own_default_store(tmp_path):
    import argparse

    from kvrag.cache_backends import DiskStore, content_key
    from kvrag.cli.bench_run import drop_default_store, run_store
    from test_backends import entry

    for store, keep, kept in ((None, False, False), (None, True, True), ("disk:///elsewhere", False, True)):
        out = tmp_path / f"{store is None}-{keep}"
        run_store(out, "test")  # the run made OUT/kv (issue #53: only a store a run made is removed)
        DiskStore(out / "kv").put(content_key("e"), entry())
        (out / "records.jsonl").write_text("{}\n")
        drop_default_store(argparse.Namespace(store=store, keep_store=keep), out)
        assert (out / "kv").exists() == kept and (out / "records.jsonl").is_file()


def test_bench_input_errors(tmp_path, capsys):
    assert main(["bench", "--out", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["bench", "speed", "--shape", "llama-3.2-1b", "--out", str(tmp_path)]) == 2
    assert "--random-weights" in capsys.readouterr().err


def test_settings_name_model_variants_and_kvlink_runs_at_ratio_zero():
    from kvrag.eval.runner import split_methods

    assert split_methods("kvlink:link_tokens=5,model=lora5, full:model=lora5,epic,samkv:update=fusion,block_size=8") == [
        "kvlink:link_tokens=5,model=lora5", "full:model=lora5", "epic", "samkv:update=fusion,block_size=8"]
    with pytest.raises(ValueError, match="before any method"):
        split_methods("model=x,epic")
    settings = make_settings(["kvlink:link_tokens=5,model=lora5", "full:model=lora5", "epic"], [0.0, 0.15])
    assert [s.name for s in settings] == [
        "full",
        "reuse",
        "kvlink@0[link_tokens=5]{lora5}",
        "kvlink@0.15[link_tokens=5]{lora5}",
        "full{lora5}",
        "epic@0.15",
    ]
    assert {s.model for s in settings} == {"", "lora5"}


def test_variants_are_scored_against_the_base_models_full_attention(tmp_path):
    import torch

    base = tiny_rag()
    same = KVRag(from_model(base.lm.model, base.lm.tokenizer), store="memory://")
    other_model = tiny_model("llama")
    with torch.no_grad():
        for p in other_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = KVRag(from_model(other_model, tiny_tokenizer()), store="memory://")
    settings = make_settings(["full:model=same", "kvlink:link_tokens=0,model=same", "full:model=other"], [0.0])
    with pytest.raises(ValueError, match="other"):
        run(base, EXAMPLES[:1], settings, tmp_path, max_new_tokens=3, progress=False, variants={"same": same})
    path = run(base, EXAMPLES, settings, tmp_path, max_new_tokens=3, progress=False, variants={"same": same, "other": other})
    by = {(r["example"], r["setting"]): r for r in load_records(path)}
    for ex in EXAMPLES:
        twin = by[(ex.id, "full{same}")]
        assert twin["model"] == "same" and twin["agree"] == 1.0 and twin["kl"] < 1e-6
        assert by[(ex.id, "kvlink@0[link_tokens=0]{same}")]["answer"] == by[(ex.id, "reuse")]["answer"]
        other_full = by[(ex.id, "full{other}")]
        assert other_full["agree_own"] == 1.0 and other_full["kl_own"] == 0.0  # its own weights' Full is itself
        assert by[(ex.id, "reuse")]["kl_own"] == by[(ex.id, "reuse")]["kl"]  # base rows: own Full is the base Full
    assert max(by[(ex.id, "full{other}")]["kl"] for ex in EXAMPLES) > 1e-4  # other weights: scored against the base
    table = markdown_table(summarize(load_records(path)))
    assert "agreement w/ own Full" in table and "| full{other} |" in table


def test_no_engine_answers_from_its_prefix_cache_inside_a_run(tmp_path):
    """The same documents asked twice (a set's phrasings, or the next answer length) must be read again by every
    engine, the variants' too: a prefix-cache hit would time an exact copy, not the method."""
    base = tiny_rag()
    same = KVRag(from_model(base.lm.model, base.lm.tokenizer), store="memory://")
    twice = [Example(f"{ex.id}-{n}", ex.question + " " * n, ex.answers, ex.chunks) for ex in EXAMPLES[:2] for n in range(2)]
    settings = make_settings(["full:model=same", "kvlink:link_tokens=0,model=same"], [0.0])
    for engine in (base, same):
        engine.prefix_cache.clear()
    run(base, twice, settings, tmp_path, max_new_tokens=3, progress=False, variants={"same": same})
    for engine in (base, same):
        stats = engine.prefix_cache.snapshot()
        assert stats.lookups == 0 and stats.stored == 0 and stats.hits == 0
        assert engine.prefix_cache.enabled  # and on again afterwards


def test_row_ranges_and_merging_split_runs(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [{"id": f"r{i}", "question": f"q{i}?", "answers": [f"a{i}"], "ctxs": [{"title": "t", "text": f"text {i}"}]} for i in range(5)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from kvrag.eval.data import load_examples

    assert [e.id for e in load_examples(f"{data}@1:3")] == ["r1", "r2"]
    assert [e.id for e in load_examples(f"{data}@3:")] == ["r3", "r4"]
    rag = tiny_rag()
    a = run(rag, EXAMPLES, make_settings(["epic"], [0.3]), tmp_path / "a", max_new_tokens=3, progress=False)
    b = run(rag, EXAMPLES, make_settings(["a3"], [0.3]), tmp_path / "b", max_new_tokens=3, progress=False)
    assert main(["bench", "--merge", f"{a.parent},{b.parent}", "--out", str(tmp_path / "m")]) == 0
    merged = load_records(tmp_path / "m" / "records.jsonl")
    assert len(merged) == len(EXAMPLES) * 4  # full and reuse once each, epic and a3
    assert "a3@0.3" in (tmp_path / "m" / "summary.md").read_text()
    # a part stopped early: its examples missing a setting leave the table, the rest stay paired
    lines = (tmp_path / "b" / "records.jsonl").read_text().splitlines()
    (tmp_path / "b" / "records.jsonl").write_text("\n".join(l for l in lines if not ('"ex2"' in l and "a3@0.3" in l)) + "\n")
    assert main(["bench", "--merge", f"{a.parent},{b.parent}", "--out", str(tmp_path / "m2")]) == 0
    assert {r["example"] for r in load_records(tmp_path / "m2" / "records.jsonl")} == {"ex0", "ex1"}
    assert "1 examples not answered" in capsys.readouterr().err
    assert main(["bench", "--data", str(data), "--adapter", "nopath", "--out", str(tmp_path / "x")]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
    assert main(["bench", "--data", str(data), "--adapter", "v=missing.safetensors", "--out", str(tmp_path / "x")]) == 2
    assert "no adapter file" in capsys.readouterr().err


def test_the_chat_bench_measures_turn_two_with_and_without_the_prefix_cache(tmp_path):
    from kvrag.eval.chat_bench import load_cases, run_chat_bench

    cases = load_cases(None, passages=4)
    assert all(sum(c.id in {g.id for g in case.gold} for c in case.context["10 passages"]) == len(case.gold) for case in cases)
    result = run_chat_bench(tiny_rag(), tmp_path, ["full", "cacheblend"], n=2, max_new_tokens=3, passages=4, retrieval=False, progress=False)
    rows = {(r["kind"], r["method"]): r for r in result["summary"]}
    assert set(rows) == {(k, m) for k in ("10 passages", "short") for m in ("full", "cacheblend")}
    assert rows[("short", "full")]["identical"] == 2  # exact: the cache changes no token
    assert all(r["prefix_hit_tokens"] > 0 for r in result["records"])
    assert (tmp_path / "chat.md").read_text().count("\n| ") >= 5 and (tmp_path / "chat.json").exists()


def test_the_chat_benchs_retrieval_section_reads_less_of_turn_two_with_turn_ones_order_kept(tmp_path):
    from kvrag.eval.chat_bench import load_cases, retrieval_modes, retrieval_summary

    cases = load_cases(None, passages=4)[:3]
    rag = tiny_rag()
    rows = retrieval_modes(rag, cases, tmp_path / "index", k=4, max_new_tokens=2)
    kept, raw = "recent user turns, turn one's order kept", "recent user turns"
    by = {(r["case"], r["mode"]): r for r in rows}
    for case in cases:
        a, b = by[(case.id, kept)], by[(case.id, raw)]
        assert sorted(a["ids"]) == sorted(b["ids"])  # the same chunks, only ordered
        shared = [i for i in a["turn1_ids"] if i in a["ids"]]
        assert a["ids"][: len(shared)] == shared and a["read_tokens"] <= b["read_tokens"]
    summary = {r["mode"]: r for r in retrieval_summary(rows)}
    assert set(summary) == {"last message", raw, "condensed", kept} and summary[kept]["read_tokens"] <= summary[raw]["read_tokens"]
