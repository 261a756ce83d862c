"""`kvrag train-links`: fine-tune KVLink link tokens (and optionally LoRA or every weight).

A training example is a prompt laid out as at inference,

    [system prefix | chunk 1 | links(1) | ... | chunk N | links(N) | question | answer]

and it is computed the way inference computes it, so the model is trained on exactly what it will
see (tested: the training pass reproduces the engine's first-token logits):

1. the context: each chunk's KV computed after the system prefix alone (precompute), its keys
   re-rotated to the chunk's place in the prompt (stitch). Mode `links` reads it from the engine's
   KV store (the model is frozen, so every passage is computed once for the whole run); modes
   `lora`/`full` encode it here, with gradients, in one forward whose mask is the picture's chunk rows;
2. the pass: the link tokens, the question and the answer in one forward over that context, at
   their inference positions, under KVLink's picture (`kvrag.links.link_picture`, the function the
   inference pass draws its mask with): link tokens, question and answer see every earlier position.

The loss is the cross-entropy of the answer tokens only. Modes:

- `links`: only the link embeddings train (new rows beside the frozen vocabulary);
- `lora`: LoRA factors (through `peft`, `pip install kvrag[train]`) plus the links;
- `full`: every weight plus the links.

Data: JSONL rows shaped like `shared/data/*.jsonl` ({question, answers[], ctxs[{title,text}],
gold_index, source}); `--data PATH` (repeatable, `PATH@START:END` for a row range, else `--rows`).
Each example's chunk order is shuffled with the gold passage moved to a random position (KVLink
App. A.5), seeded by (seed, epoch, row), so a run is reproducible and resumable. Rows 1200-1599 of
nq10_dev.jsonl are the evaluation split and refused. Every source file's path, sha256, row range
and the rows' own `source` fields go into the adapter's header.

Batching (right-padded micro-batches, one forward per stage), gradient accumulation, AdamW with
warm-up and cosine decay, fixed seeds; a checkpoint (safetensors + JSON only) every `--save-every` steps in OUT/checkpoint, which
`--resume` continues from exactly; a tqdm bar with the loss; OUT/loss.png; OUT/adapter.safetensors.
The same command runs on the CPU for the bundled model and on CUDA for bigger ones.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file

from kvrag.eval.data import parse_range
from kvrag.fuse import HIDDEN_POSITION
from kvrag.layout import LINK_PLACEHOLDER, PromptLayout, Segments
from kvrag.links import (
    DEFAULT_MAX_CHUNKS,
    MODES,
    LinkAdapter,
    adapter_header,
    additive,
    default_link_embeds,
    link_picture,
    link_row_index,
    save_adapter,
)
from kvrag.model import LoadedModel
from kvrag.types import Chunk

log = logging.getLogger(__name__)

EVAL_FILE = "nq10_dev.jsonl"
EVAL_ROWS = (1200, 1600)  # never trained on: the evaluation split
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"


# -- configuration ------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    out: str
    data: list[str] = field(default_factory=list)  # PATH or PATH@START:END
    rows: str = "0:1200"  # row range for --data entries without their own
    model: str | None = None  # HF id, folder, .gguf; None: the bundled SmolLM2
    mode: str = "links"
    link_tokens: int = 5
    max_chunks: int = DEFAULT_MAX_CHUNKS
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    batch_size: int = 1
    grad_accum: int = 8
    lr: float = 1e-4  # LoRA factors / full weights
    link_lr: float = 5e-3  # link embeddings
    weight_decay: float = 0.0
    warmup: int = 10
    min_lr_ratio: float = 0.1
    lora_r: int = 16
    lora_alpha: int = 32
    lora_targets: str = DEFAULT_LORA_TARGETS
    seed: int = 0
    save_every: int = 25
    max_tokens: int = 2048  # longest example; trailing non-gold passages are dropped to fit
    max_minutes: float | None = None  # stop (and save) after this long
    device: str = "auto"
    dtype: str = "auto"
    grad_checkpointing: bool = False
    resume: bool = False
    allow_eval_rows: bool = False
    progress: bool = True
    adapter_out: str | None = None  # default OUT/adapter.safetensors
    store: str | None = None  # mode links: the KV store chunk KV is read from / kept in (default: kvrag's own)
    system_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.link_tokens < 0 or self.max_chunks < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("link_tokens >= 0, max_chunks >= 1, batch_size >= 1 and grad_accum >= 1 are required")
        if self.mode == "links" and self.link_tokens == 0:
            raise ValueError("mode 'links' with 0 link tokens has nothing to train")

    def resume_key(self) -> dict[str, Any]:
        """What must not change between a run and its resumption."""
        keys = ("data", "rows", "model", "mode", "link_tokens", "max_chunks", "batch_size", "grad_accum", "seed", "max_tokens",
                "lora_r", "lora_alpha", "lora_targets", "system_prompt")
        return {k: getattr(self, k) for k in keys}


# -- data ---------------------------------------------------------------------------------------
def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_rows(specs: Sequence[str], default_rows: str = "0:1200", allow_eval_rows: bool = False) -> tuple[list[dict], list[dict]]:
    """Rows of every `PATH[@START:END]` and their provenance (path, sha256, range, count, sources)."""
    rows: list[dict] = []
    provenance: list[dict] = []
    for spec in specs:
        path_s, _, rng = spec.partition("@")
        path = Path(path_s).expanduser()
        start, end = parse_range(rng or default_rows)
        if path.name == EVAL_FILE and not allow_eval_rows:
            hi = end if end is not None else 1 << 30
            if start < EVAL_ROWS[1] and hi > EVAL_ROWS[0]:
                raise ValueError(
                    f"rows {start}:{end} of {path.name} overlap {EVAL_ROWS[0]}-{EVAL_ROWS[1] - 1}, the evaluation split, "
                    "which is never trained on (use rows 0:1200)"
                )
        with open(path, encoding="utf-8") as f:
            lines = [line for line in f if line.strip()]
        picked = [json.loads(line) for line in lines[start:end]]
        sources = sorted({str(r.get("source", "")) for r in picked if r.get("source")})
        provenance.append(
            {
                "path": str(path),
                "file": path.name,
                "sha256": file_sha256(path),
                "rows": f"{start}:{end if end is not None else len(lines)}",
                "count": len(picked),
                "sources": sources[:8] + ([f"... {len(sources) - 8} more"] if len(sources) > 8 else []),
            }
        )
        rows.extend(picked)
    return rows, provenance


@dataclass
class Example:
    segments: Segments  # with link slots
    answer: list[int]  # answer token ids (+ end of turn)
    gold: int | None  # the gold passage's chunk index after shuffling
    chunks: list[Chunk] = field(default_factory=list)  # the passages, in prompt order

    @property
    def length(self) -> int:
        return self.segments.total_len + len(self.answer)


def shuffled_passages(row: dict, rng: random.Random) -> tuple[list[dict], int | None]:
    """The row's passages in a shuffled order with the gold one at a random position (KVLink App. A.5)."""
    ctxs = list(row.get("ctxs") or [])
    gold = row.get("gold_index")
    if gold is None or not 0 <= int(gold) < len(ctxs):
        rng.shuffle(ctxs)
        return ctxs, None
    g = ctxs.pop(int(gold))
    rng.shuffle(ctxs)
    at = rng.randrange(len(ctxs) + 1)
    ctxs.insert(at, g)
    return ctxs, at


def answer_ids(layout: PromptLayout, answer: str) -> list[int]:
    tok = layout.tokenizer
    ids = list(tok(answer, add_special_tokens=False)["input_ids"])
    eos = getattr(tok, "eos_token_id", None)
    return ids + ([int(eos)] if isinstance(eos, int) else [])


def build_example(layout: PromptLayout, row: dict, rng: random.Random, link_tokens: int, max_chunks: int, max_tokens: int) -> Example:
    ctxs, gold = shuffled_passages(row, rng)
    if gold is not None and gold >= max_chunks:  # keep the gold passage: it replaces the last one kept
        ctxs, gold = ctxs[: max_chunks - 1] + [ctxs[gold]], max_chunks - 1
    ctxs = ctxs[:max_chunks]
    chunks = [Chunk(id=f"p{i}", text=str(c.get("text", "")), title=str(c.get("title", "") or "")) for i, c in enumerate(ctxs)]
    ans = answer_ids(layout, str((row.get("answers") or [""])[0]))
    question = layout.question_ids(str(row["question"]))
    while True:
        seg = Segments(list(layout.prefix_ids), [layout.chunk_ids(c) for c in chunks], question, links=link_tokens)
        if seg.total_len + len(ans) <= max_tokens or len(chunks) <= 1:
            return Example(seg, ans, gold, chunks)
        drop = max(i for i in range(len(chunks)) if i != gold)  # the last non-gold passage
        chunks = chunks[:drop] + chunks[drop + 1 :]
        if gold is not None and gold > drop:
            gold -= 1


def training_mask(segments: Segments, length: int) -> torch.Tensor:
    """Boolean [length, length]: KVLink's picture over prompt + answer. Every mask the model sees, in
    training (both stages) and at inference (the recompute pass), is a block of this one."""
    pos = torch.arange(length)
    return link_picture(segments, pos, pos)


def context_positions(segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
    """Global and precompute-time (local) positions of the context tokens: the prefix, then every chunk's tokens.

    A chunk's KV is computed with the chunk right after the prefix (local positions), then its keys
    are re-rotated to where the chunk sits in the prompt (global positions), as at inference.
    """
    p = len(segments.prefix)
    glob, loc = [torch.arange(p)], [torch.arange(p)]
    for start, chunk in zip(segments.chunk_starts, segments.chunks):
        glob.append(torch.arange(start, start + len(chunk)))
        loc.append(torch.arange(p, p + len(chunk)))
    return torch.cat(glob), torch.cat(loc)


@dataclass
class Context:
    """The stitched context of a batch: per-layer KV over prefix + chunk tokens (no link slots), keys at global positions."""

    keys: list[torch.Tensor]  # per layer [b, kv_heads, slots, head_dim]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [b, slots]; right padding at HIDDEN_POSITION


def _pad_stack(tensors: Sequence[torch.Tensor], width: int, dim: int, value: float = 0.0) -> torch.Tensor:
    out = []
    for t in tensors:
        pad = width - t.shape[dim]
        if pad:
            shape = list(t.shape)
            shape[dim] = pad
            t = torch.cat([t, t.new_full(shape, value)], dim=dim)
        out.append(t)
    return torch.stack(out)


def load_context(rag: Any, examples: Sequence[Example]) -> Context:
    """Context KV from the engine (store hits; misses computed and kept), stitched exactly as at inference.

    Mode `links` reads it this way: the base model is frozen, so a chunk's KV never changes and each
    passage is computed once for the whole run (and shared with inference through the store).
    """
    keys, values, positions = [], [], []
    for e in examples:
        st = rag.stitched(e.chunks, e.segments)
        glob, _ = context_positions(e.segments)
        slots = st.slots_of(glob).to(st.keys.device)
        keys.append(st.keys[:, :, slots])
        values.append(st.values[:, :, slots])
        positions.append(glob)
    width = max(p.numel() for p in positions)
    k = _pad_stack(keys, width, dim=2)  # [b, layers, h, slots, d]
    v = _pad_stack(values, width, dim=2)
    pos = _pad_stack(positions, width, dim=0, value=HIDDEN_POSITION).to(k.device)
    return Context([k[:, i] for i in range(k.shape[1])], [v[:, i] for i in range(v.shape[1])], pos)


def encode_context(model: Any, rotary: Any, examples: Sequence[Example]) -> Context:
    """Context KV computed here (with gradients: modes `lora` and `full`, where the model that encodes
    the chunks is the one being trained): one forward over [prefix | chunk 1 | ... | chunk N], chunk
    tokens at their precompute positions under the picture's chunk rows (prefix + own chunk), then
    keys re-rotated to their global positions, as precompute + stitch do."""
    from kvrag.cache import empty_cache

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    glob, loc, ids = [], [], []
    for e in examples:
        g, l = context_positions(e.segments)
        glob.append(g)
        loc.append(l)
        ids.append(torch.tensor(e.segments.prefix + [t for c in e.segments.chunks for t in c]))
    width = max(g.numel() for g in glob)
    input_ids = _pad_stack(ids, width, dim=0).to(device)
    rope_pos = _pad_stack(loc, width, dim=0).to(device)  # pads at position 0: finite, and never attended to
    mask_pos = _pad_stack(glob, width, dim=0, value=HIDDEN_POSITION)
    allowed = torch.stack([link_picture(e.segments, mask_pos[b], mask_pos[b]) for b, e in enumerate(examples)])[:, None]
    # pad rows (query at HIDDEN) may see everything: no empty softmax row; real rows never see a pad
    mask = additive(allowed, dtype).to(device)
    cache = empty_cache()
    model(input_ids=input_ids, position_ids=rope_pos, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    keys, values = [], []
    for layer in cache.layers:
        k_rows = []
        for b, e in enumerate(examples):
            p, n = len(e.segments.prefix), glob[b].numel()
            kb = layer.keys[b : b + 1]
            chunk = rotary.rotate(rotary.unrotate(kb[:, :, p:n], loc[b][p:]), glob[b][p:])
            k_rows.append(torch.cat([kb[:, :, :p], chunk.to(kb.dtype), kb[:, :, n:]], dim=2))
        keys.append(torch.cat(k_rows))
        values.append(layer.values)
    return Context(keys, values, mask_pos.to(device))


@dataclass
class PassBatch:
    """The tokens of the pass over the context: every link slot, the question, the answer."""

    input_ids: torch.Tensor  # [b, q]
    positions: torch.Tensor  # [b, q]
    mask: torch.Tensor  # [b, 1, q, slots + q] additive
    is_link: torch.Tensor  # [b, q] bool
    link_index: torch.Tensor  # [link slots] row of the flattened link table, in (batch, position) order
    predict: torch.Tensor  # [b, q] bool: rows whose next token is an answer token
    targets: torch.Tensor  # [predicted] the answer tokens, in (batch, position) order


def pass_batch(examples: Sequence[Example], context: Context, max_chunks: int, dtype: torch.dtype) -> PassBatch:
    """Right-padded pass inputs; the mask is KVLink's picture (`link_mask`) over context slots + pass tokens."""
    device = context.positions.device
    rows = []
    for e in examples:
        seg = e.segments
        links = seg.link_positions()
        pos = torch.tensor(links + list(range(seg.context_len, seg.total_len + len(e.answer))), dtype=torch.long)
        ids = torch.tensor([LINK_PLACEHOLDER] * len(links) + seg.question + e.answer, dtype=torch.long)
        rows.append((pos, ids, len(links)))
    width = max(r[0].numel() for r in rows)
    b = len(examples)
    positions = torch.zeros(b, width, dtype=torch.long)
    input_ids = torch.zeros(b, width, dtype=torch.long)
    is_link = torch.zeros(b, width, dtype=torch.bool)
    predict = torch.zeros(b, width, dtype=torch.bool)
    masks, link_index, targets = [], [], []
    for r, (e, (pos, ids, n_links)) in enumerate(zip(examples, rows)):
        n = pos.numel()
        pad_pos = torch.arange(1, width - n + 1) + (int(pos[-1]) if n else 0)  # after every real token: never seen
        positions[r] = torch.cat([pos, pad_pos])
        input_ids[r, :n] = ids
        is_link[r, :n_links] = True
        if n_links:
            link_index.append(link_row_index(len(e.segments.chunks), e.segments.links, max_chunks))
        q0 = n_links + len(e.segments.question)  # first answer row
        predict[r, q0 - 1 : q0 - 1 + len(e.answer)] = True
        targets.append(torch.tensor(e.answer, dtype=torch.long))
        key_pos = torch.cat([context.positions[r].cpu(), positions[r]])
        masks.append(link_picture(e.segments, positions[r], key_pos))
    mask = additive(torch.stack(masks)[:, None], dtype)
    return PassBatch(
        input_ids.to(device),
        positions.to(device),
        mask.to(device),
        is_link.to(device),
        (torch.cat(link_index) if link_index else torch.zeros(0, dtype=torch.long)).to(device),
        predict.to(device),
        torch.cat(targets).to(device),
    )


def batch_logits(model: Any, context: Context, batch: PassBatch, links: torch.Tensor) -> torch.Tensor:
    """Logits [predicted, vocab] of the pass at the rows that predict answer tokens, in (batch,
    position) order; `links` is the [max_chunks, K, hidden] link table whose rows are the link slots' inputs."""
    from kvrag.cache import cache_from_kv

    embeds = model.get_input_embeddings()(batch.input_ids)
    if batch.link_index.numel():
        flat = links.reshape(-1, links.shape[-1])[batch.link_index].to(embeds.dtype)
        embeds = embeds.masked_scatter(batch.is_link[..., None], flat)
    cache = cache_from_kv(list(zip(context.keys, context.values)))
    out = model(
        inputs_embeds=embeds,
        position_ids=batch.positions,
        attention_mask=batch.mask.to(embeds.dtype),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=batch.predict,
    )
    return out.logits.reshape(-1, out.logits.shape[-1])


def batch_loss(model: Any, context: Context, batch: PassBatch, links: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens."""
    return torch.nn.functional.cross_entropy(batch_logits(model, context, batch, links).float(), batch.targets)


def example_loss(model: Any, examples: Sequence[Example], links: torch.Tensor, max_chunks: int, rag: Any = None, rotary: Any = None) -> torch.Tensor:
    """The loss of a micro-batch: context from the engine (`rag`, mode links) or encoded here (`rotary`), then the pass."""
    if rag is not None:
        with torch.no_grad():
            context = load_context(rag, examples)
    else:
        context = encode_context(model, rotary, examples)
    dtype = next(model.parameters()).dtype
    return batch_loss(model, context, pass_batch(examples, context, max_chunks, dtype), links)


# -- model and trainables -----------------------------------------------------------------------
def prepare_model(model: Any, cfg: TrainConfig) -> tuple[Any, list[tuple[str, torch.nn.Parameter]]]:
    """The model to train (peft-wrapped for lora) and its trainable weights (besides the links)."""
    model.requires_grad_(False)
    if cfg.mode == "lora":
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("mode 'lora' needs peft: pip install 'kvrag[train]' (or pip install peft)") from exc
        targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        model = get_peft_model(model, config)
    elif cfg.mode == "full":
        model.requires_grad_(True)
    model.train(False)  # no dropout: a step is a deterministic function of the weights and the batch
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lora_factors(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LoRA A/B of a peft model under the base model's module names, and their configuration."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    cfg: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in getattr(module, "lora_A", {}):
            base = name.removeprefix("base_model.model.")
            out[f"{base}.A"] = module.lora_A["default"].weight.detach().float().cpu().clone()
            out[f"{base}.B"] = module.lora_B["default"].weight.detach().float().cpu().clone()
            cfg = {"r": int(module.r["default"]), "alpha": float(module.lora_alpha["default"]), "scaling": float(module.scaling["default"])}
    return out, cfg


def export_adapter(model: Any, links: torch.Tensor, cfg: TrainConfig, header: dict[str, Any]) -> LinkAdapter:
    """The adapter artifact of the current weights."""
    lora: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    meta = dict(header)
    if cfg.mode == "lora":
        lora, lcfg = lora_factors(model)
        meta["lora"] = {**lcfg, "targets": cfg.lora_targets.split(",")}
    elif cfg.mode == "full":
        weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return LinkAdapter(embeds=links.detach().float().cpu().clone(), mode=cfg.mode, lora=lora, weights=weights, meta=meta)


# -- optimisation -------------------------------------------------------------------------------
def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio` of the peak."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_tensors(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """AdamW's state as named tensors (safetensors-friendly: tensors and JSON only)."""
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        st = opt.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            out[f"{i}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    return out


def restore_optimizer(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    for i, p in enumerate(params):
        st = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if st:
            opt.state[p] = {k: (v.to(p.device) if k != "step" else v) for k, v in st.items()}


# -- the run ------------------------------------------------------------------------------------
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


def plot_losses(losses: Sequence[float], path: Path, title: str = "") -> Path | None:
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
    ax.set_ylabel("answer cross-entropy")
    ax.set_title(title or "KVLink training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def train(cfg: TrainConfig, lm: LoadedModel | None = None, rows: list[dict] | None = None, provenance: list[dict] | None = None) -> TrainResult:
    """Run (or resume) a training; `lm`/`rows` let tests pass a model and data directly."""
    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if rows is None:
        if not cfg.data:
            raise ValueError("no training data: pass --data PATH (e.g. ../shared/data/nq10_dev.jsonl --rows 0:1200)")
        rows, provenance = load_rows(cfg.data, cfg.rows, cfg.allow_eval_rows)
    if not rows:
        raise ValueError("the training data selection is empty")
    if lm is None:
        from kvrag.model import load_model

        lm = load_model(cfg.model, device=cfg.device, dtype=cfg.dtype)
        model = lm.model
    else:  # never modify the caller's model
        model = lm.model if cfg.mode == "links" else copy.deepcopy(lm.model)
    layout = PromptLayout(lm.tokenizer, **({"system_prompt": cfg.system_prompt} if cfg.system_prompt else {}))
    header = adapter_header(lm, cfg.link_tokens, cfg.mode, layout.identity, data=provenance or [{"source": "in-memory rows", "count": len(rows)}])
    device = lm.device

    links = torch.nn.Parameter(default_link_embeds(model, cfg.link_tokens, cfg.max_chunks).to(device))
    model, named = prepare_model(model, cfg)
    groups = [{"params": [links], "lr": cfg.link_lr, "weight_decay": 0.0, "base_lr": cfg.link_lr}]
    if named:
        groups.append({"params": [p for _, p in named], "lr": cfg.lr, "weight_decay": cfg.weight_decay, "base_lr": cfg.lr})
    params = [links] + [p for _, p in named]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-8)

    step, losses, elapsed_before = 0, [], 0.0
    state_path = out / "checkpoint" / "state.json"
    if cfg.resume and state_path.exists():
        state = json.loads(state_path.read_text())
        if state.get("key") != json.loads(json.dumps(cfg.resume_key())):
            raise ValueError(f"{out}/checkpoint was written by a run with other settings: {state.get('key')}")
        saved = load_file(str(out / "checkpoint" / "trainable.safetensors"))
        with torch.no_grad():
            links.copy_(saved["links"].to(device))
            for n, p in named:
                p.copy_(saved[f"param.{n}"].to(p.device, p.dtype))
        restore_optimizer(opt, params, load_file(str(out / "checkpoint" / "optimizer.safetensors")))
        step, losses, elapsed_before = int(state["step"]), list(state["losses"]), float(state.get("elapsed_s", 0.0))
        log.info("resuming %s at step %d", out, step)

    total = total_steps(len(rows), cfg)
    rag, rotary = None, None
    if cfg.mode == "links":  # frozen model: chunk KV from the engine's store, computed once per passage
        from kvrag.engine import KVRag

        rag = KVRag(lm, store=cfg.store, layout=layout, check=False, link_adapter=None)
    else:
        from kvrag.rope import Rotary

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
        }
        save_checkpoint(out, state, trainables, optimizer_tensors(opt, params))
        plot_losses(losses, out / "loss.png")

    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=step, desc=f"train-links ({cfg.mode}, K={cfg.link_tokens})", unit="step", disable=not cfg.progress)
    feed = micro_batches(len(rows), cfg, step * cfg.grad_accum)
    stopped_early = False
    while step < total:
        if cfg.max_minutes is not None and (time.perf_counter() - t_start) / 60 >= cfg.max_minutes:
            stopped_early = True
            break
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_factor(step, total, cfg.warmup, cfg.min_lr_ratio)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(cfg.grad_accum):
            picks = next(feed)
            examples = [
                build_example(layout, rows[i], random.Random(f"{cfg.seed}:{e}:{i}"), cfg.link_tokens, cfg.max_chunks, cfg.max_tokens)
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
    header["training"] = {
        **{k: v for k, v in asdict(cfg).items() if k not in ("out", "progress", "resume", "adapter_out", "store")},
        "steps": step,
        "total_steps": total,
        "examples": len(rows),
        "final_loss": losses[-1] if losses else None,
        "first_loss": losses[0] if losses else None,
        "seconds": round(seconds, 1),
        "device": str(device),
        "torch": torch.__version__,
        "stopped_early": stopped_early,
    }
    adapter = export_adapter(model, links, cfg, header)
    path = save_adapter(cfg.adapter_out or out / "adapter.safetensors", adapter)
    plot_losses(losses, out / "loss.png")
    (out / "train_summary.json").write_text(json.dumps({"adapter": str(path), **header["training"], "losses": losses}, indent=1))
    return TrainResult(path, step, losses, adapter, seconds, stopped_early)


# -- command line -------------------------------------------------------------------------------
def add_train_links_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `train-links` to an argparse subparsers object (kvrag's CLI wires it in)."""
    p = subparsers.add_parser(
        "train-links",
        help="fine-tune KVLink link tokens (links / lora / full) and write a link adapter",
        description=__doc__.split("\n\n")[0],
    )
    d = TrainConfig(out="")
    p.add_argument("--data", action="append", default=[], metavar="PATH[@START:END]", help="JSONL rows (repeatable)")
    p.add_argument("--rows", default=d.rows, help="row range for --data without its own (default %(default)s)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, loss.png, adapter.safetensors")
    p.add_argument("--adapter-out", default=None, help="where to write the adapter (default OUT/adapter.safetensors)")
    p.add_argument("--model", default=None, help="HF id, folder or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--mode", choices=MODES, default=d.mode)
    p.add_argument("--link-tokens", type=int, default=d.link_tokens, help="K link tokens per chunk (default %(default)s)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks, help="chunk indices with their own link rows (default %(default)s)")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--lr", type=float, default=d.lr, help="LoRA / full weights (default %(default)s)")
    p.add_argument("--link-lr", type=float, default=d.link_lr, help="link embeddings (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--lora-r", type=int, default=d.lora_r)
    p.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    p.add_argument("--lora-targets", default=d.lora_targets)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--max-minutes", type=float, default=None, help="stop and save after this long")
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--allow-eval-rows", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--store", default=None, help="mode links: KV store URL for chunk KV (default disk://$KVRAG_HOME/kv)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_links)
    return p


def cmd_train_links(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        out=args.out,
        data=list(args.data),
        rows=args.rows,
        model=args.model,
        mode=args.mode,
        link_tokens=args.link_tokens,
        max_chunks=args.max_chunks,
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        link_lr=args.link_lr,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        seed=args.seed,
        save_every=args.save_every,
        max_tokens=args.max_tokens,
        max_minutes=args.max_minutes,
        device=args.device,
        dtype=args.dtype,
        grad_checkpointing=args.grad_checkpointing,
        resume=args.resume,
        allow_eval_rows=args.allow_eval_rows,
        progress=not args.no_progress,
        adapter_out=args.adapter_out,
        system_prompt=args.system_prompt,
        store=args.store,
    )
    result = train(cfg)
    first = result.losses[0] if result.losses else float("nan")
    last = result.losses[-1] if result.losses else float("nan")
    print(
        f"adapter: {result.adapter_path}  steps: {result.steps}  loss {first:.4f} -> {last:.4f}  "
        f"({result.seconds / 60:.1f} min{', stopped at --max-minutes' if result.stopped_early else ''})",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrag.train")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_links_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train-links":
        argv = ["train-links", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
