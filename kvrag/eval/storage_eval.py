"""`kvrag eval storage`: which precision a store should keep KV at, decided by answers, not by bytes.

Every suite set (`kvrag.eval.suite.SETS`) is answered by the methods that read stored KV the most
(the default method with its read-whole policies off, and plain reuse) from three stores of the same
model: float32 as computed ("none"), bfloat16 and int8. Each answer is compared with the same
setting's answer from the float32 store (agreement: the same text after normalising) and with the
gold answers; the bytes a token and a chunk take on disk are measured from the stores themselves.

The rule: the smallest precision whose answers equal float32 storage's on at least AGREE_FLOOR of the
questions of every set, and whose gold-answer rate is nowhere below float32 storage's by more than
one binomial standard error, is the one to ship as the disk default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from kvrag.cache_backends.format import stored_bytes_per_token
from kvrag.eval.report import load_records
from kvrag.eval.runner import Setting, hardware, run
from kvrag.eval.suite import RAW, SETS
from kvrag.options import DEFAULT_METHOD, DEFAULT_RATIO

PRECISIONS = ("none", "bf16", "int8")  # widest first: "none" is the reference
AGREE_FLOOR = 0.9


def storage_settings(precisions: Sequence[str] = PRECISIONS) -> list[Setting]:
    """The default method alone (policies off: it reads every chunk from the store) and plain reuse, once
    per store precision (a model variant named after it; "" is float32 storage)."""
    out: list[Setting] = [Setting("full")]
    for p in precisions:
        model = "" if p == "none" else p
        out += [Setting(DEFAULT_METHOD, DEFAULT_RATIO, params=RAW, model=model), Setting("reuse", model=model)]
    return out


def _variant_name(setting_name: str) -> tuple[str, str]:
    """'fusionrag@0.15[...]{bf16}' -> ('fusionrag@0.15[...]', 'bf16')."""
    if setting_name.endswith("}") and "{" in setting_name:
        base, _, model = setting_name[:-1].rpartition("{")
        return base, model
    return setting_name, "none"


def _entry_sizes(root: Path) -> tuple[int, int]:
    """(files, bytes) of the entry files under a disk store's root (never following links)."""
    files = total = 0
    entries = root / "entries"
    if entries.is_dir():
        for path in entries.rglob("*"):
            if path.is_file() and not path.is_symlink():
                files += 1
                total += path.stat().st_size
    return files, total


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per setting and precision: agreement with float32 storage's answer, gold contained, n."""
    answers: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in records:
        base, precision = _variant_name(r["setting"])
        answers[(r["example"], base, precision)] = r
    out: dict[str, dict[str, Any]] = {}
    for (example, base, precision), r in answers.items():
        if base == "full":
            continue
        ref = answers.get((example, base, "none"))
        if ref is None:
            continue
        row = out.setdefault(f"{base}|{precision}", {"setting": base, "precision": precision, "n": 0, "agree_fp32": 0,
                                                     "contains": 0, "agree_full": 0, "ttft_ratios": []})
        row["n"] += 1
        row["ttft_ratios"].append(ref["ttft_s"] / max(r["ttft_s"], 1e-9))
        row["agree_fp32"] += int(_same(r["answer"], ref["answer"]))
        row["contains"] += r["contains"]
        row["agree_full"] += r["agree"]
    for row in out.values():
        n = max(1, row["n"])
        ratios = sorted(row.pop("ttft_ratios"))
        row.update(agree_fp32=row["agree_fp32"] / n, contains=row["contains"] / n, agree_full=row["agree_full"] / n,
                   ttft_vs_fp32=ratios[len(ratios) // 2] if ratios else 1.0)  # median, paired per question
    return out


def _same(a: str, b: str) -> bool:
    from kvrag.eval.metrics import agreement

    return bool(agreement(a, b))


def choose(blocks: dict[str, dict[str, dict[str, Any]]], precisions: Sequence[str] = PRECISIONS) -> tuple[str, list[str]]:
    """The rule (module docstring): the narrowest precision that holds on every set; and why each other failed."""
    notes: list[str] = []
    chosen = "none"
    for p in precisions[1:]:
        failed = []
        for name, rows in blocks.items():
            for key, row in rows.items():
                if row["precision"] != p:
                    continue
                ref = rows.get(f"{row['setting']}|none")
                se = math.sqrt(max(ref["contains"] * (1 - ref["contains"]), 1e-9) / max(1, ref["n"])) if ref else 0.0
                if row["agree_fp32"] < AGREE_FLOOR:
                    failed.append(f"{name} {row['setting']}: same answer as float32 storage {row['agree_fp32']:.2f} < {AGREE_FLOOR}")
                elif ref and row["contains"] < ref["contains"] - se:
                    failed.append(f"{name} {row['setting']}: gold {row['contains']:.2f} < float32's {ref['contains']:.2f} - SE")
        if failed:
            notes.append(f"{p}: not chosen ({'; '.join(failed)})")
        else:
            chosen = p
            notes.append(f"{p}: holds on every set")
    return chosen, notes


def store_url(out: Path, precision: str) -> str:
    return f"disk://{(out / f'kv-{precision}').resolve()}?quantize={precision}&max_bytes=none"


def run_storage(rag: Any, sets: Sequence[str], length: int, out: Path, data: Path, n: int | None,
                progress: bool = True) -> dict[str, Any]:
    """Answer every set from a store of each precision under OUT/kv-<precision> (`rag` holds float32
    storage's, `store_url(out, "none")`), then summarise."""
    from kvrag.engine import KVRag

    lm = rag.lm
    engines = {"none": rag}
    engines.update({p: KVRag(lm, store=store_url(out, p), layout=rag.layout, check=False, link_adapter="links")
                    for p in PRECISIONS[1:]})
    variants = {p: e for p, e in engines.items() if p != "none"}
    blocks: dict[str, dict[str, dict[str, Any]]] = {}
    for name in sets:
        spec = SETS[name]
        examples = spec.build(data, n or spec.n)
        folder = out / name / f"len{length}"
        run(engines["none"], examples, storage_settings(), folder, max_new_tokens=length, progress=progress,
            variants=variants)
    return report(out, sets, length, lm.model.config, lm.dtype, getattr(lm, "source", ""))


def report(out: Path, sets: Sequence[str], length: int, config: Any, dtype: Any, model: str) -> dict[str, Any]:
    """The table of what OUT holds (no model needed: the configuration sizes the KV)."""
    from kvrag.kv.projection import kv_shape

    blocks = {name: summarise(load_records(out / name / f"len{length}" / "records.jsonl")) for name in sets
              if (out / name / f"len{length}" / "records.jsonl").is_file()}
    layers, heads, head_dim = kv_shape(config)
    element = dtype.itemsize
    sizes = {}
    for p in PRECISIONS:
        files, total = _entry_sizes(out / f"kv-{p}")
        sizes[p] = {"bytes_per_token": stored_bytes_per_token(layers, heads, head_dim, element, p),
                    "entries": files, "mean_entry_bytes": total / files if files else 0.0}
    chosen, notes = choose(blocks)
    return {"blocks": blocks, "sizes": sizes, "chosen": chosen, "notes": notes, "length": length,
            "model": model, "dtype": str(dtype).replace("torch.", ""), "hardware": hardware()}


def markdown(result: dict[str, Any]) -> str:
    sizes = result["sizes"]
    lines = [f"# KV storage precision ({result['model']}, computed in {result['dtype']}, answers of {result['length']} tokens)", "",
             "| precision | bytes a token | mean entry (a chunk) on disk | entries |", "|---|---|---|---|"]
    for p, s in sizes.items():
        lines.append(f"| {p if p != 'none' else 'float32 (as computed)'} | {s['bytes_per_token']:,.0f} | "
                     f"{s['mean_entry_bytes'] / 1e6:.2f} MB | {s['entries']} |")
    lines += ["", "Same answer as float32 storage (gold contained; median TTFT speed-up over float32 storage, paired "
              "per question), per set and setting:", "",
              "| set | setting | n | " + " | ".join(PRECISIONS) + " |", "|---|---|---|" + "---|" * len(PRECISIONS)]
    for name, rows in result["blocks"].items():
        for setting in sorted({r["setting"] for r in rows.values()}):
            cells = []
            for p in PRECISIONS:
                r = rows.get(f"{setting}|{p}")
                cells.append("-" if r is None else f"{r['agree_fp32']:.2f} (gold {r['contains']:.2f}; {r['ttft_vs_fp32']:.2f}x)")
            n = rows.get(f"{setting}|none", {}).get("n", 0)
            lines.append(f"| {name} | {setting} | {n} | " + " | ".join(cells) + " |")
    lines += ["", f"**Chosen: {result['chosen']}** (rule: the narrowest precision whose answers equal float32 storage's on "
              f">= {AGREE_FLOOR:.0%} of every set's questions, gold rate within one standard error).", ""]
    lines += [f"- {n}" for n in result["notes"]]
    hw = result["hardware"]
    lines += ["", f"Hardware: {hw.get('cpu', hw.get('machine'))}, {hw.get('threads')} threads, torch {hw.get('torch')}."]
    if result.get("command"):
        lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines + [""])


def plot(result: dict[str, Any], path: Path) -> Path | None:
    from kvrag.eval.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    names = list(result["blocks"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 3.5))
    width = 0.8 / len(PRECISIONS[1:])
    for i, p in enumerate(PRECISIONS[1:]):
        vals = [result["blocks"][n].get(f"{DEFAULT_METHOD}@{DEFAULT_RATIO:g}[{','.join(f'{k}={v}' for k, v in RAW)}]|{p}", {})
                .get("agree_fp32", 0.0) for n in names]
        ax.bar([x + i * width for x in range(len(names))], vals, width, label=p)
    ax.axhline(AGREE_FLOOR, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([x + width / 2 for x in range(len(names))], names)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("same answer as float32 storage")
    ax.set_title(f"{DEFAULT_METHOD} (policies off), answers of {result['length']} tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out: Path) -> None:
    (out / "storage.json").write_text(json.dumps(result, indent=1))
    (out / "storage.md").write_text(markdown(result))
    plot(result, out / "storage.png")
