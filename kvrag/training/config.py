"""The training run's settings (`TrainConfig`) and what must match for `--resume`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvrag.defaults import DEFAULT_MAX_CHUNKS, LINK_MODES as MODES, WEIGHTS_KEPT_MODES, link_scope
from kvrag.kv.layout import Links

DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj"
from kvrag.defaults import OBJECTIVES  # noqa: E402,F401
# What only objective distill reads: in the resume key only then, so gold runs resume unchanged.
DISTILL_KEYS = ("objective", "teacher_tokens", "teacher_topk", "ce_weight", "continue_share")


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
    min_chunks: int | None = None  # each example keeps a random min..max passages (gold kept); None: up to max_chunks
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
    max_minutes: float | None = None  # stop (and save) after this long: one piece of a run trained in pieces
    stop_at: int | None = None  # stop (and save) once the run reaches this optimizer step; the schedule keeps its length
    fit_schedule: bool = False  # with max_minutes: once a few steps are timed, end the cosine schedule inside the budget
    device: str = "auto"
    dtype: str = "auto"
    grad_checkpointing: bool = False
    resume: bool = False
    allow_eval_rows: bool = False
    progress: bool = True
    adapter_out: str | None = None  # default OUT/adapter.safetensors
    store: str | None = None  # mode links: the KV store chunk KV is read from / kept in (default: kvrag's own)
    system_prompt: str | None = None
    # "gold": cross-entropy of the rows' gold answers; "distill": imitate the base model with Full
    # Attention (LoRA off, no link slots), KL(teacher || student) over its greedy continuation
    objective: str = "gold"
    teacher_tokens: int = 32  # distill: the teacher's greedy continuation (stops early at end of turn)
    teacher_topk: int = 0  # distill: keep the teacher's top-k log-probs (+ the rest's mass); 0: the full vocabulary
    ce_weight: float = 0.0  # distill: + this times the cross-entropy of the teacher's tokens
    continue_share: float = 0.5  # distill: share of examples that continue a row's text instead of answering its question
    turn_share: float = 0.0  # distill: share of examples that are two-turn conversations over the row's passages
    teacher_cache: bool = False  # distill: also keep teacher targets in OUT/teacher/ (safetensors; ~6 MB an example at full vocabulary)
    teacher_only: bool = False  # distill: only compute the schedule's teacher targets into OUT/teacher (implies teacher_cache)
    teacher_batch: int = 32  # distill, teacher_only: prompts per batched teacher generation

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.link_tokens < 0 or self.max_chunks < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("link_tokens >= 0, max_chunks >= 1, batch_size >= 1 and grad_accum >= 1 are required")
        if self.min_chunks is not None and not 1 <= self.min_chunks <= self.max_chunks:
            raise ValueError(f"min_chunks must be from 1 to max_chunks ({self.max_chunks}), got {self.min_chunks}")
        if self.mode in WEIGHTS_KEPT_MODES and self.link_tokens == 0:
            raise ValueError(f"mode {self.mode!r} with 0 link tokens has nothing to train")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.teacher_tokens < 1 or self.teacher_topk < 0 or self.ce_weight < 0 or not 0 <= self.continue_share <= 1:
            raise ValueError("teacher_tokens >= 1, teacher_topk >= 0, ce_weight >= 0 and 0 <= continue_share <= 1 are required")
        if not 0 <= self.turn_share <= 1 - self.continue_share:
            raise ValueError(f"turn_share must be from 0 to 1 - continue_share ({1 - self.continue_share:g}), got {self.turn_share}")
        if (self.stop_at is not None and self.stop_at < 0) or self.teacher_batch < 1:
            raise ValueError("stop_at >= 0 and teacher_batch >= 1 are required")
        if self.teacher_only:
            if self.objective != "distill":
                raise ValueError("teacher_only needs objective 'distill' (only it has a teacher)")
            self.teacher_cache = True  # the targets' only destination

    @property
    def links(self) -> Links:
        """The link slots the mode's examples are laid out with: `link_tokens` per chunk, scoped as the mode is."""
        return Links(self.link_tokens, link_scope(self.mode))

    def resume_key(self) -> dict[str, Any]:
        """What must not change between a run and its resumption."""
        keys = ("data", "rows", "model", "mode", "link_tokens", "max_chunks", "batch_size", "grad_accum", "seed", "max_tokens",
                "lora_r", "lora_alpha", "lora_targets", "system_prompt")
        key = {k: getattr(self, k) for k in keys}
        if self.min_chunks is not None:  # only when set: runs from before the option resume unchanged
            key["min_chunks"] = self.min_chunks
        if self.objective != "gold":  # likewise: gold runs resume as they always did
            key.update({k: getattr(self, k) for k in DISTILL_KEYS})
            if self.turn_share:  # only when set: distill runs from before the option resume unchanged
                key["turn_share"] = self.turn_share
        return key

