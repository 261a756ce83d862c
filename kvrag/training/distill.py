"""Objective `distill`: the trained model learns to read reused KV as the base model reads the whole prompt.

The teacher is the base model (LoRA switched off; in mode `full` a frozen copy of the base
weights) with Full Attention over the ordinary prompt, `[system prefix | chunk 1 | ... | chunk N |
question]` with no link slots and causal attention: the token ids `method="full"` reads at
inference for the same chunks and question (`teacher_segments`: the example's own segments with
the link slots taken out). It continues greedily for `teacher_tokens` tokens (stopping at the end
of a turn), and its next-token log-probs at every position of that continuation are the targets
(`TeacherTargets`; with `teacher_topk` only the top k of them and the rest's total mass).

The student is the model being trained, reading the chunk-independent KV exactly as the gold
objective does (link tokens, KVLink's picture, chunks encoded separately after the prefix and
re-rotated), teacher-forced over the teacher's continuation. The loss is the mean over
continuation positions of KL(teacher || student) (temperature 1), plus `ce_weight` times the
cross-entropy of the teacher's tokens. Gold answers are never read.

Targets depend only on the base model and the example: they are computed once per example when
first needed (kept in memory for a while, and with `teacher_cache` in OUT/teacher/ as safetensors
keyed by a hash of the prompt ids, so a resumed run reads them back instead of generating again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import load_file, save_file

from kvrag.model.cache import cache_arg, empty_cache
from kvrag.kv.layout import PromptLayout, Segments
from kvrag.training.config import TrainConfig
from kvrag.training.data import Example, build_distill_example, example_kind
from kvrag.training.passes import base_weights, batch_context, batch_logits, pass_batch  # noqa: F401 (base_weights: re-exported)

MEMORY_ENTRIES = 64  # teacher targets kept in memory (full-vocabulary targets are ~6 MB each on a 49k vocabulary)


# -- examples ---------------------------------------------------------------------------------------
def distill_example(layout: PromptLayout, row: dict, cfg: TrainConfig, epoch: int, row_index: int) -> Example:
    """The distill example of row `row_index` in `epoch`: its kind and layout are a pure function of
    (seed, epoch, row), as the gold objective's examples are; its answer is filled in by the teacher."""
    kind = example_kind(cfg.seed, epoch, row_index, cfg.continue_share, row, cfg.turn_share)
    rng = random.Random(f"{cfg.seed}:{epoch}:{row_index}")
    return build_distill_example(
        layout, row, rng, kind, cfg.links, cfg.max_chunks, cfg.max_tokens, cfg.teacher_tokens, cfg.min_chunks,
    )


def teacher_segments(example: Example) -> Segments:
    """The example's prompt as Full Attention reads it: the same prefix, chunks and question, no link slots."""
    seg = example.segments
    return Segments(list(seg.prefix), [list(c) for c in seg.chunks], list(seg.question))


def teacher_prompt_ids(example: Example) -> list[int]:
    return teacher_segments(example).all_ids()


# -- the teacher ----------------------------------------------------------------------------------
@dataclass
class TeacherTargets:
    """The teacher's greedy continuation and its next-token log-probs at each position of it."""

    tokens: list[int]  # [T] the continuation (its last token may be the end of turn)
    logp: torch.Tensor  # [T, vocab] float32, or with top-k [T, k + 1]: the k kept log-probs, then the rest's log-mass
    index: torch.Tensor | None = None  # [T, k] vocabulary ids of the kept log-probs (top-k); None: the full vocabulary

    def tensors(self) -> dict[str, torch.Tensor]:
        """As kept on disk: the top-k ids as int32 (half int64's bytes: an epoch's top-k targets then
        fit the few MB a lent machine's call carries back), read back as int64."""
        out = {"tokens": torch.tensor(self.tokens, dtype=torch.long), "logp": self.logp.contiguous()}
        if self.index is not None:
            out["index"] = self.index.to(torch.int32).contiguous()
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> "TeacherTargets":
        index = t.get("index")
        return cls([int(x) for x in t["tokens"].tolist()], t["logp"], None if index is None else index.long())


def compress(logp: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logp` [T, V] as its top-k log-probs plus one column for the log of the remaining mass
    ([T, k + 1], and the ids [T, k]); topk 0 (or >= V) keeps it whole."""
    if topk <= 0 or topk >= logp.shape[-1]:
        return logp, None
    values, index = logp.topk(topk, dim=-1)
    rest = logp.scatter(-1, index, float("-inf")).logsumexp(-1, keepdim=True)
    return torch.cat([values, rest], dim=-1), index


@torch.no_grad()
def generate_targets(model: Any, ids: Sequence[int], n_tokens: int, eos: Iterable[int], topk: int = 0) -> TeacherTargets:
    """Full Attention over `ids` (the model's own causal attention), then `n_tokens` greedy tokens
    (fewer when an end-of-turn token comes), with the log-probs each position predicted them from."""
    device = next(model.parameters()).device
    stop = set(int(e) for e in eos)
    cache = empty_cache()
    n = len(ids)
    out = model(
        input_ids=torch.tensor([list(ids)], device=device), position_ids=torch.arange(n, device=device)[None],
        **cache_arg(model, cache), use_cache=True, logits_to_keep=1,
    )
    tokens, rows = [], []
    for t in range(n_tokens):
        logits = out.logits[0, -1].float()
        rows.append(torch.log_softmax(logits, dim=-1).cpu())
        token = int(logits.argmax())
        tokens.append(token)
        if token in stop or t == n_tokens - 1:
            break
        out = model(
            input_ids=torch.tensor([[token]], device=device), position_ids=torch.tensor([[n + t]], device=device),
            **cache_arg(model, cache), use_cache=True, logits_to_keep=1,
        )
    return _targets(tokens, rows, topk)


def _targets(tokens: list[int], rows: list[torch.Tensor], topk: int) -> TeacherTargets:
    """A continuation and its per-position log-probs [vocab] as targets (top-k compressed if asked)."""
    logp, index = compress(torch.stack(rows), topk)
    return TeacherTargets(tokens, logp.contiguous(), None if index is None else index.contiguous())


@torch.no_grad()
def generate_targets_many(model: Any, prompts: Sequence[Sequence[int]], n_tokens: int, eos: Iterable[int],
                          topk: int = 0, batched: bool | None = None) -> list[TeacherTargets]:
    """`generate_targets` for several prompts, by default at once on CUDA: left-padded, one forward per
    token for all of them. Why: stepping one example at a time, the teacher's 32 greedy forwards per
    example left a lent GPU mostly idle (~1 s an example on an H200). On the CPU (compute-bound) the
    padding would only add work (8 nq10 prompts: 16.7 s together against 11.2 s one by one), so there
    they go one by one unless `batched`. Each prompt's targets are its own up to float rounding
    (padding is masked; the matrix products run over the batch)."""
    device = next(model.parameters()).device
    if len(prompts) == 1 or not (device.type == "cuda" if batched is None else batched):
        return [generate_targets(model, p, n_tokens, eos, topk) for p in prompts]
    stop = set(int(e) for e in eos)
    width, count = max(len(p) for p in prompts), len(prompts)
    ids = torch.zeros(count, width, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[b, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    cache = empty_cache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    tokens: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    live = [True] * count
    for t in range(n_tokens):
        logits = out.logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1).cpu()
        picks = [int(x) for x in logits.argmax(-1).tolist()]
        for b in range(count):
            if live[b]:
                rows[b].append(logp[b])
                tokens[b].append(picks[b])
                live[b] = picks[b] not in stop
        if t == n_tokens - 1 or not any(live):
            break
        mask = torch.cat([mask, mask.new_ones(count, 1)], dim=1)  # a finished prompt's later tokens are never read
        out = model(input_ids=torch.tensor(picks, device=device)[:, None], attention_mask=mask, position_ids=(lengths + t)[:, None],
                    **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    return [_targets(tokens[b], rows[b], topk) for b in range(count)]


class Teacher:
    """Teacher targets per example, computed once when first needed (in memory, optionally on disk)."""

    def __init__(
        self, model: Any, eos: Iterable[int], n_tokens: int, topk: int = 0, identity: str = "", cache_dir: str | Path | None = None,
    ) -> None:
        self.model = model  # the base weights inside (`base_weights`)
        self.eos = sorted(int(e) for e in eos)
        self.n_tokens = int(n_tokens)
        self.topk = int(topk)
        self.identity = identity  # the base model's fingerprint: part of every key
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.memory: OrderedDict[str, TeacherTargets] = OrderedDict()
        self.generated = 0  # targets computed here (not read back from memory or disk)

    def key(self, ids: Sequence[int]) -> str:
        h = hashlib.sha256(json.dumps([self.identity, self.n_tokens, self.topk, self.eos]).encode())
        h.update(torch.tensor(list(ids), dtype=torch.long).numpy().tobytes())
        return h.hexdigest()[:40]

    def targets(self, example: Example) -> TeacherTargets:
        return self.targets_many([example])[0]

    def targets_many(self, examples: Sequence[Example]) -> list[TeacherTargets]:
        """Each example's targets: from memory, from OUT/teacher, or generated, the missing ones together."""
        keyed = [(self.key(ids), ids) for ids in map(teacher_prompt_ids, examples)]
        found: dict[str, TeacherTargets] = {}
        missing: dict[str, list[int]] = {}
        for key, ids in keyed:
            hit = self.memory.get(key)
            path = self._path(key)
            if hit is not None:
                found[key] = hit
            elif path is not None and path.is_file():
                found[key] = TeacherTargets.from_tensors(load_file(str(path)))
            else:
                missing[key] = ids
        found.update(self._generate(missing))
        for key, target in found.items():
            self.memory[key] = target
            self.memory.move_to_end(key)
        while len(self.memory) > max(MEMORY_ENTRIES, len(found)):  # a whole step's targets stay until its micro-batches ask
            self.memory.popitem(last=False)
        return [found[key] for key, _ in keyed]

    def ensure(self, examples: Sequence[Example]) -> int:
        """Generate and keep on disk the targets of those examples OUT/teacher lacks (none is read
        back: a teacher-only pass over a schedule spends its time on the missing ones alone); returns
        how many were generated."""
        if self.cache_dir is None:
            raise ValueError("Teacher.ensure keeps targets on disk: give the teacher a cache_dir")
        missing: dict[str, list[int]] = {}
        for ids in map(teacher_prompt_ids, examples):
            key = self.key(ids)
            path = self._path(key)
            if path is not None and not path.is_file():
                missing[key] = ids
        return len(self._generate(missing))

    def _generate(self, missing: dict[str, list[int]]) -> dict[str, TeacherTargets]:
        """The targets of `missing` (key -> prompt ids), generated together and written to OUT/teacher."""
        if not missing:
            return {}
        with base_weights(self.model) as base:
            made = generate_targets_many(base, list(missing.values()), self.n_tokens, self.eos, self.topk)
        self.generated += len(made)
        out = dict(zip(missing, made))
        for key, target in out.items():
            path = self._path(key)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                save_file(target.tensors(), str(tmp))
                tmp.replace(path)  # atomic: a piece cut off mid-write leaves no half file behind
        return out

    def _path(self, key: str) -> Path | None:
        """Where OUT/teacher keeps these targets (None: kept in memory only)."""
        return self.cache_dir / f"{key}.safetensors" if self.cache_dir is not None else None

    def attach(self, examples: Sequence[Example]) -> tuple[list[Example], list[TeacherTargets]]:
        """The examples with the teacher's continuation as their answers, and the targets."""
        targets = self.targets_many(examples)
        return [dataclasses.replace(e, answer=list(t.tokens)) for e, t in zip(examples, targets)], targets


# -- the loss ---------------------------------------------------------------------------------------
def _kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row over the last dimension; a bucket where p has no mass adds nothing."""
    p = p_logp.exp()
    return torch.where(p > 0, p * (p_logp - q_logp), torch.zeros_like(p)).sum(-1)


def kl_to_teacher(logits: torch.Tensor, targets: Sequence[TeacherTargets]) -> torch.Tensor:
    """KL(teacher || student) at each predicted position [N] (positions in (batch, position) order,
    as `batch_logits` returns them). Top-k targets compare the k kept tokens and the rest's mass."""
    student = torch.log_softmax(logits.float(), dim=-1)
    teacher = torch.cat([t.logp for t in targets]).to(student.device)
    if targets[0].index is None:
        return _kl(teacher, student)
    index = torch.cat([t.index for t in targets]).to(student.device)
    kept = student.gather(-1, index)
    rest = student.scatter(-1, index, float("-inf")).logsumexp(-1, keepdim=True)
    return _kl(teacher, torch.cat([kept, rest], dim=-1))


def distill_loss(
    model: Any, teacher: Teacher, examples: Sequence[Example], links: torch.Tensor, max_chunks: int, rag: Any = None,
    rotary: Any = None, ce_weight: float = 0.0,
) -> torch.Tensor:
    """The distill loss of a micro-batch: the teacher's targets (computed or cached), then the
    student's pass over the reused context, teacher-forced over the teacher's tokens; the mean KL
    over every continuation position of the batch (+ ce_weight x their cross-entropy)."""
    examples, targets = teacher.attach(examples)
    context = batch_context(model, examples, rag, rotary)
    dtype = next(model.parameters()).dtype
    batch = pass_batch(examples, context, max_chunks, dtype)
    logits = batch_logits(model, context, batch, links)
    loss = kl_to_teacher(logits, targets).mean()
    if ce_weight:
        loss = loss + ce_weight * torch.nn.functional.cross_entropy(logits.float(), batch.targets)
    return loss
