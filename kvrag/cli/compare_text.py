"""How `kvrag ask --compare` words a method's time to first token beside Full Attention's (issue 70, item 3).

Two figures misled a newcomer: "0.9x sooner" for an answer that came later, and a ratio between two settings that
read the same tokens whole (the same computation: the ratio is run-to-run noise). So a slower answer is called
slower, by how much; a difference within NOISE is "about as soon"; and a setting whose read-whole policy made it
compute the context as Full Attention does is "read whole: the same as Full", with no ratio at all.
"""

from __future__ import annotations

from typing import Any

NOISE = 1.05  # ratios within 5% either way are not told apart: TTFTs of the same work vary that much run to run


def first_token_phrase(ttft_s: float, full_ttft_s: float) -> str:
    """"2.3x sooner", "1.4x slower" or "about as soon as Full Attention", to the first token, with both times."""
    times = f"({ttft_s * 1000:.0f} ms vs {full_ttft_s * 1000:.0f} ms)"
    ratio = full_ttft_s / max(ttft_s, 1e-9)
    if ratio >= NOISE:
        return f"{ratio:.1f}x sooner to the first token {times}"
    if ratio <= 1 / NOISE:
        return f"{1 / ratio:.1f}x slower to the first token {times}"
    return f"about as soon as Full Attention to the first token {times}"


def same_as_full(row: Any) -> bool:
    """Whether this setting read the context whole, as Full Attention does: the same tokens, the same work."""
    return bool(getattr(row, "read_whole", False))


def compare_line(mine: Any, full: Any) -> str:
    """The line under `ask --compare`'s answer: the speed (or "read whole: the same as Full") and the verdict.
    `mine` and `full`: kvrag.cli.ask.Comparison rows of the method asked for and of Full Attention."""
    verdict = "the same answer as Full Attention" if mine.agrees else f"DIFFERS from Full Attention's: {full.text}"
    if same_as_full(mine):
        speed = (f"read whole: the same as Full ({mine.context_tokens} chunk tokens computed whole, as Full Attention "
                 "computes them: no speed-up to show)")
    else:
        speed = first_token_phrase(mine.ttft_s, full.ttft_s)
    return f"vs Full Attention: {speed}; {verdict} (first-token KL {mine.kl:.3f})"


def compare_json(row: Any) -> dict[str, Any]:
    """`ask --compare --json`'s row: the speed-up is null where the setting read whole (the same as Full)."""
    out = dict(row.as_dict())
    out["same_as_full"] = same_as_full(row) or row.agrees is None
    if same_as_full(row):
        out["speedup"] = None
    return out
