"""TTFT against context length: Full Attention and every method on contexts of growing size.

Quality needs real weights and real questions; time and memory only need the right shapes. So the
sweep runs on a loaded model, or on a model built from a shape config kept in `kvrag/shapes/`
(public config values, random weights, nothing downloaded) to measure TTFT at 1B-8B scale with no
hub. Random-weight figures are for time and memory only, and every output says so.

Chunks are cut from the bundled sample corpus to a fixed token length; each setting's TTFT is paired
with Full Attention's on the same context in the same repeat, and the ratio is the median of pairs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from kvrag.engine import KVRag
from kvrag.eval.runner import Setting
from kvrag.model import LoadedModel, from_model, resolve_device, resolve_dtype
from kvrag.types import Chunk

QUESTION = "Which places, people and dates does the text mention, and what happened there?"
RANDOM_WEIGHTS_NOTE = "random weights: figures are for time and memory only, never quality"


def shape_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in resources.files("kvrag").joinpath("shapes").iterdir() if p.name.endswith(".json"))


def shape_config(name: str) -> Any:
    """A transformers config with a public model's shapes (from `kvrag/shapes/NAME.json`)."""
    from transformers import AutoConfig

    path = resources.files("kvrag").joinpath("shapes", f"{name}.json")
    if not path.is_file():
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(shape_names())}")
    spec = json.loads(path.read_text())
    spec.pop("_source", None)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def random_model(name: str, tokenizer: Any, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """A model with `name`'s shapes and random weights, built on the target device (no download)."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype) if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = shape_config(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    return from_model(model, tokenizer, source=f"random:{name}")


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


@dataclass
class _Timing:
    ttft_s: float
    parts: dict[str, float]
    context_tokens: int
    recomputed_tokens: int
    kept_kv_ratio: float
    kv_mb: float
    peak_gpu_mb: float | None


def _timed(rag: KVRag, chunks: Sequence[Chunk], st: Setting) -> _Timing:
    cuda = rag.lm.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
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
    )


def speed_sweep(
    rag: KVRag,
    contexts: Sequence[int],
    settings: Sequence[Setting],
    chunk_tokens: int = 400,
    repeats: int = 3,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per (context size, setting): median TTFT and its split, and the median Full ÷ setting ratio."""
    limit = rag.lm.max_context - 256  # room for the prefix, question and a few answer tokens
    sizes = [c for c in contexts if c <= limit]
    for c in contexts:
        if c > limit:
            print(f"note: context {c} skipped: the model's context is {rag.lm.max_context} tokens")
    if not any(st.method == "full" for st in settings):
        settings = [Setting("full"), *settings]
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(sizes) * repeats * len(settings), desc="speed", unit="prefill", disable=not progress)
    for size in sizes:
        chunks = corpus_chunks(rag.lm.tokenizer, max(1, round(size / chunk_tokens)), chunk_tokens)
        rag.precompute(chunks, progress=False)  # offline work, not timed
        rag.prefill(QUESTION, chunks=chunks, method="reuse")  # warm-up: the store serves from a warm page cache
        runs: dict[str, list[_Timing]] = {st.name: [] for st in settings}
        for _ in range(repeats):
            for st in settings:
                runs[st.name].append(_timed(rag, chunks, st))
                bar.update(1)
        full = runs["full"]
        for st in settings:
            ts = runs[st.name]
            row = {
                "setting": st.name,
                "method": st.method,
                "ratio": 1.0 if st.method == "full" else st.ratio,
                "chunks": len(chunks),
                "context_tokens": ts[0].context_tokens,
                "ttft_s": statistics.median(t.ttft_s for t in ts),
                "full_ratio": statistics.median(f.ttft_s / max(t.ttft_s, 1e-9) for f, t in zip(full, ts)),
                "recomputed_tokens": ts[0].recomputed_tokens,
                "kept_kv_ratio": ts[0].kept_kv_ratio,
                "kv_mb": ts[0].kv_mb,
                "peak_gpu_mb": max((t.peak_gpu_mb or 0.0) for t in ts) if ts[0].peak_gpu_mb is not None else None,
                "repeats": repeats,
            }
            for part in ts[0].parts:
                row[part] = statistics.median(t.parts[part] for t in ts)
            rows.append(row)
    bar.close()
    return rows


def speed_markdown(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| context tokens | setting | TTFT ms | Full ÷ setting | load ms | stitch ms | select ms | recompute + question ms | "
        "load share | KV MB | peak GPU MB |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        share = r["load_s"] / r["ttft_s"] if r["ttft_s"] > 0 else 0.0
        gpu = "–" if r.get("peak_gpu_mb") is None else f"{r['peak_gpu_mb']:.0f}"
        lines.append(
            f"| {r['context_tokens']} | {r['setting']} | {r['ttft_s'] * 1000:.0f} | {r['full_ratio']:.1f}× | {r['load_s'] * 1000:.0f} | "
            f"{r['stitch_s'] * 1000:.0f} | {r['select_s'] * 1000:.0f} | {r['recompute_s'] * 1000:.0f} | {share:.0%} | {r['kv_mb']:.1f} | {gpu} |"
        )
    return head + "\n".join(lines) + "\n"


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
        f"store {meta.get('store')}, {meta.get('repeats')} repeats (medians)\n{note}\n"
        + speed_markdown(rows)
        + (f"\n![TTFT vs context length]({plot.name})\n" if plot else "")
    )
    return md
