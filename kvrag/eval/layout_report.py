"""The layout table and the rule that picks the default layout (records from kvrag.eval.layout_eval).

The rule is the suite's: a layout replaces today's only if, under the default method, it contains the gold
answer no less often than today's less one question on EVERY set (each conversation turn is a set of its
own), and more often on average over the sets; among those that pass, the highest mean wins (ties: the
higher mean agreement with its own Full Attention). The prompt must also answer as well as the model's own
chat template over the same documents: a layout whose turn two, on any set of conversations, is right less
often than the template's less one question does not pass either. It is judged on one half of every set's rows (the
"choose" half); the chosen layout is then checked by the same rule, against today's and the template, on the
other half, which no choice was made on. A pick that does not hold there is set aside and the next that
passed is checked: the held-out half can only veto a layout, never rank them.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence

from kvrag.eval.layout_eval import CANDIDATES, CONVERSATION_SETS, REFERENCE, TODAY
from kvrag.eval.report import bootstrap_ci

HALVES = ("choose", "report", "all")


def block_name(record: dict[str, Any]) -> str:
    return f"{record['set']}, turn {record['turn']}" if record["set"] in CONVERSATION_SETS else record["set"]


def turn_two_blocks(summary: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The blocks of turn two, one per set of conversations answered (the template answers them too)."""
    return [b for b in (f"{s}, turn 2" for s in CONVERSATION_SETS) if b in summary]


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """block -> "layout|method|half" -> n, contained (count, rate, 95% interval), agreement with Full. Only rows
    every layout has answered count (a stopped run's table stays paired); an answer recorded twice (two runs
    over one folder) counts once, the first."""
    seen: set[tuple[Any, ...]] = set()
    unique = []
    for r in records:
        key = (r["set"], r["row"], r["layout"], r["method"], r["turn"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    records = unique
    layouts = {r["layout"] for r in records if r["layout"] != REFERENCE}
    rows: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in records:
        if r["layout"] != REFERENCE:
            rows[(block_name(r), r["row"])].add(f"{r['layout']}|{r['method']}")
    complete = {key for key, seen in rows.items() if len(seen) == 2 * len(layouts)}
    groups: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        block = block_name(r)
        if r["layout"] != REFERENCE and (block, r["row"]) not in complete:
            continue
        for half in (r["half"], "all"):
            groups[block][f"{r['layout']}|{r['method']}|{half}"].append(r)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for block, cells in groups.items():
        out[block] = {}
        for key, rs in cells.items():
            hits = [float(r["contains"]) for r in rs]
            agree = [float(r["agree"]) for r in rs]
            lo, hi = bootstrap_ci(hits)
            out[block][key] = {"n": len(rs), "contained": int(sum(hits)), "rate": sum(hits) / len(rs), "ci": [lo, hi],
                               "agree": sum(agree) / len(rs)}
    return out


def _cell(summary: dict[str, dict[str, Any]], layout: str, method: str, half: str) -> dict[str, Any] | None:
    return summary.get(f"{layout}|{method}|{half}")


def decide(summary: dict[str, dict[str, dict[str, Any]]], half: str = "choose", method: str = "default") -> dict[str, Any]:
    """The rule (module docstring) on one half: every candidate's verdict, those that pass best first
    (`ranked`), and the one chosen (the first)."""
    layouts = sorted({k.split("|")[0] for block in summary.values() for k in block} - {REFERENCE})
    verdicts: dict[str, dict[str, Any]] = {}
    for name in layouts:
        worse, rates, agrees = [], [], []
        for block, cells in summary.items():
            mine, today = _cell(cells, name, method, half), _cell(cells, TODAY, method, half)
            if mine is None or today is None:
                continue
            rates.append(mine["rate"])
            agrees.append(mine["agree"])
            if mine["contained"] < today["contained"] - 1:
                worse.append(f"{block}: {mine['contained']}/{mine['n']} < today's {today['contained']}/{today['n']} - 1")
            ref = _cell(cells, REFERENCE, "full", half) if block in turn_two_blocks(summary) else None
            if ref is not None and mine["contained"] < ref["contained"] - 1:
                worse.append(f"{block}: {mine['contained']}/{mine['n']} < the template's {ref['contained']}/{ref['n']} - 1")
        verdicts[name] = {"mean": sum(rates) / len(rates) if rates else 0.0, "agree": sum(agrees) / len(agrees) if agrees else 0.0,
                          "worse": worse}
    today_mean = verdicts.get(TODAY, {}).get("mean", 0.0)
    for name, v in verdicts.items():
        v["passes"] = name == TODAY or (not v["worse"] and v["mean"] > today_mean + 1e-9)
    ranked = sorted((n for n, v in verdicts.items() if v["passes"] and n != TODAY),
                    key=lambda n: (-verdicts[n]["mean"], -verdicts[n]["agree"], n))
    return {"half": half, "method": method, "chosen": ranked[0] if ranked else TODAY, "ranked": ranked, "today_mean": today_mean,
            "verdicts": verdicts}


def held_out(summary: dict[str, dict[str, dict[str, Any]]], chosen: str, method: str = "default") -> dict[str, Any]:
    """The chosen layout against today's and the template on the rows no choice was made on: does the rule still
    hold there?"""
    keep = (chosen, TODAY, REFERENCE)
    verdict = decide({b: {k: v for k, v in cells.items() if k.split("|")[0] in keep} for b, cells in summary.items()},
                     half="report", method=method)
    v = verdict["verdicts"].get(chosen, {})
    return {"chosen": chosen, "holds": chosen == TODAY or bool(v.get("passes")), "mean": v.get("mean", 0.0),
            "today_mean": verdict["today_mean"], "worse": v.get("worse", [])}


def choose(summary: dict[str, dict[str, dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """The rule's pick on the choose half, checked on the report half; a pick that does not hold there is set
    aside and the next that passed is checked (the report half only vetoes, it never ranks). Returns the
    choice, its held-out check and the checks of those set aside."""
    choice = decide(summary)
    aside = []
    for name in choice["ranked"]:
        check = held_out(summary, name)
        if check["holds"]:
            return {**choice, "chosen": name}, check, aside
        aside.append(check)
    return {**choice, "chosen": TODAY}, held_out(summary, TODAY), aside


def versus_template(summary: dict[str, dict[str, dict[str, Any]]], layout: str) -> dict[str, dict[str, Any]]:
    """Turn two (every conversation) of a layout under the default method against the model's own chat template,
    per set of conversations."""
    out = {}
    for block in turn_two_blocks(summary):
        cells = summary[block]
        mine, ref = _cell(cells, layout, "default", "all"), _cell(cells, REFERENCE, "full", "all")
        if mine is not None and ref is not None:
            out[block] = {"layout": layout, "turn2": mine["contained"], "template_turn2": ref["contained"], "n": mine["n"],
                          "within_one_in_30": mine["rate"] >= ref["rate"] - 1 / 30 - 1e-9}
    return out


def _fmt(c: dict[str, Any] | None, ci: bool = True) -> str:
    if c is None:
        return "–"
    text = f"{c['contained']}/{c['n']}"
    return text + (f" [{c['ci'][0]:.2f}–{c['ci'][1]:.2f}]" if ci else "")


def markdown(summary: dict[str, dict[str, dict[str, Any]]], choice: dict[str, Any], check: dict[str, Any],
             vs: dict[str, Any], meta: dict[str, Any], aside: Sequence[dict[str, Any]] = ()) -> str:
    layouts = [n for n in CANDIDATES if any(f"{n}|full|all" in cells for cells in summary.values())]
    chosen = choice["chosen"]
    lines = [
        "# kvrag eval layout: where the documents go, the instruction, the chunk header, the question template", "",
        f"`{meta.get('command', '')}`", "",
        f"Machine: {meta.get('hardware_line', '')}; model: {meta.get('model', '')}; greedy, {meta.get('max_new_tokens')} new tokens "
        f"at most; {meta.get('size', '')}. \"contained\" = the normalised gold answer appears in the answer (k/n, 95% bootstrap "
        "interval of the rate); agreement = the same answer as Full Attention over the same layout's prompt. \"default\" is the "
        f"training-free reuse default ({meta.get('default_method', '')}, not a model's calibrated choice, which may be Full; contexts under its short-context limit are read whole, "
        "so there it is Full Attention). Conversations: turn two follows the layout's own turn one; `template` is the model's "
        "own chat template over the same documents in a system message (`tokenizer.apply_chat_template`, Full Attention). "
        "`conversations`: each over its own document and two others; `conversations-index`: each turn over the top 3 it "
        "retrieves from one index of all 16 documents (turn two with the user turns so far, as `kvrag serve` retrieves).", "",
        *[f"Passed the rule on the choose half but set aside, not holding on the held-out half: `{a['chosen']}` "
          f"({'; '.join(a['worse']) or 'no better on average than today'})." for a in aside],
        *([""] if aside else []),
        f"**Chosen by the rule on the choose half: `{chosen}`**; on the held-out half it "
        + ("holds" if check["holds"] else "does NOT hold")
        + f" (mean contained {check['mean']:.3f} vs today's {check['today_mean']:.3f}"
        + (f"; {'; '.join(check['worse'])}" if check["worse"] else "") + ").", "",
    ]
    for block, v in vs.items():
        lines += [f"{block[:-len(', turn 2')]}: turn two over every conversation, `{chosen}` (default method) {v['turn2']}/{v['n']} vs "
                  f"the model's own template {v['template_turn2']}/{v['n']}: "
                  + ("within one in 30." if v["within_one_in_30"] else "NOT within one in 30."), ""]
    lines += ["## The rule, choose half (default method)", "", "| layout | mean contained | passes | why not |", "|---|---|---|---|"]
    for name in layouts:
        v = choice["verdicts"].get(name, {})
        lines.append(f"| `{name}` | {v.get('mean', 0):.3f} | {'reference' if name == TODAY else 'yes' if v.get('passes') else 'no'} | {'; '.join(v.get('worse', [])) or ''} |")
    lines += ["", "## Held-out half: chosen against today's", "", f"| set | `{TODAY}` default | `{chosen}` default | `{TODAY}` Full | `{chosen}` Full |",
              "|---|---|---|---|---|"]
    for block, cells in summary.items():
        lines.append(f"| {block} | {_fmt(_cell(cells, TODAY, 'default', 'report'))} | {_fmt(_cell(cells, chosen, 'default', 'report'))} "
                     f"| {_fmt(_cell(cells, TODAY, 'full', 'report'))} | {_fmt(_cell(cells, chosen, 'full', 'report'))} |")
    for method, title in (("default", "default method"), ("full", "Full Attention")):
        lines += ["", f"## Every row, {title}: contained", "", "| set | " + " | ".join(f"`{n}`" for n in layouts)
                  + (" | `template` |" if method == "full" else " |"), "|---|" + "---|" * (len(layouts) + (method == "full"))]
        for block, cells in summary.items():
            row = [_fmt(_cell(cells, n, method, "all")) for n in layouts]
            if method == "full":
                row.append(_fmt(_cell(cells, REFERENCE, "full", "all")))
            lines.append(f"| {block} | " + " | ".join(row) + " |")
    lines += ["", "## Every row, default method: agreement with the same layout's Full Attention", "",
              "| set | " + " | ".join(f"`{n}`" for n in layouts) + " |", "|---|" + "---|" * len(layouts)]
    for block, cells in summary.items():
        lines.append(f"| {block} | " + " | ".join(f"{c['agree']:.2f}" if (c := _cell(cells, n, "default", "all")) else "–" for n in layouts) + " |")
    lines += ["", "Layouts:", ""] + [f"- `{n}`: `{CANDIDATES[n].describe()}`" for n in layouts]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict[str, dict[str, Any]]], path: Path) -> Path | None:
    from kvrag.eval.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    blocks = list(summary)
    layouts = [n for n in CANDIDATES if any(f"{n}|default|all" in summary[b] for b in blocks)]
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(blocks)), 4.5))
    width = 0.8 / max(1, len(layouts))
    for j, name in enumerate(layouts):
        vals = [(summary[b].get(f"{name}|default|all") or {}).get("rate", 0.0) for b in blocks]
        ax.bar([i + j * width for i in range(len(blocks))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(blocks))])
    ax.set_xticklabels(blocks, fontsize=7)
    ax.set_ylabel("answer contained (default method)")
    ax.set_title("kvrag eval layout: every set, every candidate layout")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(records: Sequence[dict[str, Any]], out: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """layout.json, layout.md (and layout.png) under OUT; returns the verdicts."""
    from kvrag.eval.report import hardware_line
    from kvrag.eval.runner import hardware

    summary = summarise(records)
    choice, check, aside = choose(summary)
    vs = versus_template(summary, choice["chosen"])
    meta = {**meta, "hardware_line": hardware_line(meta.get("hardware") or hardware())}
    result = {"meta": meta, "choice": choice, "held_out": check, "set_aside": aside, "versus_template": vs, "summary": summary}
    (out / "layout.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    png = plot(summary, out / "layout.png")
    md = markdown(summary, choice, check, vs, meta, aside) + (f"\n![contained per set]({png.name})\n" if png else "")
    (out / "layout.md").write_text(md, encoding="utf-8")
    return result
