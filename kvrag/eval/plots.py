"""PNG plots of benchmark results: quality vs recompute ratio, and TTFT vs context length.

matplotlib is an optional dependency (`pip install "kvrag[bench]"`); without it the plots are
skipped with a note and the JSON/markdown results are still written.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Sequence


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print('note: plots skipped (pip install "kvrag[bench]" for matplotlib)', file=sys.stderr)
        return None


def quality_vs_ratio(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Per method: agreement with Full Attention and normalised task score against the recompute ratio.

    Ratio 0 is Full Reuse and ratio 1 is Full Attention, the two ends every method lies between
    (the picture of FusionRAG's Fig. 2).
    """
    plt = _pyplot()
    if plt is None:
        return None
    by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
    ends = {r["setting"]: r for r in rows if r["setting"] in ("full", "reuse")}
    for r in rows:
        if r["method"] not in ("full", "reuse") and r.get("kv_kind", "chunk") == "chunk" and not r.get("model"):
            by_method[r["method"]].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "agree", "answer agreement with Full Attention"), (axes[1], "normalized", "normalised task score")):
        for method, rs in sorted(by_method.items()):
            pts = sorted((r["ratio"], r[key]) for r in rs)
            if "reuse" in ends:
                pts.insert(0, (0.0, ends["reuse"][key]))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        if "full" in ends:
            ax.axhline(ends["full"][key], color="black", linestyle="--", linewidth=1, label="Full Attention")
        if "reuse" in ends:
            ax.axhline(ends["reuse"][key], color="grey", linestyle=":", linewidth=1, label="Full Reuse")
        ax.set_xlabel("recompute ratio")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_vs_context(points: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """Median TTFT per setting against context length (log-log), one line per setting."""
    plt = _pyplot()
    if plt is None:
        return None
    by_setting: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for p in points:
        by_setting[p["setting"]].append((p["context_tokens"], p["ttft_s"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    for setting, pts in by_setting.items():
        pts.sort()
        style = {"color": "black", "linestyle": "--"} if setting == "full" else {}
        ax.plot([x for x, _ in pts], [y * 1000 for _, y in pts], marker="o", label=setting, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT ms (median)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
