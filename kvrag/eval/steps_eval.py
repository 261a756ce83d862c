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

from kvrag.eval.report import hardware_line, load_records, summarize
from kvrag.eval.runner import Setting, hardware, run
from kvrag.eval.suite import SETS

SNAPSHOT = re.compile(r"^step-(\d+)\.safetensors$")
BASELINES = (Setting("full"), Setting("reuse"))


def snapshots(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's adapter snapshots, by step: RUN/snaps/step-N.safetensors."""
    folder = Path(run_dir) / "snaps"
    found = sorted((int(m.group(1)), p) for p in folder.glob("step-*.safetensors") if (m := SNAPSHOT.match(p.name)))
    if not found:
        raise FileNotFoundError(f"no adapter snapshots in {folder} (files named step-N.safetensors, one per training piece)")
    return found


def variant_name(step: int) -> str:
    return f"step{step}"


def steps_settings(steps: Sequence[int], method: str = "kvlink") -> list[Setting]:
    """Base Full, plain reuse, and the method with each snapshot's adapter."""
    return list(BASELINES) + [Setting(method, 0.0, model=variant_name(s)) for s in steps]


def run_steps(rag: Any, snaps: Sequence[tuple[int, Path]], examples: dict[str, list[Any]], lengths: Sequence[int], out: Path,
              progress: bool = True) -> dict[str, Any]:
    """Every set (name -> its examples) at every length, each snapshot a variant over the same store
    (resumable: records per block under OUT)."""
    from kvrag.engine import KVRag

    # the same weights and store (links-only adapters leave the chunk KV as it is): one chunk entry serves all
    variants = {variant_name(step): KVRag(rag.lm, store=rag.store, layout=rag.layout, check=False, link_adapter=str(path))
                for step, path in snaps}
    settings = steps_settings([s for s, _ in snaps])
    for name, items in examples.items():
        for length in lengths:
            run(rag, items, settings, out / name / f"len{length}", max_new_tokens=length, progress=progress, variants=variants)
    return collect(out, list(examples), lengths, [s for s, _ in snaps])


def set_examples(sets: Sequence[str], data: Path, n: int | None) -> dict[str, list[Any]]:
    """The suite's held-out sets (kvrag.eval.suite.SETS), each at n questions or its own size."""
    return {name: SETS[name].build(data, n or SETS[name].n) for name in sets}


def collect(out: Path, sets: Sequence[str], lengths: Sequence[int], steps: Sequence[int]) -> dict[str, Any]:
    """The blocks answered so far, each over the questions every setting answered (paired rows)."""
    names = {st.name for st in steps_settings(steps)}
    blocks = []
    for name in sets:
        for length in lengths:
            path = out / name / f"len{length}" / "records.jsonl"
            if not path.is_file():
                continue
            records = [r for r in load_records(path) if r["setting"] in names]
            per_example: dict[str, set[str]] = {}
            for r in records:
                per_example.setdefault(r["example"], set()).add(r["setting"])
            done = {ex for ex, got in per_example.items() if got == names}
            keep = [r for r in records if r["example"] in done]
            if keep:
                rows = {r["setting"]: r for r in summarize(keep)}
                kind = SETS[name].kind if name in SETS else name
                blocks.append({"set": name, "kind": kind, "length": length, "n": len(done), "rows": rows})
    return {"steps": list(steps), "blocks": blocks}


def _cell(row: dict[str, Any] | None) -> str:
    return "—" if row is None else f"{row['agree']:.2f} · {row['kl']:.3f} · {row['contains']:.2f}"


def steps_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    steps = result["steps"]
    head = ["set", "tokens", "n", "reuse"] + [f"step {s}" for s in steps] + ["Full contained"]
    lines = [
        "# Agreement with base Full Attention against training steps", "",
        f"`{meta.get('command', '')}`", "",
        f"hardware: {meta.get('hardware_line', '')}; model: {meta.get('model', '')}; run: {meta.get('run', '')}; greedy.", "",
        "Each cell: agreement with base Full's answer · first-token KL to base Full · gold contained. \"reuse\" is plain "
        "reuse (no link tokens); \"step N\" is kvlink with the adapter the run had after N optimizer steps (step 0: "
        "the link embeddings' initial values). Every answer is paired with base Full's in the same run.", "",
        "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
    ]
    for b in result["blocks"]:
        rows = b["rows"]
        cells = [_cell(rows.get("reuse"))] + [_cell(rows.get(Setting("kvlink", 0.0, model=variant_name(s)).name)) for s in steps]
        full = f"{rows['full']['contains']:.2f}" if "full" in rows else "—"
        lines.append(f"| {b['set']} | {b['length']} | {b['n']} | " + " | ".join(cells) + f" | {full} |")
    mean = mean_agreement(result)
    if mean:
        lines += ["", "Mean agreement over the blocks: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()) + "."]
    lines += ["", "Sets:"] + [f"- `{b['set']}`: {b['kind']}" for b in {b["set"]: b for b in result["blocks"]}.values()]
    return "\n".join(lines) + "\n"


def mean_agreement(result: dict[str, Any]) -> dict[str, float]:
    """Per column (reuse, then each step), the mean over blocks of agreement with base Full."""
    cols = {"reuse": "reuse"} | {f"step {s}": Setting("kvlink", 0.0, model=variant_name(s)).name for s in result["steps"]}
    out = {}
    for label, setting in cols.items():
        vals = [b["rows"][setting]["agree"] for b in result["blocks"] if setting in b["rows"]]
        if vals:
            out[label] = sum(vals) / len(vals)
    return out


def plot_steps(result: dict[str, Any], path: Path) -> Path | None:
    """Agreement against steps, a line per block, plain reuse as a dotted line of the same colour."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return None
    steps = result["steps"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for b in result["blocks"]:
        ys = [b["rows"].get(Setting("kvlink", 0.0, model=variant_name(s)).name, {}).get("agree") for s in steps]
        line = ax.plot(steps, ys, marker="o", label=f"{b['set']}/{b['length']}")[0]
        if "reuse" in b["rows"]:
            ax.axhline(b["rows"]["reuse"]["agree"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("agreement with base Full")
    ax.set_title("kvlink (distilled links) vs plain reuse (dotted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out: Path, meta: dict[str, Any]) -> None:
    meta = {**meta, "hardware_line": hardware_line(meta.get("hardware") or hardware())}
    (out / "steps.json").write_text(json.dumps({"meta": meta, **result, "mean_agreement": mean_agreement(result)}, indent=1, default=str))
    (out / "README.md").write_text(steps_markdown(result, meta))
    plot_steps(result, out / "steps.png")
