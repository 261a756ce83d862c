"""Aggregate benchmark records into a summary (JSON) and a markdown table."""

from __future__ import annotations

import json
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Sequence

from kvrag.eval.metrics import f1

METRICS = ("f1", "contains", "agree", "agree_f1", "kl", "agree_own", "kl_own")


def bootstrap_ci(values: list[float], iters: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean."""
    if len(values) < 2:
        v = values[0] if values else 0.0
        return v, v
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(iters))
    return means[int(0.025 * iters)], means[int(0.975 * iters) - 1]


def load_records(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def paired_blocks(out: Path, sets: Sequence[str], lengths: Sequence[int],
                  settings: set[str] | None = None) -> Iterator[tuple[str, int, list[dict[str, Any]], int]]:
    """Each block answered so far under OUT (OUT/set/lenN/records.jsonl) as (set, length, records, n): the records
    of the n questions every setting answered (`settings`, else every setting the block holds), so rows stay paired."""
    for name in sets:
        for length in lengths:
            path = Path(out) / name / f"len{length}" / "records.jsonl"
            if not path.is_file():
                continue
            records = load_records(path)
            if settings is not None:
                records = [r for r in records if r["setting"] in settings]
            want = settings if settings is not None else {r["setting"] for r in records}
            answered: dict[str, set[str]] = {}
            for r in records:
                answered.setdefault(r["example"], set()).add(r["setting"])
            done = {ex for ex, got in answered.items() if got >= want}
            keep = [r for r in records if r["example"] in done]
            if keep:
                yield name, length, keep, len(done)


def merge_records(sources: list[Path], dest: Path) -> tuple[Path, int]:
    """Join the records of runs split across processes (each with its own Full reference) into one file.

    The first record of each (example, setting) pair is kept, so the Full and reuse rows every part
    repeats are counted once. Only examples answered under every setting are kept, so every row of
    the table is paired over the same questions (a part stopped early shortens the table, never skews
    it); returns the file and the number of examples left out.
    """
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for src in sources:
        for r in load_records(src):
            seen.setdefault((r["example"], r["setting"]), r)
    settings = {s for _, s in seen}
    by_example: dict[str, set[str]] = defaultdict(set)
    for ex, st in seen:
        by_example[ex].add(st)
    complete = {ex for ex, sts in by_example.items() if sts == settings}
    lines = [json.dumps(r) for (ex, _), r in seen.items() if ex in complete]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + ("\n" if lines else ""))
    tmp.replace(dest)
    return dest, len(by_example) - len(complete)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting, in first-seen order; TTFT ratio = median of per-example full / method."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    full_answer = {r["example"]: r["answer"] for r in records if r["setting"] == "full"}
    for r in records:
        if "agree_f1" not in r:  # token F1 between this answer and Full Attention's: a softer agreement
            r["agree_f1"] = f1(r["answer"], full_answer.get(r["example"], ""))
        r.setdefault("agree_own", r["agree"])  # records from before the own-weights reference: base rows only
        r.setdefault("kl_own", r["kl"])
        by[r["setting"]].append(r)
    full_score = _mean(by.get("full", []), "contains")
    reuse_score = _mean(by.get("reuse", []), "contains")
    rows = []
    for name, rs in by.items():
        row: dict[str, Any] = {
            "setting": name,
            "method": rs[0]["method"],
            "ratio": rs[0]["ratio"],
            "kv_kind": rs[0].get("kv_kind", "chunk"),
            "model": rs[0].get("model", ""),
            "n": len(rs),
        }
        for m in METRICS:
            vals = [float(r[m]) for r in rs]
            row[m] = sum(vals) / len(vals)
            row[m + "_ci"] = bootstrap_ci(vals)
        row["ttft_ratio"] = statistics.median(r["full_ttft_s"] / max(r["ttft_s"], 1e-9) for r in rs)
        for part in ("ttft_s", "load_s", "stitch_s", "select_s", "recompute_s", "prefill_s"):
            row[part] = statistics.median(r.get(part, 0.0) for r in rs)
        per_token = [r["bytes_loaded"] / r["context_tokens"] for r in rs if r.get("bytes_loaded") and r.get("context_tokens")]
        row["store_bytes_per_token"] = statistics.median(per_token) if per_token else None  # None: nothing loaded
        row["recomputed_share"] = sum(r["recomputed_tokens"] for r in rs) / max(1, sum(r["context_tokens"] for r in rs))
        span = full_score - reuse_score
        row["normalized"] = (row["contains"] - reuse_score) / span if abs(span) > 1e-9 else float("nan")
        row["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in rs)
        row["kept_kv_ratio"] = sum(r.get("kept_kv_ratio", 1.0) for r in rs) / len(rs)
        peaks = [r["kv_bytes"] for r in rs if r.get("kv_bytes")]
        row["peak_kv_mb"] = max(peaks) / 1e6 if peaks else None  # None: not recorded
        rows.append(row)
    return rows


def _mean(rs: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rs) / len(rs) if rs else 0.0


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Quality: task score, fidelity to Full Attention (95% bootstrap intervals) and the normalised score.
    With model variants (other weights), two more columns score each row against Full Attention over
    its own weights ("own Full"); the other fidelity columns stay against the base model's."""
    own = any(r.get("model") for r in rows)
    extra = " agreement w/ own Full | KL vs own Full |" if own else ""
    head = (
        "| setting | n | recomputed | kept KV | answer-contained | F1 | agreement w/ Full | F1 vs Full | first-token KL | "
        f"normalised | TTFT Full ÷ method |{extra}\n|---|---|---|---|---|---|---|---|---|---|---|{'---|---|' if own else ''}\n"
    )
    lines = []
    for r in rows:
        lo, hi = r["agree_ci"]
        clo, chi = r["contains_ci"]
        olo, ohi = r["agree_own_ci"]
        lines.append(
            f"| {r['setting']} | {r['n']} | {r['recomputed_share']:.0%} | {r.get('kept_kv_ratio', 1.0):.0%} | "
            f"{r['contains']:.3f} [{clo:.2f}, {chi:.2f}] | {r['f1']:.3f} | {r['agree']:.3f} [{lo:.2f}, {hi:.2f}] | "
            f"{r['agree_f1']:.3f} | {r['kl']:.3f} | {r['normalized']:.2f} | {r['ttft_ratio']:.1f}× |"
            + (f" {r['agree_own']:.3f} [{olo:.2f}, {ohi:.2f}] | {r['kl_own']:.3f} |" if own else "")
        )
    return head + "\n".join(lines) + "\n"


def speed_table(rows: list[dict[str, Any]]) -> str:
    """Speed and memory: where TTFT goes (medians, ms), decode rate, KV held and store bytes per token."""
    head = (
        "| setting | TTFT ms | load | stitch | select | recompute + question | full prefill | TTFT Full ÷ method | "
        "decode tok/s | peak KV MB | store bytes/token |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    ms = lambda v: f"{v * 1000:.0f}"  # noqa: E731
    lines = []
    for r in rows:
        bpt = r.get("store_bytes_per_token")
        lines.append(
            f"| {r['setting']} | {ms(r['ttft_s'])} | {ms(r['load_s'])} | {ms(r['stitch_s'])} | {ms(r['select_s'])} | "
            f"{ms(r['recompute_s'])} | {ms(r.get('prefill_s', 0.0))} | {r['ttft_ratio']:.1f}× | {r['decode_tok_s']:.1f} | "
            f"{'–' if r.get('peak_kv_mb') is None else format(r['peak_kv_mb'], '.1f')} | "
            f"{'–' if bpt is None else format(bpt, ',.0f')} |"
        )
    return head + "\n".join(lines) + "\n"


def hardware_line(hw: dict[str, Any]) -> str:
    """One human sentence for the hardware a run was measured on."""
    parts = [hw.get("gpu") or f"{hw.get('cpu', hw.get('processor', '?'))}, {hw.get('cores', '?')} cores"]
    parts.append(f"{hw.get('threads', '?')} torch threads, torch {hw.get('torch', '?')}, Python {hw.get('python', '?')}")
    return "; ".join(parts)


def write_report(records_path: str | Path, out_dir: str | Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """summary.json, summary.md and (matplotlib permitting) quality_vs_ratio.png beside the records."""
    from kvrag.eval.plots import quality_vs_ratio

    rows = summarize(load_records(records_path))
    out = Path(out_dir)
    summary = out / "summary.json"
    summary.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot = quality_vs_ratio(rows, out / "quality_vs_ratio.png", title=f"{Path(str(meta.get('data', ''))).stem}, n={meta.get('n')}")
    md = out / "summary.md"
    md.write_text(
        f"# kvrag bench\n\n`{meta.get('command', '')}`\n\n"
        + "".join(f"- part: `{c}`\n" for c in meta.get("parts", []))
        + ("\n" if meta.get("parts") else "")
        + f"hardware: {hardware_line(meta.get('hardware', {}))}\n\n"
        f"data: {meta.get('data')} (n={meta.get('n')}, seed={meta.get('seed')}), model: {meta.get('model')}, "
        f"{meta.get('max_new_tokens', '?')} new tokens, greedy\n\n"
        "Normalised = (m − reuse) / (Full − reuse) on answer-contained (FusionRAG's definition); "
        "TTFT ratios are medians of per-question Full ÷ method pairs from this run.\n\n"
        "## Quality\n\n" + markdown_table(rows) + "\n## Speed and memory\n\n" + speed_table(rows)
        + (f"\n![quality vs recompute ratio]({plot.name})\n" if plot else "")
    )
    return summary, md
