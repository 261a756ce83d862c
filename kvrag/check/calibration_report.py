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
    ]
    rule = result.get("rule") or {}
    if rule.get("by") == "right":
        lines.append(f"Full Attention answered {rule.get('full_right')} right; a setting must keep at least "
                     f"{rule.get('full_right', 0) - rule.get('may_lose', 0)} of them and answer {rule.get('right_needed')} right in all")
    search = result.get("ape_search")
    if isinstance(search, dict):
        lines.append(f"APE search ({search.get('method')}, {search.get('questions')} questions, answer KL to Full): "
                     f"T={search.get('temperature'):g} S={search.get('scale'):g} at {search.get('kl'):.4f}, "
                     f"plain {search.get('plain_kl')}")
    lines.append(f"{'setting':<26} {'right':>6} {'kept':>6} {'same as Full':>12} {'first-token KL':>15} {'TTFT Full/setting':>18}  verdict")
    for r in result.get("settings", []):
        if r.get("status") == "skipped":
            lines.append(f"{r['setting']:<26} {'':>6} {'':>6} {'':>12} {'':>15} {'':>18}  skipped: {r.get('note', '')}")
            continue
        verdict = r["status"] if r["status"] == "passed" or r["asked"] == result.get("questions") else f"{r['status']} (dropped early)"
        same = f"{r['same']}/{r['asked']}" if r["asked"] else "-"
        decoded = bool(r["asked"])  # a setting dropped on its speed alone was never decoded: nothing to count
        right, kept = (str(r.get("right", "-")), str(r.get("kept", "-"))) if decoded else ("-", "-")
        lines.append(f"{r['setting']:<26} {right:>6} {kept:>6} {same:>12} {r['kl']:>15.3f} "
                     f"{r['ttft_ratio']:>17.2f}x  {verdict}")
    chosen = setting_of(result)
    lines.append(f"default: {chosen.name}: {chosen.why}")
    adapter = result.get("adapter")
    if isinstance(adapter, dict):
        other = setting_of(result, "")
        lines.append(f"kvlink was measured with the {adapter.get('mode', '?')} adapter {str(adapter.get('digest', ''))[:12]} "
                     f"({adapter.get('objective') or 'objective not recorded'}); an engine without it gets {other.name}")
    return "\n".join(lines)
