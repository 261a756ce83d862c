"""Calibration per model: which setting a request that names no method gets.

Reuse at a fixed ratio gives Full Attention's answers on a 7B-70B model (the methods' papers) and not on a
135M one, so the default is measured per model. The shipped calibration set (calibration_set.json, built by
`python -m kvrag.eval.synthetic --calibration`: fictional facts of six kinds in long documents about
entities of different types, its own seed and phrasings, never used to judge) holds contexts of two sizes,
both long enough that the default reuses there. Each setting (Full Reuse; fusionrag, cacheblend, epic and
a3 at r = 0.15, 0.3, 0.5) answers every question, CALIBRATION_NEW_TOKENS greedy tokens, beside Full
Attention over the same prompt in the same run: the same answer after normalisation, the first token's KL
and the TTFT ratio (Full's cold prefill of that context over the setting's).

The default is the fastest setting with Full's answer on at least CALIBRATION_BUDGET of the questions and a
median TTFT at least CALIBRATION_MIN_SPEEDUP times Full's; where none is, Full Attention (with the exact
prefix cache, as every `method="full"` request).

It stays within a couple of minutes on a 2-core CPU for the bundled model because it stops early: a setting
whose median TTFT over its first SPEED_PROMPTS prefills is under the speed floor is dropped before decoding
(it cannot be the default); with the same verdicts, a setting is dropped once it has missed more questions than the budget allows; an answer is
cut off once a finished word differs from Full's (it can no longer be the same); a method's larger ratios
are skipped once a smaller one passed, or was already slower than the speed floor (they recompute more:
never sooner); Full's reference for the other
questions over a context comes from the exact prefix cache (the context is read once, cold and timed).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvrag.check.answers import agreement, first_token_kl, parted
from kvrag.check.calibration_store import SET_PATH
from kvrag.core import KVRagCore
from kvrag.defaults import (
    CALIBRATION_BUDGET,
    CALIBRATION_MIN_SPEEDUP,
    DEFAULT_MIN_RECOMPUTE,
    DEFAULT_RATIO,
    DefaultSetting,
)
from kvrag.kv.prefix_cache import PrefixCache
from kvrag.model.loading import LoadedModel
from kvrag.pipeline import AnswerStream, Prefill
from kvrag.types import Chunk


METHODS = ("fusionrag", "cacheblend", "epic", "a3")
RATIOS = (0.15, 0.3, 0.5)
CALIBRATION_NEW_TOKENS = 16
SPEED_PROMPTS = 3  # a setting whose median TTFT ratio over its first questions is under the floor is dropped there
# What each setting is measured as: the method itself (no context here is short or records of one kind, and
# neither policy may hide it), with the recompute floor users get.
POLICY: dict[str, Any] = {"short_context": 0, "records_whole": False, "min_recompute": DEFAULT_MIN_RECOMPUTE}


def candidate_settings() -> list[tuple[str, float]]:
    """Full Reuse, then every method at each ratio, smallest ratio first (the order larger ones are skipped in)."""
    return [("reuse", 0.0)] + [(m, r) for r in RATIOS for m in METHODS]


@dataclass
class Prompt:
    group: int
    question: str
    chunks: list[Chunk]


def load_prompts(path=SET_PATH, questions_per_group: int | None = None) -> list[Prompt]:
    """The calibration questions, the contexts taken in turn (sizes interleaved), so a setting that is
    dropped early has seen every size and kind of question."""
    data = json.loads(path.read_text(encoding="utf-8"))
    per_group = []
    for g, group in enumerate(data["groups"]):
        chunks = [Chunk(f"calibration-{g}-{i}", c["text"], c["title"]) for i, c in enumerate(group["ctxs"])]
        qs = group["questions"][:questions_per_group]
        per_group.append([Prompt(g, q["question"], chunks) for q in qs])
    out = []
    for j in range(max(len(p) for p in per_group)):
        out += [p[j] for p in per_group if j < len(p)]
    return out


@dataclass
class _Full:
    """Full Attention's first-token logits and answer per question, and its TTFT per context: the faster of
    two reads of the whole context (one timing on a shared machine can be a slow one, and every setting's
    ratio over that context is taken against it)."""

    core: KVRagCore
    prompts: list[Prompt]
    answers: dict[int, tuple[torch.Tensor, str]] = field(default_factory=dict)
    ttft: dict[int, float] = field(default_factory=dict)
    read: set[int] = field(default_factory=set)  # contexts a question has read whole (later ones: the prefix cache)
    seconds: float = 0.0  # spent on Full's answers

    def timed(self, group: int, seconds: float) -> None:
        self.ttft[group] = min(self.ttft.get(group, math.inf), seconds)

    def get(self, i: int) -> tuple[torch.Tensor, str]:
        if i not in self.answers:
            t0 = time.perf_counter()
            p = self.prompts[i]
            pre = self.core.prefill(p.question, chunks=p.chunks, method="full", max_new_tokens=CALIBRATION_NEW_TOKENS)
            if p.group not in self.read:  # the context's first question reads it whole: timed
                self.read.add(p.group)
                self.timed(p.group, pre.stats.ttft_s)
            text = self.core.decode(pre, max_new_tokens=CALIBRATION_NEW_TOKENS).answer().text
            self.answers[i] = (pre.logits.detach().float().cpu(), text)
            self.seconds += time.perf_counter() - t0
        return self.answers[i]


def same_answer(stream: AnswerStream, reference: str) -> bool:
    """Whether the answer streamed equals `reference` after normalisation; stops decoding as soon as a
    finished word differs (the verdict cannot change after that)."""
    pieces = iter(stream)
    text = ""
    try:
        for piece in pieces:
            text += piece
            if parted(text, reference):
                return False
    finally:
        pieces.close()  # an abandoned stream holds nothing (the decoder takes the model lock per token)
    return bool(agreement(text.strip(), reference))


def _measure(core: KVRagCore, full: _Full, prompts: Sequence[Prompt], method: str, ratio: float, allowed: int,
             min_speedup: float) -> dict[str, Any]:
    """One setting: its first SPEED_PROMPTS prefills, dropped there if its median TTFT ratio is under the
    speed floor (before decoding anything); else every question in turn until it has missed too many."""
    kls: list[float] = []
    speed: list[float] = []

    def prefill(i: int) -> Prefill:
        p = prompts[i]
        logits, _ = full.get(i)
        pre = core.prefill(p.question, chunks=p.chunks, method=method, recompute_ratio=ratio, prefix_cache=False,
                           max_new_tokens=CALIBRATION_NEW_TOKENS, **POLICY)
        kls.append(first_token_kl(logits, pre.logits))
        speed.append(full.ttft[p.group] / max(pre.stats.ttft_s, 1e-9))
        return pre

    held = {i: prefill(i) for i in range(min(SPEED_PROMPTS, len(prompts)))}
    same = asked = 0
    status = "too slow" if len(held) == SPEED_PROMPTS and statistics.median(speed) < min_speedup else "passed"
    for i in range(len(prompts) if status == "passed" else 0):
        pre = held.pop(i) if i in held else prefill(i)  # once decoded, a held prefill's cache is let go
        asked += 1
        same += same_answer(core.decode(pre, max_new_tokens=CALIBRATION_NEW_TOKENS), full.get(i)[1])
        if asked - same > allowed:
            status = "failed"
            break
    return {"setting": _name(method, ratio), "method": method, "ratio": ratio, "asked": asked, "same": same,
            "agreement": same / max(1, asked), "kl": statistics.fmean(kls), "ttft_ratio": statistics.median(speed), "status": status}


def _name(method: str, ratio: float) -> str:
    return DefaultSetting(method, ratio).name


def _memory_store(lm: LoadedModel) -> str:
    return f"memory://?device={lm.device}" if lm.device.type == "cuda" else "memory://"


def run_calibration(
    lm: LoadedModel,
    *,
    budget: float | None = None,
    min_speedup: float | None = None,
    settings: Sequence[tuple[str, float]] | None = None,
    prompts: Sequence[Prompt] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every setting on the calibration set against Full Attention and choose the default; the
    result is what `calibration_store` keeps (`setting_of` reads the choice back). `budget` and
    `min_speedup` default to CALIBRATION_BUDGET and CALIBRATION_MIN_SPEEDUP."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    budget = CALIBRATION_BUDGET if budget is None else budget
    min_speedup = CALIBRATION_MIN_SPEEDUP if min_speedup is None else min_speedup
    prompts = list(prompts or load_prompts())
    core = KVRagCore(lm, store=_memory_store(lm), prefix_cache=PrefixCache(256 << 20))  # nothing lands in the user's store
    core.precompute([c for c in {c.id: c for p in prompts for c in p.chunks}.values()], progress=False)
    t_pre = time.perf_counter()
    full = _Full(core, prompts)
    first = prompts[0]
    for method in ("reuse", "fusionrag"):  # first passes over these shapes are not the timed ones
        core.prefill(first.question, chunks=first.chunks, method=method, prefix_cache=False, **POLICY)
    for g, p in {p.group: p for p in reversed(prompts)}.items():  # each context read whole once more: Full's other timing
        full.timed(g, core.prefill(p.question, chunks=p.chunks, method="full", prefix_cache=False).stats.ttft_s)
    t_warm = time.perf_counter()
    allowed = math.floor((1.0 - budget) * len(prompts) + 1e-9)
    rows: list[dict[str, Any]] = []
    skip: dict[str, str] = {}  # method -> why its larger ratios are not measured (they recompute more: never sooner)
    for method, ratio in settings if settings is not None else candidate_settings():
        if method in skip:
            rows.append({"setting": _name(method, ratio), "method": method, "ratio": ratio, "status": "skipped", "note": skip[method]})
            continue
        row = _measure(core, full, prompts, method, ratio, allowed, min_speedup)
        rows.append(row)
        if row["status"] == "passed":
            skip[method] = f"{row['setting']} passed; a larger ratio recomputes more, never sooner"
        elif row["ttft_ratio"] < min_speedup:
            skip[method] = f"{row['setting']} was under {min_speedup:g}x Full's speed; a larger ratio recomputes more"
        if progress:
            progress(f"{row['setting']}: {row['same']}/{row['asked']} same as Full, KL {row['kl']:.3f}, "
                     f"{row['ttft_ratio']:.1f}x Full's TTFT ({row['status']})")
    chosen = choose(rows, budget, min_speedup, len(prompts))
    return {
        "chosen": {"method": chosen.method, "ratio": chosen.ratio, "why": chosen.why},
        "budget": budget, "min_speedup": min_speedup, "questions": len(prompts), "contexts": len({p.group for p in prompts}),
        "context_tokens": _context_tokens(core, prompts), "new_tokens": CALIBRATION_NEW_TOKENS,
        "full_ttft_s": [round(full.ttft[g], 4) for g in sorted(full.ttft)],  # Full's cold prefill per context: a run's yardstick
        "full_answers": len(full.answers), "settings": rows, "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - cpu0, 1),  # on a shared machine: the work done, whoever else ran
        "phases_s": {"precompute": round(t_pre - t0, 1), "warm_up": round(t_warm - t_pre, 1), "full_answers": round(full.seconds, 1),
                     "settings": round(time.perf_counter() - t_warm - full.seconds, 1)},
        "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _context_tokens(core: KVRagCore, prompts: Sequence[Prompt]) -> list[int]:
    """Chunk tokens of each calibration context (what decides whether the read-whole policies apply)."""
    seen: dict[int, int] = {}
    for p in prompts:
        seen.setdefault(p.group, sum(len(core.layout.chunk_ids(c)) for c in p.chunks))
    return [seen[g] for g in sorted(seen)]


def choose(rows: Sequence[dict[str, Any]], budget: float, min_speedup: float, questions: int) -> DefaultSetting:
    """The fastest setting that passed and beats Full's TTFT by `min_speedup`; else Full Attention."""
    fast = [r for r in rows if r.get("status") == "passed" and r["ttft_ratio"] >= min_speedup]
    if fast:
        best = max(fast, key=lambda r: r["ttft_ratio"])
        why = (f"the fastest setting with Full Attention's answer on >= {budget:.0%} of the {questions} calibration "
               f"questions ({best['same']}/{best['asked']}, {best['ttft_ratio']:.1f}x Full's TTFT)")
        return DefaultSetting(best["method"], float(best["ratio"]), "calibrated", why)
    counts = Counter(r.get("status") for r in rows)
    labels = (("failed", "missed too many"), ("too slow", f"under {min_speedup:g}x Full's speed"),
              ("passed", f"passed but under {min_speedup:g}x Full's speed"), ("skipped", "skipped"))
    parts = ", ".join(f"{counts[k]} {label}" for k, label in labels if counts[k])
    why = (f"no reuse setting gave Full Attention's answer on >= {budget:.0%} of the {questions} calibration questions "
           f"at >= {min_speedup:g}x its speed ({parts}): Full Attention with the exact prefix cache")
    return DefaultSetting("full", DEFAULT_RATIO, "calibrated", why)
