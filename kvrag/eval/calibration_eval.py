"""`kvrag eval calibration`: does the calibrated default contain the gold answer as often as Full Attention?

Every suite set (kvrag.eval.suite: held-out rows, several kinds), at each answer length, answered by base Full
Attention and by the engine's default (no method and no ratio named: what a user gets, the model's calibrated
setting with the read-whole policies) in the same run (kvrag.eval.runner). The default keeps up on a block when
it contains the gold at least as often as Full less one question in 30; its TTFT ratio stands beside it.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from kvrag.eval.report import hardware_line, paired_blocks, summarize
from kvrag.eval.runner import Setting, _done, _record, hardware
from kvrag.eval.suite import SETS
from kvrag.kv.prefix_cache import without_prefix_cache

SETTINGS = (Setting("full"), Setting("default"))
SLACK = 1 / 30  # the default may contain the gold in one question in 30 fewer than Full


def judge_calibrated_default(rag: Any, sets: Sequence[str], lengths: Sequence[int], out: Path, data: Path, n: int | None,
                         progress: bool = True) -> dict[str, Any]:
    """Answer every set at every length (resumable: records per set and length under OUT), then judge."""
    for name in sets:
        spec = SETS[name]
        examples = spec.build(data, n or spec.n)
        for length in lengths:
            answer_pairs(rag, examples, out / name / f"len{length}", length, progress)
    return collect(out, sets, lengths)


@without_prefix_cache
def answer_pairs(rag: Any, examples: Sequence[Any], folder: Path, length: int, progress: bool = True) -> Path:
    """Each question answered by base Full Attention, then by the engine's default (no method, no ratio named),
    paired in time; records as kvrag.eval.runner writes them. Lighter than the runner: one untimed pass of
    each first, and chunk KV computed ahead only where the default reuses it."""
    from tqdm.auto import tqdm

    folder.mkdir(parents=True, exist_ok=True)
    records = folder / "records.jsonl"
    done = _done(records)
    todo = [ex for ex in examples if not all((ex.id, st.name) in done for st in SETTINGS)]
    reuses = rag.default_setting.method != "full"
    with records.open("a") as f:
        for k, ex in enumerate(tqdm(todo, desc=f"{folder.parent.name}/{folder.name}", disable=not progress)):
            if reuses:
                rag.precompute(ex.chunks, progress=False)  # offline work, not timed
            if k == 0:  # the first passes over these shapes are not the timed ones
                rag.prefill(ex.question, chunks=ex.chunks, method="full")
                rag.prefill(ex.question, chunks=ex.chunks)
            full = rag.prefill(ex.question, chunks=ex.chunks, method="full")
            full_text = rag.decode(full, max_new_tokens=length).answer().text
            pre = rag.prefill(ex.question, chunks=ex.chunks)
            text = rag.decode(pre, max_new_tokens=length).answer().text
            for st, p, t in ((SETTINGS[0], full, full_text), (SETTINGS[1], pre, text)):
                f.write(json.dumps(_record(ex, st, p, t, full_text, full)) + "\n")
            f.flush()
    return records


def collect(out: Path, sets: Sequence[str], lengths: Sequence[int]) -> dict[str, Any]:
    """The blocks answered so far under OUT, each over the questions both settings answered, judged."""
    blocks = [_block(name, length, keep) for name, length, keep, _ in paired_blocks(out, sets, lengths, {"full", "default"})]
    total_full = sum(b["full_contains"] * b["n"] for b in blocks)
    total_default = sum(b["default_contains"] * b["n"] for b in blocks)
    n = sum(b["n"] for b in blocks)
    return {"blocks": blocks, "n": n, "full_contained": round(total_full), "default_contained": round(total_default),
            "keeps_up": bool(blocks) and all(b["keeps_up"] for b in blocks), "slack": SLACK}


def _block(name: str, length: int, records: list[dict[str, Any]]) -> dict[str, Any]:
    rows = {r["setting"]: r for r in summarize(records)}
    full, default = rows["full"], rows["default"]
    answered = Counter(r.get("answered_with", "?") for r in records if r["setting"] == "default")
    notes = Counter(r.get("default", "") + (f": {r['default_reason']}" if r.get("default_reason") else "")
                    for r in records if r["setting"] == "default")
    return {
        "set": name, "kind": SETS[name].kind, "length": length, "n": full["n"],
        "full_contains": full["contains"], "default_contains": default["contains"],
        "keeps_up": default["contains"] >= full["contains"] - SLACK - 1e-9,
        "agreement": default["agree"], "kl": default["kl"], "ttft_ratio": default["ttft_ratio"],
        "answered_with": dict(answered), "default_note": notes.most_common(1)[0][0] if notes else "",
    }


def calibration_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [
        "# The calibrated default against Full Attention", "",
        f"`{meta.get('command', '')}`", "",
        f"hardware: {meta.get('hardware_line', '')}; model: {meta.get('model', '')}; greedy; {meta.get('note', '')}", "",
        "\"default\" = no method and no ratio named (the model's calibrated setting, read-whole policies on); \"full\" = base Full "
        "Attention over the same prompt in the same run. Contained = the normalised gold answer appears in the answer; "
        f"the default keeps up where it contains the gold at least as often as Full less one question in {round(1 / SLACK)}. "
        "TTFT = the median per-question ratio Full ÷ default.", "",
    ]
    notes = sorted({b["default_note"] for b in result["blocks"] if b["default_note"]})
    lines += [f"Default chosen: {n}" for n in notes] + [""]
    lines += ["| set | tokens | n | Full contained | default contained | keeps up | agreement w/ Full | first-token KL | TTFT Full ÷ default | answered with |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for b in result["blocks"]:
        answered = ", ".join(f"{k} {v}" for k, v in sorted(b["answered_with"].items()))
        lines.append(f"| {b['set']} | {b['length']} | {b['n']} | {b['full_contains']:.3f} | {b['default_contains']:.3f} | "
                     f"{'yes' if b['keeps_up'] else '**no**'} | {b['agreement']:.3f} | {b['kl']:.3f} | {b['ttft_ratio']:.2f}× | {answered} |")
    lines += ["", f"Over every block: Full contained the gold {result['full_contained']} times, the default "
              f"{result['default_contained']} times, in {result['n']} answers; the default keeps up on every block: "
              f"**{'yes' if result['keeps_up'] else 'no'}**.", ""]
    lines += ["Sets:"] + [f"- `{k}`: {SETS[k].kind}" for k in dict.fromkeys(b["set"] for b in result["blocks"])]
    return "\n".join(lines) + "\n"


def write(result: dict[str, Any], out: Path, meta: dict[str, Any]) -> None:
    meta = {**meta, "hardware_line": hardware_line(meta.get("hardware") or hardware())}
    (out / "calibration.json").write_text(json.dumps({"meta": meta, **result}, indent=1, default=str))
    (out / "README.md").write_text(calibration_markdown(result, meta))
