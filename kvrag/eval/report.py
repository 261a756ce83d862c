"""Aggregate benchmark records into a summary (JSON) and a markdown table."""

from __future__ import annotations

import json
import random
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from kvrag.eval.metrics import f1

METRICS = ("f1", "contains", "agree", "agree_f1", "kl")


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


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting, in first-seen order; TTFT ratio = median of per-example full / method."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    full_answer = {r["example"]: r["answer"] for r in records if r["setting"] == "full"}
    for r in records:
        if "agree_f1" not in r:  # token F1 between this answer and Full Attention's: a softer agreement
            r["agree_f1"] = f1(r["answer"], full_answer.get(r["example"], ""))
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
            "n": len(rs),
        }
        for m in METRICS:
            vals = [float(r[m]) for r in rs]
            row[m] = sum(vals) / len(vals)
            row[m + "_ci"] = bootstrap_ci(vals)
        row["ttft_ratio"] = statistics.median(r["full_ttft_s"] / max(r["ttft_s"], 1e-9) for r in rs)
        for part in ("ttft_s", "load_s", "stitch_s", "select_s", "recompute_s"):
            row[part] = statistics.median(r[part] for r in rs)
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
    head = (
        "| setting | n | recomputed | kept KV | answer-contained | F1 | agreement w/ Full | F1 vs Full | first-token KL | "
        "normalised | TTFT ms (median) | TTFT Full ÷ method | peak KV MB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lo, hi = r["agree_ci"]
        lines.append(
            f"| {r['setting']} | {r['n']} | {r['recomputed_share']:.0%} | {r.get('kept_kv_ratio', 1.0):.0%} | "
            f"{r['contains']:.3f} | {r['f1']:.3f} | {r['agree']:.3f} [{lo:.2f}, {hi:.2f}] | {r['agree_f1']:.3f} | {r['kl']:.3f} | "
            f"{r['normalized']:.2f} | {r['ttft_s'] * 1000:.0f} | {r['ttft_ratio']:.1f}× | "
            f"{'–' if r.get('peak_kv_mb') is None else format(r['peak_kv_mb'], '.1f')} |"
        )
    return head + "\n".join(lines) + "\n"


def write_report(records_path: str | Path, out_dir: str | Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    rows = summarize(load_records(records_path))
    out = Path(out_dir)
    summary = out / "summary.json"
    summary.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    md = out / "summary.md"
    md.write_text(
        f"# kvrag bench\n\n`{meta.get('command', '')}`\n\nhardware: {json.dumps(meta.get('hardware', {}))}\n\n"
        f"data: {meta.get('data')} (n={meta.get('n')}, seed={meta.get('seed')}), model: {meta.get('model')}\n\n"
        + markdown_table(rows)
    )
    return summary, md
