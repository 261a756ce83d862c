"""`kvrag eval steps --run RUN`: how agreement with base Full Attention grows with training steps.

A run trained in pieces keeps the adapter each piece ended with (RUN/snaps/step-N.safetensors; see
scripts/train_distill_links.sh). Each snapshot is a model variant that answers the same held-out questions
beside base Full Attention and plain reuse, in one run (kvrag.eval.runner, so agreement and KL are against
the same Full answers). The table says whether more training would help: agreement and first-token KL per
set, length and step.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from kvrag.eval.report import hardware_line, paired_blocks, summarize
from kvrag.eval.runner import Setting, hardware, run
from kvrag.eval.suite import SETS

SNAPSHOT = re.compile(r"^step-(\d+)\.safetensors$")
# the read-whole policies off, the recompute floor as users get it (what calibration measures, kvrag.check.calibrate):
# the method itself on every set, so short contexts and records of one kind are not read whole by every column alike
POLICY = (("records_whole", False), ("short_context", 0))
BASELINES = (Setting("full"), Setting("reuse", params=POLICY))
METHOD = "kvlink"
Snapshot = tuple[str, int, Path]  # (run label, optimizer step, adapter file)
Column = tuple[str, int]  # (run label, step)


def snapshots(run_dir: Path) -> list[Snapshot]:
    """The run's adapter snapshots, by step: RUN/snaps/step-N.safetensors, labelled with the run folder's name."""
    folder = Path(run_dir) / "snaps"
    found = sorted((int(m.group(1)), p) for p in folder.glob("step-*.safetensors") if (m := SNAPSHOT.match(p.name)))
    if not found:
        raise FileNotFoundError(f"no adapter snapshots in {folder} (files named step-N.safetensors, one per training piece)")
    return [(Path(run_dir).resolve().name, step, path) for step, path in found]


def variant_name(label: str, step: int) -> str:
    return f"{label}:{step}"


def column_setting(column: Column) -> Setting:
    return Setting(METHOD, 0.0, params=POLICY, model=variant_name(*column))


def steps_settings(columns: Sequence[Column]) -> list[Setting]:
    """Base Full, plain reuse, and kvlink with each snapshot's adapter."""
    return list(BASELINES) + [column_setting(c) for c in columns]


def columns_of(snaps: Sequence[Snapshot]) -> list[Column]:
    return [(label, step) for label, step, _ in snaps]


def run_steps(rag: Any, snaps: Sequence[Snapshot], examples: dict[str, list[Any]], lengths: Sequence[int], out: Path,
              progress: bool = True) -> dict[str, Any]:
    """Every set (name -> its examples) at every length, each snapshot a variant over the same store
    (resumable: records per block under OUT)."""
    from kvrag.engine import KVRag

    # the same base weights and store: links-only and lora-after adapters read the base chunk KV, one entry serves all
    variants = {variant_name(label, step): KVRag(rag.lm, store=rag.store, layout=rag.layout, check=False, link_adapter=str(path))
                for label, step, path in snaps}
    settings = steps_settings(columns_of(snaps))
    for name, items in examples.items():
        for length in lengths:
            run(rag, items, settings, out / name / f"len{length}", max_new_tokens=length, progress=progress, variants=variants)
    return collect(out, list(examples), lengths, columns_of(snaps))


def set_examples(sets: Sequence[str], data: Path, n: int | None) -> dict[str, list[Any]]:
    """The suite's held-out sets (kvrag.eval.suite.SETS), each at n questions or its own size."""
    return {name: SETS[name].build(data, n or SETS[name].n) for name in sets}


def collect(out: Path, sets: Sequence[str], lengths: Sequence[int], columns: Sequence[Column]) -> dict[str, Any]:
    """The blocks answered so far, each over the questions every setting answered (paired rows)."""
    names = {st.name for st in steps_settings(columns)}
    blocks = [{"set": name, "kind": SETS[name].kind if name in SETS else name, "length": length, "n": n,
               "rows": {r["setting"]: r for r in summarize(keep)}}
              for name, length, keep, n in paired_blocks(out, sets, lengths, names)]
    return {"columns": [list(c) for c in columns], "blocks": blocks}


def _cell(row: dict[str, Any] | None) -> str:
    return "—" if row is None else f"{row['agree']:.2f} · {row['kl']:.3f} · {row['contains']:.2f}"


def _labels(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(column title, setting name) of each snapshot column; the run's name only where there are several runs."""
    columns = [tuple(c) for c in result["columns"]]
    several = len({label for label, _ in columns}) > 1
    return [((f"{label} " if several else "") + f"step {step}", column_setting((label, step)).name) for label, step in columns]


def steps_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    labels = _labels(result)
    head = ["set", "tokens", "n", "reuse"] + [title for title, _ in labels] + ["Full contained"]
    lines = [
        "# Agreement with base Full Attention against training steps", "",
        f"`{meta.get('command', '')}`", "",
        f"hardware: {meta.get('hardware_line', '')}; model: {meta.get('model', '')}; runs: {meta.get('run', '')}; greedy.", "",
        "Each cell: agreement with base Full's answer · first-token KL to base Full · gold contained. \"reuse\" is plain "
        "reuse (no link tokens); \"step N\" is kvlink with the adapter its run had after N optimizer steps (step 0: "
        "the initial values). Both with the read-whole policies off (every context reused, as calibration measures). "
        "Every answer is paired with base Full's in the same run.", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    for b in result["blocks"]:
        rows = b["rows"]
        cells = [_cell(rows.get(BASELINES[1].name))] + [_cell(rows.get(name)) for _, name in labels]
        full = f"{rows['full']['contains']:.2f}" if "full" in rows else "—"
        lines.append(f"| {b['set']} | {b['length']} | {b['n']} | " + " | ".join(cells) + f" | {full} |")
    mean = mean_agreement(result)
    if mean:
        lines += ["", "Mean agreement over the blocks: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()) + "."]
    lines += ["", "Sets:"] + [f"- `{b['set']}`: {b['kind']}" for b in {b["set"]: b for b in result["blocks"]}.values()]
    return "\n".join(lines) + "\n"


def mean_agreement(result: dict[str, Any]) -> dict[str, float]:
    """Per column (reuse, then each snapshot), the mean over blocks of agreement with base Full."""
    out = {}
    for title, setting in [("reuse", BASELINES[1].name)] + _labels(result):
        vals = [b["rows"][setting]["agree"] for b in result["blocks"] if setting in b["rows"]]
        if vals:
            out[title] = sum(vals) / len(vals)
    return out


def plot_steps(result: dict[str, Any], path: Path) -> Path | None:
    """Mean agreement with base Full over the blocks against steps, a line per run; plain reuse dotted."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return None
    mean = mean_agreement(result)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    runs: dict[str, list[tuple[int, float]]] = {}
    for (label, step), (title, _) in zip([tuple(c) for c in result["columns"]], _labels(result)):
        if title in mean:
            runs.setdefault(label, []).append((step, mean[title]))
    for label, points in runs.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    if "reuse" in mean:
        ax.axhline(mean["reuse"], color="grey", linestyle=":", label="plain reuse")
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("mean agreement with base Full")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out: Path, meta: dict[str, Any]) -> None:
    meta = {**meta, "hardware_line": hardware_line(meta.get("hardware") or hardware())}
    (out / "steps.json").write_text(json.dumps({"meta": meta, **result, "mean_agreement": mean_agreement(result)}, indent=1, default=str))
    (out / "README.md").write_text(steps_markdown(result, meta))
    plot_steps(result, out / "steps.png")
