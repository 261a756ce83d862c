"""APE's temperature and scale, chosen per model on the calibration set (kvrag.check.calibrate).

APE's authors search T and S in 0.1 steps on a small validation set and note that results are sensitive to
them. What is compared here is the whole answer, not its first token: on the bundled model the first token
of plain reuse is mostly Full Attention's already and the loss is in the tokens after it. So Full Attention
answers each question greedily (`FullTrace`: its tokens and its log-probs at every position), and each
(T, S) of the grid reads the same prompt by plain reuse with APE and is fed Full's answer (teacher-forced):
the score is the mean KL(Full || setting) over the answer's positions, first token included. The grid point
with the lowest mean wins; T = S = 1 (plain reuse) is in the grid, so APE is only chosen where it helps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvrag.core import KVRagCore
from kvrag.defaults import Ape
from kvrag.model.ape import decoding_with
from kvrag.model.cache import cache_arg

TEMPERATURES = (0.7, 0.8, 0.9, 1.0)
SCALES = (0.9, 1.0)  # the probe here: S < 1 helped on the calibration set and hurt on NQ (research/faithful-reuse.md)
SEARCH_QUESTIONS = 16  # the first questions of the calibration set (every context among them)
TRACE_TOKENS = 16


@dataclass
class FullTrace:
    """Full Attention's greedy answer to one prompt, and its log-probs before each answer token."""

    tokens: list[int]  # the answer's tokens (up to the end of turn, which is not among them)
    logp: torch.Tensor  # [len(tokens) + 1, vocab] float32: before the first answer token, then after each


def _forward(core: KVRagCore, pre: Any, tokens: Sequence[int], fed: int = 0) -> torch.Tensor:
    """Log-probs [len(tokens), vocab] after each of `tokens` fed after a prefill (with its APE, if any) and
    the `fed` tokens already fed after it."""
    lm = core.lm
    ids = torch.tensor([list(tokens)], device=lm.device)
    start = pre.output.next_position + fed
    positions = torch.arange(start, start + len(tokens), device=lm.device)[None]
    with lm.lock, torch.no_grad(), decoding_with(pre.ape):
        out = lm.model(input_ids=ids, position_ids=positions, use_cache=True, **cache_arg(lm.model, pre.output.cache))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def trace_full(core: KVRagCore, question: str, chunks: Sequence[Any], new_tokens: int = TRACE_TOKENS) -> FullTrace:
    """Full Attention's greedy answer (the prefix cache serves a context read before) and its log-probs."""
    from kvrag.decode.stream import eos_ids

    pre = core.prefill(question, chunks=chunks, method="full", max_new_tokens=new_tokens)
    first = torch.log_softmax(pre.logits.float(), dim=-1)
    eos, tokens, rows = eos_ids(core.lm), [], [first]
    token = int(first.argmax())
    while token not in eos and len(tokens) < new_tokens:
        tokens.append(token)
        rows.append(_forward(core, pre, [token], fed=len(tokens) - 1)[0])
        token = int(rows[-1].argmax())
    return FullTrace(tokens, torch.stack(rows)[: len(tokens) + 1] if tokens else first[None])


def answer_kl(core: KVRagCore, question: str, chunks: Sequence[Any], full: FullTrace, method: str, ratio: float,
              ape: Ape | None, policy: dict[str, Any]) -> float:
    """Mean KL(Full || setting) over Full's answer positions, the setting fed Full's answer."""
    pre = core.prefill(question, chunks=chunks, method=method, recompute_ratio=ratio, ape=ape, prefix_cache=False,
                       max_new_tokens=len(full.tokens) + 1, **policy)
    mine = [torch.log_softmax(pre.logits.float(), dim=-1)[None]]
    if full.tokens:
        mine.append(_forward(core, pre, full.tokens[:-1]) if len(full.tokens) > 1 else mine[0][:0])
    q = torch.cat(mine)[: full.logp.shape[0]]
    p = full.logp[: q.shape[0]]
    return float((p.exp() * (p - q)).sum(-1).mean())


def search_ape(core: KVRagCore, prompts: Sequence[Any], policy: dict[str, Any], *, method: str = "reuse", ratio: float = 0.0,
               temperatures: Sequence[float] = TEMPERATURES, scales: Sequence[float] = SCALES,
               questions: int = SEARCH_QUESTIONS, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The (T, S) of the grid whose answers are closest to Full Attention's on the first `questions`
    prompts, for `method` at `ratio`; every grid point's mean KL is kept in the result."""
    chosen = sorted(list(prompts)[:questions], key=lambda p: p.group)  # context by context: the prefix cache serves each
    traces = [trace_full(core, p.question, p.chunks) for p in chosen]
    rows = []
    for t in temperatures:
        for s in scales:
            ape = Ape(t, s)
            kl = statistics.fmean(answer_kl(core, p.question, p.chunks, tr, method, ratio, ape, policy)
                                  for p, tr in zip(chosen, traces))
            rows.append({"temperature": t, "scale": s, "kl": round(kl, 5)})
            if progress:
                progress(f"APE search, {method}: T={t:g} S={s:g}: answer KL {kl:.4f}")
    best = min(rows, key=lambda r: (r["kl"], abs(r["temperature"] - 1) + abs(r["scale"] - 1)))
    plain = next((r["kl"] for r in rows if r["temperature"] == 1.0 and r["scale"] == 1.0), None)
    return {"method": method, "ratio": ratio, "questions": len(chosen), "grid": rows, "plain_kl": plain,
            "temperature": best["temperature"], "scale": best["scale"], "kl": best["kl"]}
