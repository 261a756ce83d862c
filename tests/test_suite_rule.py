"""Issue #34: the rule that picks the default from the suite's table (no model: made-up blocks)."""

from kvrag.eval.suite import SETS, collect, decide, pivot_markdown, suite_settings
from kvrag.options import DEFAULT_METHOD

TUNED = "kvlink@0{tuned}"


def rows(**kw):
    return {"cacheblend@0.15": kw.get("cb", (0.5, 0.4)), "fusionrag@0.15": kw.get("fr", (0.5, 0.3)),
            "a3@0.15": kw.get("a3", (0.4, 0.2)), "samkv@0.15": (0.1, 0.0), TUNED: kw.get("t", (0.6, 0.5))}


def results(*blocks):
    out = {}
    for i, (name, rs, speed) in enumerate(blocks):
        b = {"set": name, "length": 16 + i, "n": 30, "kind": "", "rows": [{"setting": "full", "contains": 0.5, "agree": 1.0, "ttft_ratio": 1.0}]}
        b["rows"] += [{"setting": k, "contains": c, "agree": a, "ttft_ratio": speed.get(k, 5.0)} for k, (c, a) in rs.items()]
        out[f"{name}/{16 + i}"] = b
    return out


def test_the_tuned_adapter_is_the_default_only_if_it_holds_everywhere():
    good = results(("nq10", rows(), {}), ("facts", rows(), {}))
    assert decide(good)["default"] == TUNED and decide(good)["tuned_passes"]
    one_bad = results(("nq10", rows(), {}), ("facts", rows(t=(0.3, 0.5)), {}))  # 0.3 < 0.5 - SE (0.409)
    verdict = decide(one_bad)
    assert verdict["default"] == "cacheblend@0.15" and not verdict["tuned_passes"]
    assert any("facts" in r and "contains" in r for r in verdict["tuned_fails"])
    within_se = results(("nq10", rows(t=(0.42, 0.5)), {}))  # one standard error below Full is allowed
    assert decide(within_se)["tuned_passes"]
    disagrees = results(("nq10", rows(t=(0.6, 0.35)), {}))  # agrees less than cacheblend's 0.4
    assert not decide(disagrees)["tuned_passes"]


def test_the_training_free_default_keeps_up_on_most_sets_and_is_fast_enough():
    r = results(("nq10", rows(cb=(0.5, 0.4), fr=(0.5, 0.45), t=(0.1, 0)), {}), ("facts", rows(cb=(0.5, 0.4), fr=(0.2, 0.9), t=(0.1, 0)), {}))
    assert decide(r)["default"] == "cacheblend@0.15"  # fusionrag falls behind on facts
    slow = results(("nq10", rows(t=(0.1, 0)), {"cacheblend@0.15": 3.5, "fusionrag@0.15": 3.4}))
    assert decide(slow)["default"] == "a3@0.15"  # the others miss 4x on the 10-passage sets
    assert decide(slow)["speed_on_long_sets"]["cacheblend@0.15"] == 3.5


def test_a_method_the_suite_skipped_is_never_the_pick():
    only_fr = {k: v for k, v in rows(t=(0.1, 0)).items() if k in ("fusionrag@0.15", TUNED)}
    slow = results(("nq10", only_fr, {"fusionrag@0.15": 3.9}))  # below the speed floor, yet the only one answered
    verdict = decide(slow)
    assert verdict["default"] == "fusionrag@0.15" and verdict["speed_on_long_sets"]["cacheblend@0.15"] is None
    assert decide(results(("nq10", {TUNED: (0.1, 0.0)}, {})))["default"] == "full"  # nothing training-free answered


def test_settings_pivot_and_collect(tmp_path):
    names = [s.name for s in suite_settings(with_tuned=True)]
    assert names[:2] == ["full", "reuse"] and TUNED in names and f"{DEFAULT_METHOD}@0.15[min_recompute=0,records_whole=False,short_context=0]" in names
    assert "reuse[ape=0.9,1]" in names and "fusionrag@0.15[ape=0.9,1]" in names  # APE judged on rows no choice saw
    assert len(SETS) >= 5 and {"nq10", "musique", "kv75", "facts", "sample"} <= set(SETS)
    table = pivot_markdown(results(("nq10", rows(), {})))
    assert "**0.500**" in table and "| nq10 | 16 | 30 |" in table
    (tmp_path / "facts" / "len16").mkdir(parents=True)
    recs = [{"example": e, "setting": s, "answer": "x", "contains": 1.0, "f1": 1.0, "agree": 1.0, "kl": 0.0, "ttft_s": 1.0,
             "full_ttft_s": 1.0, "recomputed_tokens": 1, "context_tokens": 1, "decode_tok_s": 1.0, "bytes_loaded": 0,
             "method": s, "ratio": 0.15}
            for e, settings in (("a", ("full", "reuse")), ("b", ("full",))) for s in settings]
    import json

    (tmp_path / "facts" / "len16" / "records.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    got = collect(tmp_path, ["facts", "nq10"], [16, 64])
    assert list(got) == ["facts/16"] and got["facts/16"]["n"] == 1  # "b" lacks reuse: left out, rows stay paired


def test_the_new_settings_each_with_the_policies_on_and_off_and_skip_never_drops_full():
    from kvrag.eval.suite import RAW

    names = [s.name for s in suite_settings(with_tuned=True)]
    raw = "min_recompute=0,records_whole=False,short_context=0"
    for name in (f"reuse[{raw}]", f"reuse[ape=0.9,1,{raw}]", f"fusionrag@0.15[ape=0.9,1,{raw}]", f"kvlink@0[{raw}]{{tuned}}"):
        assert name in names, name
    assert len(names) == len(set(names))
    kept = suite_settings(with_tuned=False, skip=("cacheblend", "a3", "samkv", "full"))
    assert [s.method for s in kept].count("full") == 1 and not {"cacheblend", "a3", "samkv", "kvlink"} & {s.method for s in kept}
    assert all(dict(s.params).get("short_context") == 0 for s in kept if RAW[0] in s.params)


def test_the_models_calibrated_default_is_a_column_and_is_the_one_marked():
    from kvrag.defaults import Ape, DefaultSetting
    from kvrag.eval.suite import default_setting, fidelity_markdown

    def default_column(d):
        return default_setting(d).name

    assert default_column(DefaultSetting("fusionrag", 0.15, "calibrated", ape=Ape(0.9, 1.0))) == "fusionrag@0.15[ape=0.9,1]"
    assert default_column(DefaultSetting("reuse", 0.15, "calibrated", ape=Ape(1.0, 1.0))) == "reuse"  # T = S = 1 is no APE
    assert default_column(DefaultSetting("kvlink", 0.0, "calibrated")) == TUNED
    other = default_column(DefaultSetting("a3", 0.5, "calibrated", ape=Ape(0.8, 1.1)))
    assert other == "a3@0.5[ape=0.8,1.1]"
    names = [s.name for s in suite_settings(with_tuned=False, default=default_setting(DefaultSetting("a3", 0.5, "calibrated", ape=Ape(0.8, 1.1))))]
    assert names[-1] == other and names.count(other) == 1  # not among the suite's own: added once
    ours = default_setting(DefaultSetting("fusionrag", 0.15, "calibrated", ape=Ape(0.9, 1.0)))
    assert [s.name for s in suite_settings(with_tuned=False, default=ours)].count("fusionrag@0.15[ape=0.9,1]") == 1
    block = rows(fr=(0.25, 0.3))
    block["fusionrag@0.15[ape=0.9,1]"] = (0.75, 0.6)
    res = results(("nq10", block, {"fusionrag@0.15[ape=0.9,1]": 2.5}))
    table = pivot_markdown(res, "fusionrag@0.15[ape=0.9,1]")
    assert "**0.750** (agr 0.60, 2.5×)" in table and "**0.250**" not in table
    for b in res.values():  # the fidelity table reads KL too
        for r in b["rows"]:
            r["kl"] = 0.125
    fid = fidelity_markdown(res)
    assert "0.60 · 0.125 · 2.5×" in fid and "`full`" not in fid


def test_an_unknown_method_to_skip_is_refused_before_any_model_loads(tmp_path, capsys):
    from kvrag.cli import main

    rc = main(["eval", "suite", "--skip", "cacheblend,nosuch", "--out", str(tmp_path / "o"), "--model", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert rc != 0 and "nosuch" in err and "cacheblend" not in err.split("unknown methods")[1].split(";")[0]
