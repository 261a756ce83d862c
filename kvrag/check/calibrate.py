"""Calibration per model: which setting a request that names no method gets.

Reuse at a fixed ratio gives Full Attention's answers on a 7B-70B model (the methods' papers) and not on a
135M one, so the default is measured per model. The shipped calibration set (calibration_set.json, built by
`python -m kvrag.eval.synthetic --calibration`: fictional facts of six kinds in long documents about
entities of different types, its own seed and phrasings, never used to judge) holds contexts of two sizes,
both long enough that the default reuses there. First APE's temperature and scale are chosen on its first
questions (kvrag.check.ape_search). Then each setting (Full Reuse; fusionrag, cacheblend, epic and a3 at
r = 0.15, 0.3, 0.5; each again with APE where the search chose it) answers every question,
CALIBRATION_NEW_TOKENS greedy tokens, beside Full Attention over the same prompt in the same run: right or
not (the gold contained), the same answer after normalisation, the first token's KL and the TTFT ratio
(Full's cold prefill of that context over the setting's). The rule (kvrag.check.calibration_rule) keeps
Full's right answers; the fastest setting that passes it is the default, else Full Attention (with the
exact prefix cache, as every `method="full"` request).

It stays within minutes on a 2-core CPU for the bundled model because it stops early: a setting whose
median TTFT over its first SPEED_PROMPTS prefills is under the speed floor is dropped before decoding (it
cannot be the default); a setting is dropped once it can no longer pass; an answer's decoding stops once
both verdicts are settled (the gold appeared, and a finished word differs from Full's); a method's larger
ratios are skipped once a smaller one passed, or was already slower than the speed floor (they recompute
more: never sooner); Full's reference for the other questions over a context comes from the exact prefix
cache (the context is read once, cold and timed).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from kvrag.check.answers import agreement, contains, first_token_kl, parted
from kvrag.check.ape_search import search_ape
from kvrag.check.calibration_rule import Rule, choose
from kvrag.check.calibration_store import SET_PATH
from kvrag.core import KVRagCore
from kvrag.defaults import (
    CALIBRATION_BUDGET,
    CALIBRATION_MIN_SPEEDUP,
    DEFAULT_MIN_RECOMPUTE,
    Ape,
    setting_name,
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
Setting = tuple[str, float, "Ape | None"]  # method, ratio, APE (None: off)


APE_RATIOS = (0.0, 0.15)  # APE is measured where little is recomputed: plain reuse and the smallest ratio


def candidate_settings(ape: Ape | None = None, adapter: bool = False) -> list[Setting]:
    """Full Reuse, then every method at each ratio, smallest ratio first (the order larger ones are skipped
    in, and roughly fastest first); where APE's search chose an active setting, reuse and the smallest ratio
    with it too, each right after its plain twin. With a link adapter, kvlink last: a kvlink that passes then
    never keeps the others from being measured, so the best setting without the adapter is known too (an
    engine without it gets that one). Not kvlink with APE: its decode steps would count the link slots as
    context, which its question's pass does not (kvrag.fuse.stitch.pass_ape)."""
    out: list[Setting] = []
    for method, ratio in [("reuse", 0.0)] + [(m, r) for r in RATIOS for m in METHODS] + ([("kvlink", 0.0)] if adapter else []):
        out.append((method, ratio, None))
        if ape is not None and ape.active and ratio in APE_RATIOS and method != "kvlink":
            out.append((method, ratio, ape))
    return out


@dataclass
class Prompt:
    group: int
    question: str
    chunks: list[Chunk]
    answers: list[str] = field(default_factory=list)  # the gold (empty: only agreement with Full can be judged)


def load_prompts(path=SET_PATH, questions_per_group: int | None = None) -> list[Prompt]:
    """The calibration questions, the contexts taken in turn (sizes interleaved), so a setting that is
    dropped early has seen every size and kind of question."""
    data = json.loads(path.read_text(encoding="utf-8"))
    per_group = []
    for g, group in enumerate(data["groups"]):
        chunks = [Chunk(f"calibration-{g}-{i}", c["text"], c["title"]) for i, c in enumerate(group["ctxs"])]
        qs = group["questions"][:questions_per_group]
        per_group.append([Prompt(g, q["question"], chunks, list(q.get("answers", []))) for q in qs])
    out = []
    for j in range(max(len(p) for p in per_group)):
        out += [p[j] for p in per_group if j < len(p)]
    return out


@dataclass
class _Full:
    """Full Attention's first-token logits, answer and whether it is right, per question, and its TTFT per
    context: the faster of two reads of the whole context (one timing on a shared machine can be a slow one,
    and every setting's ratio over that context is taken against it)."""

    core: KVRagCore
    prompts: list[Prompt]
    answers: dict[int, tuple[torch.Tensor, str, bool]] = field(default_factory=dict)
    ttft: dict[int, float] = field(default_factory=dict)
    read: set[int] = field(default_factory=set)  # contexts a question has read whole (later ones: the prefix cache)
    seconds: float = 0.0  # spent on Full's answers

    def timed(self, group: int, seconds: float) -> None:
        self.ttft[group] = min(self.ttft.get(group, math.inf), seconds)

    def get(self, i: int) -> tuple[torch.Tensor, str, bool]:
        if i not in self.answers:
            t0 = time.perf_counter()
            p = self.prompts[i]
            pre = self.core.prefill(p.question, chunks=p.chunks, method="full", max_new_tokens=CALIBRATION_NEW_TOKENS)
            if p.group not in self.read:  # the context's first question reads it whole: timed
                self.read.add(p.group)
                self.timed(p.group, pre.stats.ttft_s)
            text = self.core.decode(pre, max_new_tokens=CALIBRATION_NEW_TOKENS).answer().text
            self.answers[i] = (pre.logits.detach().float().cpu(), text, bool(contains(text, p.answers)))
            self.seconds += time.perf_counter() - t0
        return self.answers[i]

    def right(self) -> int:
        """How many Full answers right; answered context by context, so each context is read whole once and its
        other questions continue from the prefix cache (the set interleaves contexts, which a small cache evicts)."""
        order = sorted(range(len(self.prompts)), key=lambda i: (self.prompts[i].group, i))
        return sum(self.get(i)[2] for i in order)


def verdicts(stream: AnswerStream, reference: str, answers: Sequence[str]) -> tuple[bool, bool]:
    """(same answer as `reference` after normalisation, gold contained) for the answer streamed; decoding
    stops as soon as both are settled: the gold appeared and a finished word differs from the reference."""
    pieces = iter(stream)
    text = ""
    right = False
    try:
        for piece in pieces:
            text += piece
            right = right or bool(answers and contains(text, list(answers)))
            if parted(text, reference) and (right or not answers):
                return False, right
    finally:
        pieces.close()  # an abandoned stream holds nothing (the decoder takes the model lock per token)
    return bool(agreement(text.strip(), reference)), bool(answers and contains(text, list(answers)))


def same_answer(stream: AnswerStream, reference: str) -> bool:
    """Whether the answer streamed equals `reference` after normalisation (stops once it cannot)."""
    return verdicts(stream, reference, ())[0]


def _measure(core: KVRagCore, full: _Full, prompts: Sequence[Prompt], setting: Setting, rule: Rule,
             min_speedup: float, beaten: float = 0.0) -> dict[str, Any]:
    """One setting: its first SPEED_PROMPTS prefills, dropped there if its median TTFT ratio is under the
    speed floor, or under `beaten` (a setting that passed already was faster: this one cannot be the
    default), before decoding anything; else every question in turn until it can no longer pass."""
    method, ratio, ape = setting
    kls: list[float] = []
    speed: list[float] = []

    def prefill(i: int) -> Prefill:
        p = prompts[i]
        logits = full.get(i)[0]
        pre = core.prefill(p.question, chunks=p.chunks, method=method, recompute_ratio=ratio, ape=ape, prefix_cache=False,
                           max_new_tokens=CALIBRATION_NEW_TOKENS, **POLICY)
        kls.append(first_token_kl(logits, pre.logits))
        speed.append(full.ttft[p.group] / max(pre.stats.ttft_s, 1e-9))
        return pre

    held = {i: prefill(i) for i in range(min(SPEED_PROMPTS, len(prompts)))}
    same = asked = right = kept = lost = 0
    status = "passed"
    if len(held) == SPEED_PROMPTS and statistics.median(speed) < min_speedup:
        status = "too slow"
    elif len(held) == SPEED_PROMPTS and statistics.median(speed) < beaten:
        status = "slower"  # than a setting that passed: never the default, so not decoded
    for i in range(len(prompts) if status == "passed" else 0):
        pre = held.pop(i) if i in held else prefill(i)  # once decoded, a held prefill's cache is let go
        _, reference, full_right = full.get(i)
        is_same, is_right = verdicts(core.decode(pre, max_new_tokens=CALIBRATION_NEW_TOKENS), reference, prompts[i].answers)
        asked += 1
        same += is_same
        right += is_right
        kept += full_right and is_right
        lost += full_right and not is_right
        if rule.hopeless(asked, right, lost, same):
            status = "failed"
            break
    if status == "passed" and not rule.passes(right, lost, same):
        status = "failed"
    row = {"setting": setting_name(method, ratio, ape), "method": method, "ratio": ratio, "asked": asked, "same": same,
           "agreement": same / max(1, asked), "right": right, "kept": kept, "lost": lost,
           "kl": statistics.fmean(kls), "ttft_ratio": statistics.median(speed), "status": status}
    if ape is not None:
        row["ape"] = {"temperature": ape.temperature, "scale": ape.scale}
    return row


def _name(method: str, ratio: float, ape: Ape | None = None) -> str:
    return setting_name(method, ratio, ape)


def _memory_store(lm: LoadedModel) -> str:
    return f"memory://?device={lm.device}" if lm.device.type == "cuda" else "memory://"


def _eta(done: int, total: int, seconds: float) -> str:
    """An estimate of what is left, from the settings measured so far (an upper bound: later ones may be skipped)."""
    if done == 0 or done >= total:
        return ""
    return f", ~{seconds / done * (total - done) / 60:.0f} min left at most"


def run_calibration(
    lm: LoadedModel,
    *,
    budget: float | None = None,
    min_speedup: float | None = None,
    settings: Sequence[Setting] | None = None,
    prompts: Sequence[Prompt] | None = None,
    progress: Callable[[str], None] | None = None,
    ape_search: bool = True,
    bar: bool | None = None,
    adapter: Any = None,
) -> dict[str, Any]:
    """Measure every setting on the calibration set against Full Attention and choose the default; the
    result is what `calibration_store` keeps (`setting_of` reads the choice back). `budget` (the agreement
    rule's, where Full answers too few right) and `min_speedup` default to CALIBRATION_BUDGET and
    CALIBRATION_MIN_SPEEDUP. `ape_search=False` measures no APE setting. `bar`: a progress bar on stderr
    (None: where stderr is a terminal). `adapter`: a link adapter that reads the base weights' chunk KV (links,
    lora-after): kvlink with it is measured too, and the result names it."""
    from tqdm.auto import tqdm

    t0, cpu0 = time.perf_counter(), time.process_time()
    budget = CALIBRATION_BUDGET if budget is None else budget
    min_speedup = CALIBRATION_MIN_SPEEDUP if min_speedup is None else min_speedup
    prompts = list(prompts or load_prompts())
    core = KVRagCore(lm, store=_memory_store(lm), prefix_cache=PrefixCache(256 << 20))  # nothing lands in the user's store
    linked = _adapter_core(lm, core, adapter)  # kvlink's rows only: the adapter over the same store and registry
    core.precompute([c for c in {c.id: c for p in prompts for c in p.chunks}.values()], progress=False)
    t_pre = time.perf_counter()
    full = _Full(core, prompts)
    first = prompts[0]
    for method in ("reuse", "fusionrag"):  # first passes over these shapes are not the timed ones
        core.prefill(first.question, chunks=first.chunks, method=method, prefix_cache=False, **POLICY)
    for g, p in {p.group: p for p in reversed(prompts)}.items():  # each context read whole once more: Full's other timing
        full.timed(g, core.prefill(p.question, chunks=p.chunks, method="full", prefix_cache=False).stats.ttft_s)
    t_warm = time.perf_counter()
    rule = Rule(len(prompts), full.right(), budget)  # Full answers every question first: the rule's thresholds
    if progress:
        progress(f"calibration: Full Attention answered {rule.full_right} of {len(prompts)} right; a setting passes "
                 f"with {rule.describe()}")
    searched = search_ape(core, prompts, POLICY, progress=progress) if ape_search and settings is None else None
    # the search's own choice; where plain reuse scored best it is T = S = 1, and no APE setting is measured
    ape = Ape(searched["temperature"], searched["scale"]) if searched else None
    t_ape = time.perf_counter()
    todo = list(settings) if settings is not None else candidate_settings(ape, adapter is not None)
    rows: list[dict[str, Any]] = []
    skip: dict[tuple[str, Any], str] = {}  # (method, APE) -> why its larger ratios are not measured (never sooner)
    with tqdm(total=len(todo), desc="calibrating", unit="setting", disable=(None if bar is None else not bar), leave=False) as pbar:
        for n, (method, ratio, ape_s) in enumerate(todo):
            key = (method, ape_s)
            name = _name(method, ratio, ape_s)
            pbar.set_postfix_str(name)
            if key in skip:
                rows.append({"setting": name, "method": method, "ratio": ratio, "status": "skipped", "note": skip[key],
                             **({"ape": {"temperature": ape_s.temperature, "scale": ape_s.scale}} if ape_s else {})})
                pbar.update()
                continue
            beaten = max((r["ttft_ratio"] for r in rows if r.get("status") == "passed"), default=0.0)
            measuring = linked if method == "kvlink" and linked is not None else core
            row = _measure(measuring, full, prompts, (method, ratio, ape_s), rule, min_speedup, beaten)
            rows.append(row)
            pbar.update()
            if row["status"] in ("passed", "slower"):
                skip[key] = f"{row['setting']} passed or was beaten; a larger ratio recomputes more, never sooner"
            elif row["ttft_ratio"] < min_speedup:
                skip[key] = f"{row['setting']} was under {min_speedup:g}x Full's speed; a larger ratio recomputes more"
            if progress:
                progress(f"{row['setting']}: {row['right']} right, kept {row['kept']} of Full's {rule.full_right} "
                         f"(of the first {row['asked']} questions), "
                         f"{row['same']}/{row['asked']} same as Full, KL {row['kl']:.3f}, {row['ttft_ratio']:.1f}x Full's TTFT "
                         f"({row['status']}; setting {n + 1} of {len(todo)}{_eta(n + 1, len(todo), time.perf_counter() - t_ape)})")
    chosen = choose(rows, rule, min_speedup)
    extra: dict[str, Any] = {}
    if adapter is not None:  # what an engine without this adapter gets, and which adapter kvlink was measured with
        extra["fallback"] = _chosen_record(choose([r for r in rows if r["method"] != "kvlink"], rule, min_speedup))
        extra["adapter"] = {"digest": adapter.digest(), "mode": adapter.mode, "link_tokens": adapter.link_tokens,
                            "objective": (adapter.meta.get("training") or {}).get("objective", "")}
    return {
        "chosen": _chosen_record(chosen),
        **extra,
        "rule": {"by": "right" if rule.by_right else "agreement", "full_right": rule.full_right, "may_lose": rule.may_lose,
                 "right_needed": rule.right_needed, "budget": budget},
        "ape_search": searched,
        "budget": budget, "min_speedup": min_speedup, "questions": len(prompts), "contexts": len({p.group for p in prompts}),
        "context_tokens": _context_tokens(core, prompts), "new_tokens": CALIBRATION_NEW_TOKENS,
        "full_ttft_s": [round(full.ttft[g], 4) for g in sorted(full.ttft)],  # Full's cold prefill per context: a run's yardstick
        "full_answers": len(full.answers), "full_right": rule.full_right, "settings": rows,
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(time.process_time() - cpu0, 1),  # on a shared machine: the work done, whoever else ran
        "phases_s": {"precompute": round(t_pre - t0, 1), "warm_up": round(t_warm - t_pre, 1), "full_answers": round(full.seconds, 1),
                     "ape_search": round(t_ape - t_warm - 0.0, 1),
                     "settings": round(time.perf_counter() - t_ape, 1)},
        "device": lm.device.type, "dtype": str(lm.dtype).replace("torch.", ""), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _chosen_record(chosen: Any) -> dict[str, Any]:
    return {"method": chosen.method, "ratio": chosen.ratio, "why": chosen.why,
            **({"ape": {"temperature": chosen.ape.temperature, "scale": chosen.ape.scale}} if chosen.ape else {})}


def _adapter_core(lm: LoadedModel, core: KVRagCore, adapter: Any) -> KVRagCore | None:
    """What measures kvlink with a link adapter that reads the base chunk KV: the base core's store and chunk
    registry, the adapter's link rows, and, for a lora-after adapter, its merged weights after the chunks."""
    if adapter is None:
        return None
    from kvrag.core import AdapterPath
    from kvrag.link_adapter import apply_adapter

    return AdapterPath(apply_adapter(lm, adapter), core, adapter)


def _context_tokens(core: KVRagCore, prompts: Sequence[Prompt]) -> list[int]:
    """Chunk tokens of each calibration context (what decides whether the read-whole policies apply)."""
    seen: dict[int, int] = {}
    for p in prompts:
        seen.setdefault(p.group, sum(len(core.layout.chunk_ids(c)) for c in p.chunks))
    return [seen[g] for g in sorted(seen)]
