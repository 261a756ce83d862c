"""How much prompt-lookup drafting (kvrag.decode.draft) speeds decoding on real questions, and that it
changes no answer.

The decode benchmark's own prompts are filler records an answer copies from readily; real questions
copy less. Here each question of several kinds (the eval suite's sets: NQ passages, multi-hop,
key-value lookups, the bundled sample) is answered with the default method twice, with the default
drafts and with none, in alternating order, to a fixed length without a stop rule (the longer the
answer, the more chances to part): the same text both ways, and the decode rate of each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from kvrag.kv.prefix_cache import without_prefix_cache
from kvrag.defaults import DEFAULT_DRAFT_TOKENS

DRAFT_SETS = ("sample", "nq10", "musique", "kv75")


@without_prefix_cache
def draft_speed(rag: Any, data: Path, sets: Sequence[str] = DRAFT_SETS, n: int = 8, new_tokens: int = 64) -> dict[str, Any]:
    """Per set: questions, answers the same with and without drafts, decode tok/s of each (tokens over
    decode time, summed over the set), and tokens per forward with drafts."""
    from kvrag.eval.suite import SETS

    rows, skipped = [], []
    for name in sets:
        try:
            examples = SETS[name].build(data, n)
        except OSError as err:  # a dev set not on this machine
            skipped.append(f"{name}: {err}")
            continue
        totals = {"on": [0, 0.0, 0, 0], "off": [0, 0.0, 0, 0]}  # tokens, decode s, forwards, served drafts
        same = 0
        for i, ex in enumerate(examples):
            rag.precompute(ex.chunks, progress=False)
            texts = {}
            for key in (("on", "off") if i % 2 == 0 else ("off", "on")):
                k = DEFAULT_DRAFT_TOKENS if key == "on" else 0
                ans = rag.answer(ex.question, chunks=ex.chunks, max_new_tokens=new_tokens, stop_at="none", draft_tokens=k)
                s, t = ans.stats, totals[key]
                t[0] += max(0, s.generated_tokens - 1)  # the first token is the prefill's
                t[1] += s.decode_s
                t[2] += s.decode_forwards
                t[3] += s.draft_accepted
                texts[key] = ans.text
            same += texts["on"] == texts["off"]
        on, off = totals["on"], totals["off"]
        rows.append({"set": name, "kind": SETS[name].kind, "questions": len(examples), "same_answers": same,
                     "tok_s_drafts": round(on[0] / on[1], 2) if on[1] else 0.0,
                     "tok_s_none": round(off[0] / off[1], 2) if off[1] else 0.0,
                     "tokens_per_forward": round(on[0] / on[2], 2) if on[2] else 0.0,
                     "drafts_served": on[3]})
    return {"new_tokens": new_tokens, "draft_tokens": DEFAULT_DRAFT_TOKENS, "rows": rows, "skipped": skipped}


def draft_markdown(result: dict[str, Any]) -> list[str]:
    """The table's lines (kvrag.eval.decode_speed puts them under its own)."""
    lines = [
        "", f"**Drafts on real questions**: each question answered with the default method to {result['new_tokens']} tokens "
        f"(no stop rule) with {result['draft_tokens']} drafts a step (the default) and with none, in alternating order; "
        "decode tok/s = tokens after the first over decode time, summed over the set.", "",
        "| set | questions | same answer with and without | tok/s, drafts | tok/s, none | × | tokens per forward |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ratio = r["tok_s_drafts"] / r["tok_s_none"] if r["tok_s_none"] else 0.0
        lines.append(f"| {r['set']} ({r['kind']}) | {r['questions']} | **{r['same_answers']} of {r['questions']}** | "
                     f"**{r['tok_s_drafts']:.1f}** | {r['tok_s_none']:.1f} | {ratio:.2f}× | {r['tokens_per_forward']:.2f} |")
    for s in result["skipped"]:
        lines.append(f"\nskipped {s}")
    return lines
