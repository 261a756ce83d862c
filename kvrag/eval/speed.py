"""TTFT against context length: Full Attention and every method on contexts of growing size.

Quality needs real weights and real questions; time and memory only need the right shapes. So the
sweep runs on a loaded model, or on a model built from a shape config kept in `kvrag/shapes/`
(public config values, random weights, nothing downloaded) to measure TTFT at 1B-8B scale with no
hub. Random-weight figures are for time and memory only, and every output says so.

Chunks are cut from the bundled sample corpus to a fixed token length; each setting's TTFT is paired
with Full Attention's on the same context in the same repeat, and the ratio is the median of pairs.
With `SweepOptions.tiers`, every cached setting is timed with its KV from each tier asked for (hot,
warm, cold, cold from the device: kvrag.eval.speed_tiers); every row names the store it read from.
"""

from __future__ import annotations

import json
import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from kvrag.kv.prefix_cache import without_prefix_cache
from kvrag.engine import KVRag
from kvrag.eval.runner import Setting
from kvrag.eval.speed_tiers import TIERS, TierPlan, arrange, kv_from, plan_tiers
from kvrag.model.shapes import random_model, shape_config, shape_names  # noqa: F401 - the bench's names for them
from kvrag.types import AnswerStats, Chunk

QUESTION = "Which places, people and dates does the text mention, and what happened there?"
RANDOM_WEIGHTS_NOTE = "random weights: figures are for time and memory only, never quality"


def parse_sizes(spec: str) -> list[int]:
    """'512,1k,4k' -> [512, 1024, 4096]."""
    out = []
    for item in filter(None, (s.strip().lower() for s in spec.split(","))):
        out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    return out


def corpus_chunks(tokenizer: Any, n: int, tokens: int) -> list[Chunk]:
    """`n` distinct chunks of about `tokens` tokens each, cut from the bundled sample corpus."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(resources.files("kvrag").joinpath("sample_corpus").iterdir()) if p.name.endswith(".md")]
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    step = max(1, len(ids) // max(1, n))
    chunks = []
    for i in range(n):
        start = (i * step) % len(ids)
        window = (ids[start:] + ids)[:tokens]
        chunks.append(Chunk(f"speed-{tokens}-{i}", tokenizer.decode(window), title=f"Part {i + 1}"))
    return chunks


from kvrag.defaults import LAYERWISE_CHOICES  # noqa: E402,F401


@dataclass(frozen=True)
class SweepOptions:
    """How the sweep runs: chunk size, repeats, the decode-rate measurement and layer-wise loading.

    `layerwise`: "auto" leaves the engine's default (on for CUDA); "on"/"off" force it; "both" times
    every cached setting both ways, so the table shows what prefetching layers behind compute saves.
    `decode_tokens` > 0: after the timed prefills of each size, each setting answers once more and
    decodes that many tokens (no stop rule), and its row gives the decode rate (tokens/s).
    `tiers`: time every cached setting with its KV from each of these store tiers (hot, warm, cold,
    device: see kvrag.eval.speed_tiers; the engine's store must be a tiered one); empty: as it comes."""

    chunk_tokens: int = 400
    repeats: int = 3
    decode_tokens: int = 0
    layerwise: str = "auto"
    progress: bool = True
    tiers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.layerwise not in LAYERWISE_CHOICES:
            raise ValueError(f"layerwise must be one of {LAYERWISE_CHOICES}, got {self.layerwise!r}")
        if any(t not in TIERS for t in self.tiers):
            raise ValueError(f"tiers must be among {TIERS}, got {self.tiers!r}")
        if self.chunk_tokens < 1 or self.repeats < 1 or self.decode_tokens < 0:
            raise ValueError("chunk_tokens >= 1, repeats >= 1 and decode_tokens >= 0 are required")

    def modes(self) -> list[bool | None]:
        return {"auto": [None], "on": [True], "off": [False], "both": [True, False]}[self.layerwise]


@dataclass(frozen=True)
class _Variant:
    """A setting timed with one layer-wise choice (None: the engine's default) and its KV from one
    store tier (None: wherever the store has it)."""

    setting: Setting
    layerwise: bool | None = None
    tier: str | None = None

    @property
    def name(self) -> str:
        name = self.setting.name
        if self.layerwise is not None:
            name += f" [{'layer-wise' if self.layerwise else 'whole'}]"
        return name if self.tier is None else f"{name}, {self.tier}"


@dataclass
class _Timing:
    ttft_s: float
    parts: dict[str, float]
    context_tokens: int
    recomputed_tokens: int
    kept_kv_ratio: float
    kv_mb: float
    peak_gpu_mb: float | None
    layerwise: bool
    load_wait_s: float
    served: dict[str, int]
    full_reason: str


@contextmanager
def _layerwise(rag: KVRag, choice: bool | None):
    """Time with layer-wise loading forced on or off (None: as the engine is set)."""
    repo = rag.repo
    before = repo.layerwise
    if choice is not None:
        repo.layerwise = choice
    try:
        yield
    finally:
        repo.layerwise = before


def _timed(rag: KVRag, chunks: Sequence[Chunk], v: _Variant, plan: TierPlan) -> _Timing:
    st = v.setting
    arrange(rag.store, plan, v.tier)  # untimed: the tiers above the one asked for emptied
    cuda = rag.lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with _layerwise(rag, v.layerwise):
        pre = rag.prefill(QUESTION, chunks=list(chunks), method=st.method, recompute_ratio=st.ratio, **dict(st.params))
    s = pre.stats
    kv = pre.stitched.nbytes if pre.stitched is not None else 0
    return _Timing(
        ttft_s=s.ttft_s,
        parts={"load_s": s.load_s, "stitch_s": s.stitch_s, "select_s": s.select_s, "recompute_s": s.recompute_s, "prefill_s": s.prefill_s},
        context_tokens=s.context_tokens,
        recomputed_tokens=s.recomputed_tokens,
        kept_kv_ratio=s.kept_kv_ratio,
        kv_mb=kv / 1e6,
        peak_gpu_mb=torch.cuda.max_memory_allocated() / 1e6 if cuda else None,
        layerwise=s.layerwise,
        load_wait_s=s.load_wait_s,
        served=dict(s.tiers),
        full_reason=s.full_reason,
    )


def _decode_stats(rag: KVRag, chunks: Sequence[Chunk], v: _Variant, tokens: int) -> AnswerStats:
    """The stats of one answer decoding `tokens` tokens after this setting's prefill: its decode rate,
    the tokens that came (a random-weight model may hit an end token first), its one-time set-up."""
    st = v.setting
    with _layerwise(rag, v.layerwise):
        ans = rag.answer(QUESTION, chunks=list(chunks), method=st.method, recompute_ratio=st.ratio,
                         max_new_tokens=tokens, stop_at="none", **dict(st.params))
    return ans.stats


def _variants(settings: Sequence[Setting], opts: SweepOptions, tiers: Sequence[str] = ()) -> list[_Variant]:
    if not any(st.method == "full" for st in settings):
        settings = [Setting("full"), *settings]
    out = []
    for st in settings:
        if st.method == "full":  # Full Attention loads nothing
            out.append(_Variant(st))
            continue
        out += [_Variant(st, m, t) for m in opts.modes() for t in (tiers or [None])]
    return out


@without_prefix_cache
def speed_sweep(
    rag: KVRag,
    contexts: Sequence[int],
    settings: Sequence[Setting],
    opts: SweepOptions | None = None,
) -> list[dict[str, Any]]:
    """One row per (context size, setting[, layer-wise choice]): median TTFT and its split, and the
    median Full ÷ setting ratio; with `opts.decode_tokens`, the decode rate after that prefill."""
    opts = opts or SweepOptions()
    limit = rag.lm.max_context - 256 - opts.decode_tokens  # room for the prefix, question and the answer
    sizes = [c for c in contexts if c <= limit]
    for c in contexts:
        if c > limit:
            print(f"note: context {c} skipped: the model's context is {rag.lm.max_context} tokens")
    plan = plan_tiers(rag.store, opts.tiers)
    for note in plan.notes:
        print(f"note: {note}")
    variants = _variants(settings, opts, [t for t in opts.tiers if t in plan.levels])
    rows: list[dict[str, Any]] = []
    steps = len(sizes) * len(variants) * (opts.repeats + (1 if opts.decode_tokens else 0))
    bar = tqdm(total=steps, desc="speed", unit="prefill", disable=not opts.progress)
    for size in sizes:
        chunks = corpus_chunks(rag.lm.tokenizer, max(1, round(size / opts.chunk_tokens)), opts.chunk_tokens)
        rag.precompute(chunks, progress=False)  # offline work, not timed
        rag.prefill(QUESTION, chunks=chunks, method="reuse")  # warm-up: the store serves from a warm page cache
        runs: dict[str, list[_Timing]] = {v.name: [] for v in variants}
        for _ in range(opts.repeats):
            for v in variants:
                runs[v.name].append(_timed(rag, chunks, v, plan))
                bar.update(1)
        full = runs["full"]
        for v in variants:
            ts = runs[v.name]
            row = {
                "setting": v.name,
                "method": v.setting.method,
                "ratio": 1.0 if v.setting.method == "full" else v.setting.ratio,
                "chunks": len(chunks),
                "context_tokens": ts[0].context_tokens,
                "ttft_s": statistics.median(t.ttft_s for t in ts),
                "full_ratio": statistics.median(f.ttft_s / max(t.ttft_s, 1e-9) for f, t in zip(full, ts)),
                "recomputed_tokens": ts[0].recomputed_tokens,
                "kept_kv_ratio": ts[0].kept_kv_ratio,
                "kv_mb": ts[0].kv_mb,
                "peak_gpu_mb": max((t.peak_gpu_mb or 0.0) for t in ts) if ts[0].peak_gpu_mb is not None else None,
                "layerwise": ts[0].layerwise,
                "load_wait_s": statistics.median(t.load_wait_s for t in ts),
                "repeats": opts.repeats,
                "tier": v.tier,
                "store": plan.names.get(v.tier) if v.tier else None,
                "served": ts[-1].served,  # the tiers that served the last repeat's chunks
                "full_reason": ts[-1].full_reason,  # a reuse setting that read the whole prompt instead, and why
            }
            row["kv_from"] = kv_from(row)
            for part in ts[0].parts:
                row[part] = statistics.median(t.parts[part] for t in ts)
            if opts.decode_tokens:
                dec = _decode_stats(rag, chunks, v, opts.decode_tokens)
                row.update(decode_tok_s=dec.decode_tokens_per_s, decoded_tokens=dec.generated_tokens, decode_setup_s=dec.decode_setup_s)
                bar.update(1)
            rows.append(row)
    bar.close()
    return rows


def load_share(row: dict[str, Any]) -> float:
    """The part of TTFT spent waiting for KV: all of the load, plus (layer-wise) the waits inside the passes."""
    if row["ttft_s"] <= 0:
        return 0.0
    return (row["load_s"] + row.get("load_wait_s", 0.0)) / row["ttft_s"]


def speed_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| context tokens | setting | KV from | TTFT ms | Full ÷ setting | load ms | stitch ms | select ms | recompute + question ms | "
        "load share | KV MB | peak GPU MB | decode tok/s (set-up ms) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        gpu = "–" if r.get("peak_gpu_mb") is None else f"{r['peak_gpu_mb']:.0f}"
        dec = f"{r['decode_tok_s']:.0f}" if r.get("decode_tok_s") else "–"
        if r.get("decode_tok_s") and r.get("decode_setup_s") is not None:
            dec += f" ({r['decode_setup_s'] * 1000:.0f})"
        lines.append(
            f"| {r['context_tokens']} | {r['setting']} | {r.get('kv_from') or kv_from(r)} | {r['ttft_s'] * 1000:.0f} | {r['full_ratio']:.1f}× | {r['load_s'] * 1000:.0f} | "
            f"{r['stitch_s'] * 1000:.0f} | {r['select_s'] * 1000:.0f} | {r['recompute_s'] * 1000:.0f} | {load_share(r):.0%} | "
            f"{r['kv_mb']:.1f} | {gpu} | {dec} |"
        )
    return head + "\n".join(lines) + "\n"


def _tiers_note(meta: dict[str, Any]) -> str:
    """What the per-tier rows mean, for the report's head (empty without them)."""
    if not meta.get("tiers"):
        return ""
    names = ", ".join(f"{t}: {s}" for t, s in meta["tiers"].items())
    text = (f"\nKV per tier ({names}): before each timed prefill the tiers above the one named are emptied, so every "
            "chunk comes from it; cold reads the disk with a warm page cache, device after dropping the files' cached pages. "
            "\"KV from\" names the store each row read from (and what served it, where an upper tier was too small).\n")
    return text + "".join(f"\nnote: {n}\n" for n in meta.get("tier_notes", []))


def write_speed(rows: Sequence[dict[str, Any]], out_dir: str | Path, meta: dict[str, Any]) -> Path:
    """speed.json, speed.md and ttft_vs_context.png in `out_dir`; returns the markdown path."""
    from kvrag.eval.plots import ttft_vs_context
    from kvrag.eval.report import hardware_line

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speed.json").write_text(json.dumps({"meta": meta, "rows": list(rows)}, indent=2))
    note = f"\n**{RANDOM_WEIGHTS_NOTE}.**\n" if meta.get("random_weights") else ""
    title = f"{meta.get('model', '')}, {meta.get('device', '')}" + (" (random weights)" if meta.get("random_weights") else "")
    plot = ttft_vs_context(rows, out / "ttft_vs_context.png", title=title)
    md = out / "speed.md"
    md.write_text(
        f"# kvrag bench speed\n\n`{meta.get('command', '')}`\n\nhardware: {hardware_line(meta.get('hardware', {}))}\n\n"
        f"model: {meta.get('model')}, dtype {meta.get('dtype')}, chunks of ~{meta.get('chunk_tokens')} tokens, "
        f"store {meta.get('store')}, {meta.get('repeats')} repeats (medians)\n{note}{_tiers_note(meta)}\n"
        + speed_markdown(rows)
        + (f"\n![TTFT vs context length]({plot.name})\n" if plot else "")
    )
    return md
