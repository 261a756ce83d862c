"""A calibration result as people read it: one line per setting, then the choice and why (no torch)."""

from __future__ import annotations

from typing import Any

from kvrag.check.calibration_store import setting_of


def calibration_table(result: dict[str, Any]) -> str:
    """Every setting's agreement with Full Attention, first-token KL and TTFT ratio, then the default."""
    tokens = ", ".join(str(t) for t in result.get("context_tokens", []))
    seconds, yardstick = result.get("seconds", 0), max(result.get("full_ttft_s") or [0])
    took = f"{seconds:.0f} s" + (f" (the time of {seconds / yardstick:.0f} Full prefills of the longest context)" if yardstick else "")
    lines = [
        f"calibration on {result.get('device', '?')} ({result.get('dtype', '?')}): {result.get('questions', '?')} questions over "
        f"{result.get('contexts', '?')} contexts ({tokens} chunk tokens), {result.get('new_tokens', '?')} new tokens, {took}",
        f"{'setting':<16} {'same as Full':>12} {'first-token KL':>15} {'TTFT Full/setting':>18}  verdict",
    ]
    for r in result.get("settings", []):
        if r.get("status") == "skipped":
            lines.append(f"{r['setting']:<16} {'':>12} {'':>15} {'':>18}  skipped: {r.get('note', '')}")
            continue
        verdict = r["status"] if r["status"] == "passed" or r["asked"] == result.get("questions") else f"{r['status']} (dropped early)"
        same = f"{r['same']}/{r['asked']}" if r["asked"] else "-"
        lines.append(f"{r['setting']:<16} {same:>12} {r['kl']:>15.3f} "
                     f"{r['ttft_ratio']:>17.2f}x  {verdict}")
    chosen = setting_of(result)
    lines.append(f"default: {chosen.name}: {chosen.why}")
    return "\n".join(lines)
