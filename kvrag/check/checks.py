"""The per-model correctness gate: is KV reuse exact on *this* model, device and dtype?

kvrag's answers are only as good as three invariants, and each depends on model code kvrag does
not own (its rotary embedding, its attention, its masks). So instead of trusting a list of
architectures, the gate measures them on the user's own model, through the engine's own code
paths (precompute -> store -> stitch -> recompute), with a tiny prompt:

1. re-rotated keys: a chunk's stored RoPE-free keys, rotated by `Rotary` to a far-away position,
   equal the keys the model computes for the same tokens placed there;
2. reuse = full (1 chunk): one chunk after the system prompt, reused from the store, gives Full
   Attention's first-token logits;
3. recompute 1.0 = full (2 chunks): the shared recompute pass with every chunk token selected
   gives Full Attention's logits.

Each numeric check is judged against the model's own noise: the same computation in the model's
dtype vs in fp32 on the same weights (kvrag/check/noise.py), times MULTIPLE, above a per-dtype floor
(fp32: noise 0, tolerance 1e-4). The report and the cached verdict keep noise, multiple, tolerance.

Static pre-checks come first (RoPE present, its variant, partial rotary, sliding windows,
attention sinks). A failure raises `UnsupportedModelError` naming the failing check(s), never a
silently wrong answer. `gate()` runs it once per model fingerprint and device type and keeps the
verdict under `$KVRAG_HOME/checks/<fingerprint>.json`.
"""

from __future__ import annotations

import copy
import logging
import os
import time

from typing import Any

import torch

from kvrag.check.report import CheckReport, CheckRow
from kvrag.check.noise import FLOORS, MULTIPLE, describe, judge, reference_keys, reference_logits
from kvrag.errors import UnsupportedModelError
from kvrag.model.loading import (
    LoadedModel,
    check_supported,
    context_limits,
    decoder_of,
    from_model,
    load_model,
    resolve_device,
    resolve_dtype,
    text_config,
)
from kvrag.model.cache import cache_arg, cache_kv, empty_cache
from kvrag.core import KVRagCore
from kvrag.kv.kinds import KIND_CHUNK
from kvrag.model.cache import stack_layers
from kvrag.types import Chunk

log = logging.getLogger(__name__)


# Tolerances on relative L2 errors, ||got - want|| / ||want|| over the compared tensor (each
# layer's keys; the vocabulary's logits), so they mean the same for a tiny random model and a 7B
# one whose logits reach 30. They are not fixed per dtype: bf16 rounding grows with depth (a
# random-weight Llama-3.1-8B shape's reuse error is 6.7e-2 on keys, 4.7e-2 on logits, on an
# H100, against 1.5e-2 / 5e-3 on 3..30-layer models), so each numeric check measures the model's
# own noise -- the same computation in the model's dtype vs in fp32 on the same weights -- and
# allows `MULTIPLE` x that, never less than a per-dtype floor (kvrag/check/noise.py). In float32
# the noise is 0 and the tolerance is the floor, 1e-4: reused and in-place computations differ only
# by accumulated rounding (<= 5e-6 measured), 1000x below a real defect (a key rotated one position
# off: 3.5e-1; a sliding window shorter than the prompt: 9e-2 .. 2.5e-1).
#
# TOLERANCES is the old fixed table, used only when the noise cannot be measured (the fp32
# reference pass raised); its float32 row is the floor.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"keys": 1e-4, "logits": 1e-4},
    torch.bfloat16: {"keys": 4e-2, "logits": 3e-2},
    torch.float16: {"keys": 1e-2, "logits": 1e-2},
}

# The check's prompt: two short chunks and a question (tiny, so the gate costs well under a second).
CHECK_CHUNKS = (
    Chunk("kvrag-check-a", "The Brannoch Line opened in 1893 between Aldport and Kessock. Its trains crossed the river on a stone viaduct."),
    Chunk("kvrag-check-b", "Honeybees turn nectar into honey inside the hive. They fan their wings to evaporate the water."),
)
CHECK_QUESTION = "When did the Brannoch Line open?"
KEY_SHIFT = 1024  # re-rotated keys are moved this far (or as far as the model's context allows)

ROWS = ("architecture", "rope variant", "partial rotary", "sliding window", "attention sinks",
        "re-rotated keys", "reuse = full (1 chunk)", "recompute 1.0 = full")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error ||got - want|| / ||want|| (NaN if either is not finite)."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all() or not torch.isfinite(want).all():
        return float("nan")
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}"


# -- static checks ----------------------------------------------------------------------------
def _static_rows(lm: LoadedModel, prompt_tokens: int) -> list[CheckRow]:
    model = lm.model
    cfg = text_config(model)
    rows: list[CheckRow] = []
    dec = decoder_of(model)
    rows.append(CheckRow("architecture", True, message=f"{type(model).__name__}, {len(dec.layers)} layers, RoPE"))

    rotary = dec.rotary_emb
    rope_type = getattr(rotary, "rope_type", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    limits = context_limits(model)
    if isinstance(rope_type, dict):  # per-layer-type ropes (Gemma 3): the key check decides
        rows.append(CheckRow("rope variant", True, message="per layer type: " + ", ".join(f"{k}={v}" for k, v in sorted(rope_type.items()))))
    elif "rope" in limits:
        rows.append(CheckRow("rope variant", True, message=f"{rope_type}: {limits['rope'][1]}"))
    else:
        rows.append(CheckRow("rope variant", True, message=str(rope_type)))

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv = getattr(rotary, "inv_freq", None)
    rot_dim = int(inv.numel() * 2) if isinstance(inv, torch.Tensor) else head_dim
    if rot_dim < head_dim:
        rows.append(CheckRow("partial rotary", True, message=f"rotary dim {rot_dim} of head dim {head_dim}: exact only if the key check passes"))
    else:
        rows.append(CheckRow("partial rotary", True, message="none"))

    if "sliding" in limits:
        window, why = limits["sliding"]
        if window < prompt_tokens:
            rows.append(CheckRow(
                "sliding window", False,
                message=f"sliding_window={window} is shorter than the check's {prompt_tokens}-token prompt; kvrag's stitched "
                "attention is full attention, exact only while a prompt fits in the window",
            ))
        else:
            rows.append(CheckRow("sliding window", True, message=why))
    else:
        rows.append(CheckRow("sliding window", True, message="none"))

    sinks = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in ("sinks", "attn_sinks", "sink")]
    if sinks or getattr(cfg, "attention_sinks", None):
        rows.append(CheckRow(
            "attention sinks", False,
            message=f"learned attention-sink logits ({sinks[0] if sinks else 'config'}): kvrag's attention probes "
            "(method selection, SnapKV eviction) compute softmax without them",
        ))
    else:
        rows.append(CheckRow("attention sinks", True, message="none"))
    return rows


# -- numeric checks ---------------------------------------------------------------------------
def _judge(name: str, errs: list[float], noises: list[float] | None, dtype: torch.dtype, kind: str, note: str) -> CheckRow:
    """One row from per-part errors (a layer's keys; the logits), each judged against its own noise
    (`check_noise.judge`); `noises` None: not measurable, the fixed TOLERANCES apply."""
    v = judge(errs, noises, dtype, kind, TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])[kind])
    where = f"; worst at layer {v.index}" if len(errs) > 1 else ""
    return CheckRow(name, v.passed, v.error, v.tolerance, note + where + v.remark, v.noise, v.multiple)


def _noise(fn: Any) -> list[float] | None:
    """The model's own noise, or None (logged) when the fp32 reference cannot be run."""
    try:
        return fn()
    except Exception:
        log.warning("model check: could not measure the noise floor; using the fixed tolerances", exc_info=True)
        return None


def _key_check(rag: Any) -> CheckRow:
    """Stored RoPE-free keys of a chunk, re-rotated to a far position == keys computed there in place."""

    lm, layout = rag.lm, rag.layout
    ids = layout.chunk_ids(CHECK_CHUNKS[0])
    entry = rag.store.get(rag._key(KIND_CHUNK, ids))  # what precompute stored: the engine's own path
    if entry is None:
        raise RuntimeError("the chunk's KV was not stored by precompute")
    prefix = list(layout.prefix_ids)
    s, n = len(prefix), len(ids)
    shift = max(0, min(KEY_SHIFT, lm.max_context - s - n - 1))
    seq = torch.tensor([prefix + ids], device=lm.device)
    cache = empty_cache()
    positions = torch.arange(shift, shift + s + n, device=lm.device)[None]
    with torch.no_grad():  # prefix + chunk, the whole sequence moved by `shift`
        lm.model(input_ids=seq, position_ids=positions, **cache_arg(lm.model, cache), use_cache=True, logits_to_keep=1)
    want, _ = stack_layers(cache_kv(cache), s, s + n)
    got = rag.rotary.rotate(entry.keys.to(lm.device, lm.dtype), torch.arange(shift + s, shift + s + n))
    errs = [_rel(g, w) for g, w in zip(got, want)]  # per layer: layers differ in scale and in noise
    noises = [0.0] * len(errs) if lm.dtype == torch.float32 else _noise(
        lambda: [_rel(w, r) for w, r in zip(want, reference_keys(lm.model, seq, positions, s, s + n))])
    return _judge("re-rotated keys", errs, noises, lm.dtype, "keys", f"{want.shape[0]} layers, {n} tokens moved from {s} to {shift + s}")


def _logits_row(name: str, want: Any, got: Any, lm: LoadedModel, note: str) -> CheckRow:
    """got vs want (Full Attention), judged against how far Full Attention's own logits are from fp32's."""
    err = _rel(got.logits, want.logits)
    same_top = int(got.logits.argmax()) == int(want.logits.argmax())
    noise = [0.0] if lm.dtype == torch.float32 else _noise(
        lambda: [_rel(want.logits, reference_logits(lm.model, want.segments.all_ids(), lm.device))])
    return _judge(name, [err], noise, lm.dtype, "logits", note + ("" if same_top else "; top token differs"))


def _numeric_rows(lm: LoadedModel, rag: Any) -> list[CheckRow]:
    rows: list[CheckRow] = []
    a, b = (c.id for c in CHECK_CHUNKS)

    def run(name: str, fn: Any) -> None:
        try:
            rows.append(fn())
        except Exception as exc:  # a model the engine cannot even run: that is the verdict
            log.debug("check %s raised", name, exc_info=True)
            rows.append(CheckRow(name, False, message=_short(exc)))

    run("re-rotated keys", lambda: _key_check(rag))
    run("reuse = full (1 chunk)", lambda: _logits_row(
        "reuse = full (1 chunk)",
        rag.prefill(CHECK_QUESTION, [a], method="full"),
        rag.prefill(CHECK_QUESTION, [a], method="reuse"),
        lm, "first-token logits, chunk KV from the store",
    ))

    def recompute_all() -> CheckRow:
        full = rag.prefill(CHECK_QUESTION, [a, b], method="full")
        every = rag.prefill(CHECK_QUESTION, [a, b], method="epic", recompute_ratio=1.0)
        n = full.segments.context_len - len(full.segments.prefix)
        if every.stats.recomputed_tokens != n:
            return CheckRow("recompute 1.0 = full", False, message=f"recomputed {every.stats.recomputed_tokens} of {n} chunk tokens")
        return _logits_row("recompute 1.0 = full", full, every, lm, f"2 chunks, all {n} chunk tokens recomputed")

    run("recompute 1.0 = full", recompute_all)
    return rows


# -- entry points -----------------------------------------------------------------------------
def _as_loaded(lm_or_model: Any, device: Any, dtype: Any, tokenizer: Any) -> LoadedModel:
    """A LoadedModel on the asked device/dtype (None or "auto" keep a given model's own)."""
    if isinstance(lm_or_model, (str, os.PathLike)):
        return load_model(None if str(lm_or_model) == "bundled" else lm_or_model, device=device or "auto", dtype=dtype or "auto")
    if isinstance(lm_or_model, LoadedModel):
        lm = lm_or_model
    else:
        if tokenizer is None:
            raise ValueError("check_model(model) needs tokenizer=...; or pass a LoadedModel, a model id or a path")
        lm = from_model(lm_or_model, tokenizer)
    want_device = resolve_device(device) if device is not None else lm.device
    want_dtype = resolve_dtype(dtype) if dtype not in (None, "auto") else lm.dtype
    moved = want_device.type != lm.device.type or (want_device.index is not None and want_device != lm.device)
    if moved or want_dtype != lm.dtype:  # check a copy; never touch the user's model
        model = copy.deepcopy(lm.model).to(want_device, want_dtype)
        lm = from_model(model, lm.tokenizer, source=lm.source)
    return lm


def _refused(source: str, exc: Exception, device: str, dtype: str, seconds: float = 0.0) -> CheckReport:
    """The report of a model that cannot even be wrapped (no decoder stack, no RoPE, ...)."""
    rows = [CheckRow("architecture", False, message=str(exc))] + [CheckRow(n, None, message="skipped") for n in ROWS[1:]]
    return CheckReport(source, "", device, dtype.removeprefix("torch."), rows, seconds)


def run_checks(lm: LoadedModel) -> CheckReport:
    """Every check on this loaded model as it is (its device and dtype)."""

    t0 = time.perf_counter()
    report = CheckReport(lm.source, lm.fingerprint, lm.device.type, str(lm.dtype).removeprefix("torch."))
    rag = None
    try:
        check_supported(lm.model)
        rag = KVRagCore(lm, store="memory://")
        seg = rag.layout.segments([rag.layout.chunk_ids(c) for c in CHECK_CHUNKS], CHECK_QUESTION)
        report.rows = _static_rows(lm, seg.total_len)
    except Exception as exc:
        report.rows = [CheckRow("architecture", False, message=_short(exc))]
    if rag is not None and all(r.passed for r in report.rows):
        try:
            rag.precompute(list(CHECK_CHUNKS), progress=False)
        except Exception as exc:
            report.rows.append(CheckRow("re-rotated keys", False, message="precompute failed: " + _short(exc)))
        else:
            numeric = _numeric_rows(lm, rag)
            report.rows += numeric
            unmeasured = any(r.error is not None and r.noise is None for r in numeric)
            report.reference = "not measured (the fp32 reference pass failed): fixed tolerances" if unmeasured else describe(lm.dtype)
    done = {r.name for r in report.rows}
    report.rows += [CheckRow(n, None, message="skipped") for n in ROWS if n not in done]
    partial = next((r for r in report.rows if r.name == "partial rotary" and r.message != "none"), None)
    if partial is not None:  # say why a partial-rotary model fails its numeric checks
        for r in report.rows:
            if r.passed is False and r.name in ROWS[5:]:
                r.message += f" (partial rotary: {partial.message.split(':')[0]})"
    report.seconds = time.perf_counter() - t0
    return report


def check_model(lm_or_model: Any, device: Any = None, dtype: Any = None, *, tokenizer: Any = None) -> CheckReport:
    """Run every check on a model and return the report (a failing model raises nothing here: see
    `CheckReport.raise_if_failed`).

    `lm_or_model`: a LoadedModel, a HF model (with `tokenizer=`), or a HF id / folder / .gguf path
    / "bundled". `device`/`dtype` (None keeps a given model's own; "auto" = CUDA + bfloat16 when a
    GPU is there, else CPU + float32) check a copy when they differ from a given model's.
    """
    t0 = time.perf_counter()
    try:
        lm = _as_loaded(lm_or_model, device, dtype, tokenizer)
    except UnsupportedModelError as exc:
        source = str(lm_or_model) if isinstance(lm_or_model, (str, os.PathLike)) else type(lm_or_model).__name__
        params = next(lm_or_model.parameters(), None) if hasattr(lm_or_model, "parameters") else None
        dev = params.device.type if params is not None and device is None else resolve_device(device or "auto").type
        dt = str(params.dtype if params is not None and dtype in (None, "auto") else resolve_dtype(dtype, dev))
        return _refused(source, exc, dev, dt, time.perf_counter() - t0)
    return run_checks(lm)


__all__ = ["FLOORS", "MULTIPLE", "CheckReport", "CheckRow", "TOLERANCES", "check_model", "run_checks"]
