"""Methods x recompute ratios on one dataset, in one run, Full Attention and Full Reuse always in.

Each example is answered with Full Attention first, so every other setting's answer agreement,
first-token KL and TTFT ratio are paired with it in the same run (absolute times on a shared
machine drift; paired ratios hold). Records go to a JSONL file as they are made, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from kvrag.kv.prefix_cache import without_prefix_cache
from kvrag.engine import KIND_CHUNK, KIND_SIMILARITY, KVRag, Prefill
from kvrag.eval.data import Example
from kvrag.eval.metrics import agreement, best_f1, contains, first_token_kl


@dataclass(frozen=True)
class Setting:
    method: str  # or "default": no method named, the engine's default (its model's calibrated setting)
    ratio: float | str = 0.0  # or "auto": the engine picks per question (the record holds what it chose)
    kv_kind: str = KIND_CHUNK
    params: tuple[tuple[str, Any], ...] = ()
    model: str = ""  # a named model variant (e.g. one with trained KVLink weights); "" is the base model

    @property
    def name(self) -> str:
        if self.method in ("full", "reuse", "default"):
            base = self.method
        else:
            base = f"{self.method}@{self.ratio:g}" if isinstance(self.ratio, (int, float)) else f"{self.method}@{self.ratio}"
        if self.params:
            base += "[" + ",".join(f"{k}={v}" for k, v in self.params) + "]"
        base += "+sim" if self.kv_kind == KIND_SIMILARITY else ""
        return base + (f"{{{self.model}}}" if self.model else "")


def split_methods(spec: str) -> list[str]:
    """'kvlink:link_tokens=5,model=l5,epic' -> ['kvlink:link_tokens=5,model=l5', 'epic'].

    A piece with '=' and no ':' is one more parameter of the method before it, so a method's own
    parameters can be written with the same commas that separate methods.
    """
    out: list[str] = []
    for piece in (p.strip() for p in spec.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece:
            if not out:
                raise ValueError(f"parameter {piece!r} comes before any method in {spec!r}")
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def parse_method(spec: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """'samkv:update=fusion,block_size=8' -> ('samkv', (('update', 'fusion'), ('block_size', 8)))."""
    name, _, rest = spec.partition(":")
    params = []
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        params.append((k.strip(), parse_value(v.strip())))
    return name.strip(), tuple(params)


def parse_value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def make_settings(methods: Sequence[str], ratios: Sequence[float | str], similarity: bool = False) -> list[Setting]:
    """Full and reuse once each (the two ends), every other method at every ratio (ratio 0 is reuse).

    A method may carry parameters: `samkv:update=fusion`. `ratio=R` runs that method at R alone
    (`cacheblend:ratio=auto`). The parameter `model=NAME` runs the setting
    on a named model variant (`kvrag bench --adapter NAME=PATH`), `full:model=NAME` included; its
    answers are still scored against the base model's Full Attention. KVLink is also run at ratio 0
    (links alone), since its link tokens are computed even when no chunk token is.
    """
    out = [Setting("full"), Setting("reuse")]
    parsed = [parse_method(m) for m in methods]
    for m, params in parsed:
        model = str(dict(params).get("model", ""))
        own = [dict(params)["ratio"]] if "ratio" in dict(params) else None  # `m:ratio=auto`: this method at that ratio only
        params = tuple(p for p in params if p[0] not in ("model", "ratio"))
        if m in ("full", "reuse"):
            if model:
                out.append(Setting(m, params=params, model=model))
            continue
        keep = [r for r in (own or ratios) if r == "auto" or r > 0 or m.startswith("kvlink")]
        out += [Setting(m, r, params=params, model=model) for r in keep]
    if similarity:
        out += [Setting("reuse", 0.0, KIND_SIMILARITY)]
        out += [Setting(m, r, KIND_SIMILARITY, p) for m, p in parsed if m not in ("full", "reuse") for r in ratios if r == "auto" or r > 0]
    return out


def hardware() -> dict[str, Any]:
    info = {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        info["cpu"] = names[0] if names else ""
        info["cores"] = len(names)
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _done(path: Path) -> set[tuple[str, str]]:
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                done.add((r["example"], r["setting"]))
            except (ValueError, KeyError):
                continue  # a line cut off by an interruption
    return done


def _record(
    ex: Example, st: Setting, pre: Prefill, text: str, full_text: str, full: Prefill | None, own: tuple[Prefill, str] | None = None
) -> dict[str, Any]:
    """One answer's scores: against the gold answers, the base model's Full Attention (`full`) and
    Full Attention over the setting's own weights (`own`: the same as `full` for the base model)."""
    s = pre.stats
    own_pre, own_text = own if own is not None else (full, full_text)
    return {
        "example": ex.id,
        "setting": st.name,
        "method": st.method,
        "model": st.model,
        "ratio": 1.0 if st.method == "full" else (st.ratio if st.ratio != "auto" and st.method != "default" else s.recompute_ratio),
        "answered_with": s.method,  # what answered ("default": the engine's choice)
        "default": s.default,
        "default_reason": s.default_reason,
        "kv_kind": st.kv_kind,
        "answer": text,
        "f1": best_f1(text, ex.answers),
        "contains": contains(text, ex.answers),
        "agree": agreement(text, full_text),
        "kl": first_token_kl(full.logits, pre.logits) if full is not None else 0.0,
        "agree_own": agreement(text, own_text),
        "kl_own": first_token_kl(own_pre.logits, pre.logits) if own_pre is not None else 0.0,
        "ttft_s": s.ttft_s,
        "full_ttft_s": full.stats.ttft_s if full is not None else s.ttft_s,
        "load_s": s.load_s,
        "stitch_s": s.stitch_s,
        "select_s": s.select_s,
        "recompute_s": s.recompute_s,
        "prefill_s": s.prefill_s,
        "recomputed_tokens": s.recomputed_tokens,
        "context_tokens": s.context_tokens,
        "prompt_tokens": s.prompt_tokens,
        "decode_tok_s": s.decode_tokens_per_s,
        "bytes_loaded": s.bytes_loaded,
        "kept_kv_ratio": s.kept_kv_ratio,
        "kv_bytes": s.kv_bytes,
    }


@without_prefix_cache
def run(
    rag: KVRag,
    examples: Iterable[Example],
    settings: Sequence[Setting],
    out_dir: str | Path,
    max_new_tokens: int = 24,
    progress: bool = True,
    similarity_top_n: int = 2,
    variants: Mapping[str, KVRag] | None = None,
) -> Path:
    """Answer every example under every setting; returns the records file.

    `variants` are other engines (the same model with other weights, e.g. trained KVLink LoRA) that
    settings name with `Setting.model`; the reference for agreement, KL and the TTFT ratio stays
    `rag`'s Full Attention.
    """
    variants = dict(variants or {})
    missing = sorted({st.model for st in settings if st.model and st.model not in variants})
    if missing:
        raise ValueError(f"settings name model variants that were not given: {', '.join(missing)}")
    with contextlib.ExitStack() as paused:  # every engine's prefix cache, as the decorator pauses rag's: no answer is read from another
        for engine in variants.values():
            if getattr(engine, "prefix_cache", None) is not None:
                paused.enter_context(engine.prefix_cache.paused())
        return _run(rag, examples, settings, out_dir, max_new_tokens, progress, similarity_top_n, variants)


def _run(rag: KVRag, examples: Iterable[Example], settings: Sequence[Setting], out_dir: str | Path, max_new_tokens: int, progress: bool,
         similarity_top_n: int, variants: dict[str, KVRag]) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = out / "records.jsonl"
    done = _done(records)
    examples = list(examples)
    if any(st.kv_kind == KIND_SIMILARITY for st in settings):
        corpus = {c.id: c for ex in examples for c in ex.chunks}
        rag.precompute(list(corpus.values()), progress=progress)
        rag.precompute(list(corpus.values()), kind=KIND_SIMILARITY, top_n=similarity_top_n, progress=progress)
    bar = tqdm(total=len(examples) * len(settings), desc="bench", unit="answer", disable=not progress)
    with records.open("a") as f:
        for ex in examples:
            todo = [st for st in settings if (ex.id, st.name) not in done]
            bar.update(len(settings) - len(todo))
            if not todo:
                continue
            rag.precompute(ex.chunks, progress=False)  # offline work, not timed
            for name in sorted({st.model for st in todo if st.model}):
                variants[name].precompute(ex.chunks, progress=False)
            ids = [c.id for c in ex.chunks]
            rag.prefill(ex.question, ids, method="reuse")  # warm-up: the store serves from a warm page cache
            rag.prefill(ex.question, ids, method="full")  # ... and Full's first pass over these shapes is not its timed one
            full = rag.prefill(ex.question, ids, method="full")
            full_text = rag.decode(full, max_new_tokens=max_new_tokens).answer().text
            own_full: dict[str, tuple[Prefill, str]] = {"": (full, full_text)}  # each weights' own Full Attention
            for st in todo:
                engine = variants[st.model] if st.model else rag
                if st.model not in own_full and engine.lm is rag.lm:  # Full Attention always reads the base weights
                    own_full[st.model] = own_full[""]
                if st.model not in own_full:
                    ref = engine.prefill(ex.question, ids, method="full")
                    own_full[st.model] = (ref, engine.decode(ref, max_new_tokens=max_new_tokens).answer().text)
                if st.method == "full" and not st.params:
                    pre, text = own_full[st.model]
                elif st.method == "default":  # no method and no ratio named: what users get
                    pre = engine.prefill(ex.question, ids, kv_kind=st.kv_kind, **dict(st.params))
                    text = engine.decode(pre, max_new_tokens=max_new_tokens).answer().text
                else:
                    pre = engine.prefill(
                        ex.question, ids, method=st.method, recompute_ratio=st.ratio, kv_kind=st.kv_kind, **dict(st.params)
                    )
                    text = engine.decode(pre, max_new_tokens=max_new_tokens).answer().text
                f.write(json.dumps(_record(ex, st, pre, text, full_text, full, own_full[st.model])) + "\n")
                f.flush()
                bar.update(1)
    bar.close()
    return records
