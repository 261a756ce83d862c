"""The training loop: micro-batches, checkpoints (`--resume`), the loss plot and `train()`."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from kvrag.decode.stream import eos_ids
from kvrag.defaults import BASE_CHUNK_MODES, WEIGHTS_KEPT_MODES
from kvrag.engine import KVRag
from kvrag.kv.layout import PromptLayout
from kvrag.fuse.links import default_link_embeds
from kvrag.link_adapter import LinkAdapter, adapter_header, save_adapter
from kvrag.model.loading import LoadedModel, load_model
from kvrag.model.rope import Rotary
from kvrag.training.config import TrainConfig
from kvrag.training.data import build_example, load_rows
from kvrag.training.distill import Teacher, distill_example, distill_loss
from kvrag.training.passes import example_loss
from kvrag.training.trainables import export_adapter, lr_factor, optimizer_tensors, prepare_model, restore_optimizer

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    adapter_path: Path
    steps: int
    losses: list[float]
    adapter: LinkAdapter
    seconds: float = 0.0
    stopped_early: bool = False


def sample_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def micro_batches(n: int, cfg: TrainConfig, start_micro: int) -> Iterator[list[tuple[int, int]]]:
    """(epoch, row) of each example of each micro-batch from `start_micro` on: a pure function of the seed."""
    m = start_micro
    orders: dict[int, list[int]] = {}
    while True:
        batch = []
        for j in range(m * cfg.batch_size, (m + 1) * cfg.batch_size):
            epoch = j // n
            if epoch not in orders:
                orders = {epoch: sample_order(n, cfg.seed, epoch)}
            batch.append((epoch, orders[epoch][j % n]))
        yield batch
        m += 1


def total_steps(n: int, cfg: TrainConfig) -> int:
    if cfg.max_steps is not None:
        return int(cfg.max_steps)
    return max(1, math.ceil(cfg.epochs * n / (cfg.batch_size * cfg.grad_accum)))


def read_state(out: Path) -> dict[str, Any] | None:
    """OUT/checkpoint/state.json, or None when the run has no checkpoint yet."""
    path = out / "checkpoint" / "state.json"
    return json.loads(path.read_text()) if path.exists() else None


def check_resume_key(out: Path, state: dict[str, Any], cfg: TrainConfig) -> None:
    """Refuse a checkpoint written under other settings (another data order, another teacher...)."""
    if state.get("key") != json.loads(json.dumps(cfg.resume_key())):
        raise ValueError(f"{out}/checkpoint was written by a run with other settings: {state.get('key')}")


def schedule_total(state: dict[str, Any] | None, planned: int) -> int:
    """The schedule's length for a run resumed from `state`: the one it was saved with (which
    --fit-schedule may have shortened), so the learning rate of the next piece continues the same
    warm-up/cosine curve; a new --max-steps/--epochs (another plan) starts a new curve from here."""
    if state is None or "total" not in state or state.get("planned", state["total"]) != planned:
        return planned
    return int(state["total"])


def piece_over(cfg: TrainConfig, step: int, started: float) -> bool:
    """Whether this process's piece of the run ends before `step`: --stop-at reached, or
    --max-minutes spent (counted from this process's start). The run then saves its checkpoint,
    and --resume continues it at the same step, data position and learning rate."""
    if cfg.stop_at is not None and step >= cfg.stop_at:
        return True
    return cfg.max_minutes is not None and (time.perf_counter() - started) / 60 >= cfg.max_minutes


def save_checkpoint(out: Path, state: dict[str, Any], trainables: dict[str, torch.Tensor], opt_tensors: dict[str, torch.Tensor]) -> None:
    """OUT/checkpoint: trainable.safetensors, optimizer.safetensors, state.json; replaced atomically."""
    final = out / "checkpoint"
    tmp = out / ".checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in trainables.items()}, str(tmp / "trainable.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    old = out / ".checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


LOSS_LABELS = {"gold": "answer cross-entropy", "distill": "KL to base Full Attention"}


def plot_losses(losses: Sequence[float], path: Path, title: str = "", ylabel: str = LOSS_LABELS["gold"]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        log.warning("matplotlib is not installed: no loss plot")
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = list(range(1, len(losses) + 1))
    ax.plot(steps, losses, lw=1, alpha=0.5, label="loss")
    if len(losses) >= 5:
        w = max(2, len(losses) // 20)
        smooth = [sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1]) for i in range(len(losses))]
        ax.plot(steps, smooth, lw=2, label=f"mean of {w}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title or "KVLink training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


FIT_AFTER_STEPS = 4  # steps timed before --fit-schedule shortens the schedule
FIT_MARGIN_S = 30.0  # kept back for the last checkpoint and the adapter's export


def fitted_total(step: int, total: int, seconds_per_step: float, seconds_left: float) -> int:
    """The schedule's length when the remaining steps must end within `seconds_left` (never longer
    than planned, never shorter than the steps already taken plus one): why: a lent machine's time is
    fixed, and a cosine schedule cut off by --max-minutes would stop at a high learning rate."""
    affordable = int(max(0.0, seconds_left - FIT_MARGIN_S) / max(seconds_per_step, 1e-9))
    return max(step + 1, min(total, step + affordable))


def training_inputs(cfg: TrainConfig, lm: LoadedModel | None = None, rows: list[dict] | None = None,
                    provenance: list[dict] | None = None) -> tuple[LoadedModel, list[dict], list[dict] | None]:
    """The run's model and rows (with their provenance), each loaded from `cfg` unless passed: one
    place, so that the teacher-only pass (kvrag.training.ahead) reads the very rows `train` does."""
    if rows is None:
        if not cfg.data:
            raise ValueError("no training data: pass --data PATH (e.g. ../shared/data/nq10_dev.jsonl --rows 0:1200)")
        rows, provenance = load_rows(cfg.data, cfg.rows, cfg.allow_eval_rows)
    if not rows:
        raise ValueError("the training data selection is empty")
    if lm is None:
        lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
    return lm, rows, provenance


def train(cfg: TrainConfig, lm: LoadedModel | None = None, rows: list[dict] | None = None, provenance: list[dict] | None = None) -> TrainResult:
    """Run (or resume) a training; `lm`/`rows` let tests pass a model and data directly."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    given = lm is not None
    lm, rows, provenance = training_inputs(cfg, lm, rows, provenance)
    if not given:
        model = lm.model
        if cfg.mode == "full" and cfg.objective == "distill":  # lm.model stays the base weights: the teacher
            model = copy.deepcopy(model)
    else:  # never modify the caller's model
        model = lm.model if cfg.mode in WEIGHTS_KEPT_MODES else copy.deepcopy(lm.model)
    layout = PromptLayout(lm.tokenizer, **({"system_prompt": cfg.system_prompt} if cfg.system_prompt else {}))
    header = adapter_header(lm, cfg.link_tokens, cfg.mode, layout.identity, data=provenance or [{"source": "in-memory rows", "count": len(rows)}])
    device = lm.device

    links = torch.nn.Parameter(default_link_embeds(model, cfg.link_tokens, cfg.max_chunks).to(device))
    model, named = prepare_model(model, cfg)
    teacher = None
    if cfg.objective == "distill":  # the base weights: lora's model with the adapter off, full's untouched lm.model
        teacher = Teacher(lm.model if cfg.mode == "full" else model, eos_ids(lm), cfg.teacher_tokens, cfg.teacher_topk,
                          lm.fingerprint, out / "teacher" if cfg.teacher_cache else None)
    groups = [{"params": [links], "lr": cfg.link_lr, "weight_decay": 0.0, "base_lr": cfg.link_lr}]
    if named:
        groups.append({"params": [p for _, p in named], "lr": cfg.lr, "weight_decay": cfg.weight_decay, "base_lr": cfg.lr})
    params = [links] + [p for _, p in named]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)

    step, losses, elapsed_before, generated_before = 0, [], 0.0, 0
    state = read_state(out) if cfg.resume else None
    if state is not None:
        check_resume_key(out, state, cfg)
        saved = load_file(str(out / "checkpoint" / "trainable.safetensors"))
        with torch.no_grad():
            links.copy_(saved["links"].to(device))
            for n, p in named:
                p.copy_(saved[f"param.{n}"].to(p.device, p.dtype))
        restore_optimizer(opt, params, load_file(str(out / "checkpoint" / "optimizer.safetensors")))
        step, losses, elapsed_before = int(state["step"]), list(state["losses"]), float(state.get("elapsed_s", 0.0))
        generated_before = int(state.get("teacher_generated", 0))
        log.info("resuming %s at step %d", out, step)

    planned = total_steps(len(rows), cfg)
    total = schedule_total(state, planned)
    rag, rotary = None, None
    if cfg.mode in BASE_CHUNK_MODES:  # the base weights encode the chunks: their KV from the engine's store, computed once per passage
        rag = KVRag(lm, store=cfg.store, layout=layout, check=False, link_adapter=None)
    else:
        rotary = Rotary(model.get_base_model() if hasattr(model, "get_base_model") else model)

    def checkpoint() -> None:
        trainables = {"links": links.detach()}
        trainables.update({f"param.{n}": p.detach() for n, p in named})
        state = {
            "step": step,
            "losses": losses,
            "key": cfg.resume_key(),
            "config": asdict(cfg),
            "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            "total": total,  # the schedule's length (a fitted one included): the next piece's lr curve
            "planned": planned,
            "next_micro_batch": step * cfg.grad_accum,  # the data position: micro_batches() resumes here
            "teacher_generated": generated_before + (teacher.generated if teacher is not None else 0),
        }
        save_checkpoint(out, state, trainables, optimizer_tensors(opt, params))
        plot_losses(losses, out / "loss.png", ylabel=LOSS_LABELS[cfg.objective])

    what = f"{cfg.mode}, K={cfg.link_tokens}" + (", distill" if teacher is not None else "")
    bar = tqdm(total=total, initial=step, desc=f"train-links ({what})", unit="step", disable=not cfg.progress)
    feed = micro_batches(len(rows), cfg, step * cfg.grad_accum)
    stopped_early = False
    first_step, t_loop = step, time.perf_counter()
    while step < total:
        if cfg.fit_schedule and cfg.max_minutes is not None and step == first_step + FIT_AFTER_STEPS:
            total = fitted_total(step, total, (time.perf_counter() - t_loop) / FIT_AFTER_STEPS,
                                 cfg.max_minutes * 60 - (time.perf_counter() - t_start))
            bar.total = total
            bar.refresh()
        if piece_over(cfg, step, t_start):
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        step_picks = [next(feed) for _ in range(cfg.grad_accum)]
        if teacher is not None:  # the step's targets in one batched generation (a GPU's teacher is then not one example at a time)
            step_examples = [[distill_example(layout, rows[i], cfg, e, i) for e, i in picks] for picks in step_picks]
            teacher.targets_many([ex for micro in step_examples for ex in micro])
        for m, picks in enumerate(step_picks):
            if teacher is not None:
                examples = step_examples[m]
                loss = distill_loss(model, teacher, examples, links, cfg.max_chunks, rag=rag, rotary=rotary, ce_weight=cfg.ce_weight)
                loss = loss / cfg.grad_accum
            else:
                examples = [
                    build_example(
                        layout, rows[i], random.Random(f"{cfg.seed}:{e}:{i}"), cfg.links, cfg.max_chunks, cfg.max_tokens,
                        cfg.min_chunks,
                    )
                    for e, i in picks
                ]
                loss = example_loss(model, examples, links, cfg.max_chunks, rag=rag, rotary=rotary) / cfg.grad_accum
            loss.backward()
            step_loss += float(loss.detach())
        opt.step()
        step += 1
        losses.append(step_loss)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{opt.param_groups[0]['lr']:.2e}")
        if cfg.save_every and step % cfg.save_every == 0 and step < total:
            checkpoint()
    bar.close()
    checkpoint()
    seconds = elapsed_before + time.perf_counter() - t_start
    unused = () if cfg.objective == "distill" else ("teacher_tokens", "teacher_topk", "ce_weight", "continue_share", "turn_share",
                                                   "teacher_cache", "teacher_only", "teacher_batch")
    header["training"] = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("out", "progress", "resume", "adapter_out", "store", "stop_at") + unused},
        "steps": step,
        "total_steps": total,
        "examples": len(rows),
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "seconds": round(seconds, 1),
        "device": str(device),
        "torch": torch.__version__,
        "stopped_early": stopped_early,
        "examples_seen": step * cfg.batch_size * cfg.grad_accum,
    }
    if teacher is not None:
        header["training"]["teacher_generated"] = teacher.generated  # targets computed by this process (not read from OUT/teacher)
        header["training"]["teacher_generated_run"] = generated_before + teacher.generated  # by every piece of the run
    adapter = export_adapter(model, links, cfg, header)
    path = save_adapter(cfg.adapter_out or out / "adapter.safetensors", adapter)
    plot_losses(losses, out / "loss.png", ylabel=LOSS_LABELS[cfg.objective])
    (out / "train_summary.json").write_text(json.dumps({"adapter": str(path), **header["training"], "losses": losses}, indent=1))
    return TrainResult(path, step, losses, adapter, seconds, stopped_early)

