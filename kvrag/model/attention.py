"""Attention by position, in query blocks, without the whole [queries x keys] mask.

A recompute pass or a probe runs n queries at arbitrary global positions over a cache whose slots
hold arbitrary positions. The dense additive mask for that is O(n x slots): 2 GiB of bf16 for
CacheBlend's all-token probe at 32k, and a mask keeps SDPA off its fastest kernels. Here a pass is
described by positions (`PassSpec`) and attention runs in blocks of queries:

- a block attends only to the slots up to its last query's position (fewer keys for early blocks);
- a block whose every slot precedes its first query needs no mask at all (the question's block
  over a fully visible context, for instance);
- a block of consecutive positions that are also the last slots it sees is lower-right causal:
  `torch.nn.attention.bias.causal_lower_right`, which CUDA runs on its efficient kernel with no mask
  tensor (the CPU builds that block's mask);
- any other block builds a boolean mask for itself alone, at most `MASK_BUDGET` elements.

Each query row is computed independently, so blocking changes no result beyond the kernel's float
order. The kernel SDPA chose for each block (asked once per pass, at the first layer) is recorded
in `PassSpec.kernels` for the stats.

`kvrag_sdpa` is registered with transformers' attention interface. Outside a `PassSpec` (decoding,
Full Attention's plain prefill, training passes with their own 4D masks) it is transformers' SDPA
attention, unchanged. Flash-attention implementations ignore position masks, so kvrag refuses them
(`check_attention`).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from kvrag.defaults import Ape
from kvrag.errors import UnsupportedModelError
from kvrag.model.ape import allowed_from_mask, ape_attention, decode_ape

IMPL = "kvrag_sdpa"
MASK_BUDGET = 1 << 24  # elements of one block's boolean mask (16 MiB as bool; a block is at least one query row)
# the 4D mask handed to the model during a spec'd pass: transformers returns a 4D mask as-is, so it
# builds none of its own; kvrag_sdpa ignores it and attends by the spec's positions
_MARKER = torch.zeros(1, 1, 1, 1)
_ACTIVE: ContextVar["PassSpec | None"] = ContextVar("kvrag_pass_spec", default=None)
_LOG: ContextVar["dict[str, dict[str, int]] | None"] = ContextVar("kvrag_kernel_log", default=None)
_BACKENDS = {-1: "error", 0: "math", 1: "flash_attention", 2: "efficient_attention", 3: "cudnn_attention", 4: "overrideable"}
REFUSED = ("flash_attention", "paged", "flex_attention", "kernels-community")
Rule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (query positions, key positions) -> bool [q, kv]


@dataclass(frozen=True)
class Block:
    start: int
    stop: int
    keys: int  # the block attends to key slots [0, keys)
    kind: str  # "none" (no mask), "causal" (lower-right causal) or "mask"


@dataclass
class PassSpec:
    """One pass's queries and key slots by global position, and the rule between them (None: causal by position)."""

    query_pos: torch.Tensor  # [q] on the model's device
    key_pos: torch.Tensor  # [kv]
    rule: Rule | None = None
    name: str = "pass"
    budget: int = 0  # elements of one block's mask; 0: MASK_BUDGET
    blocks: list[Block] = field(default_factory=list)
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> blocks that used it (first layer)
    recorded: bool = False
    # APE (kvrag.model.ape): the pass's last `ape_rows` queries (the question) attend with `ape` over the
    # key slots `ape_context` marks (bool [kv]: the chunk tokens); None: ordinary attention for every query
    ape: Ape | None = None
    ape_rows: int = 0
    ape_context: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.budget = self.budget or MASK_BUDGET
        self.blocks = plan_blocks(self.query_pos.cpu().numpy(), self.key_pos.cpu().numpy(), self.rule is None, self.budget)

    def mask(self, block: Block) -> torch.Tensor:
        """Boolean [q, keys] mask of one block (True: may attend)."""
        qp = self.query_pos[block.start : block.stop]
        kp = self.key_pos[: block.keys]
        if self.rule is None:
            return kp[None, :] <= qp[:, None]
        return self.rule(qp, kp)


    def dense_allowed(self) -> torch.Tensor:
        """The whole pass's boolean [q, kv] rule, as the dense mask would hold it (for checks, not passes)."""
        return self.mask(Block(0, self.query_pos.numel(), self.key_pos.numel(), "mask"))


def active_spec() -> PassSpec | None:
    """The pass spec the model is attending by right now (None outside a spec'd pass)."""
    return _ACTIVE.get()


def plan_blocks(query_pos: np.ndarray, key_pos: np.ndarray, causal: bool, budget: int) -> list[Block]:
    """Split the queries into blocks and decide per block which keys it needs and whether it needs a mask.

    The structured cases need causal-by-position with sorted query and key positions; anything else
    (KVLink's picture, hidden link slots) gets a mask per block over every key.
    """
    n_q, n_kv = len(query_pos), len(key_pos)
    size = max(1, min(n_q, budget // max(1, n_kv)))
    structured = causal and bool(np.all(np.diff(query_pos) >= 0)) and bool(np.all(np.diff(key_pos) > 0))
    if not structured:
        return [Block(a, min(n_q, a + size), n_kv, "mask") for a in range(0, n_q, size)]
    # the queries that are also the last key slots (the question, a prefill) form blocks of their own,
    # each lower-right causal; the scattered ones before them are blocked separately
    m = min(n_q, n_kv)
    differ = np.nonzero(query_pos[n_q - m :] != key_pos[n_kv - m :])[0]
    tail = n_q - m + (int(differ[-1]) + 1 if len(differ) else 0)
    blocks = []
    for first, last in ((0, tail), (tail, n_q)):
        for a in range(first, last, size):
            b = min(last, a + size)
            lo = int(np.searchsorted(key_pos, query_pos[a], side="right"))  # keys every query here sees
            hi = int(np.searchsorted(key_pos, query_pos[b - 1], side="right"))  # keys some query here sees
            if lo == hi:
                kind = "none"
            elif a >= tail and hi - (b - a) + 1 == lo:
                kind = "causal"
            else:
                kind = "mask"
            blocks.append(Block(a, b, hi, kind))
    return blocks


@contextmanager
def attending_by(spec: PassSpec) -> Iterator[torch.Tensor]:
    """Run the model's passes inside by `spec`; yields the placeholder 4D mask to hand the model.
    The kernels the pass used go into the active `kernel_log`, under the spec's name."""
    token = _ACTIVE.set(spec)
    try:
        yield _MARKER
    finally:
        _ACTIVE.reset(token)
        log = _LOG.get()
        if log is not None:
            mine = log.setdefault(spec.name, {})
            for name, n in spec.kernels.items():
                mine[name] = mine.get(name, 0) + n


@contextmanager
def kernel_log() -> Iterator[dict[str, dict[str, int]]]:
    """Collect, per pass name, the SDPA kernels the passes run inside used (for `AnswerStats.attention_kernels`)."""
    log: dict[str, dict[str, int]] = {}
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


def _repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, gqa: bool) -> str:
    """The SDPA backend these inputs dispatch to (asked, not guessed: torch's own choice function)."""
    try:
        if isinstance(mask, CausalBias):  # (a Tensor subclass, so asked about first)
            if q.is_cuda:  # lower-right causal: the efficient kernel with no mask tensor when it can
                params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, gqa)
                if torch.backends.cuda.can_use_efficient_attention(params):
                    return "efficient_attention"
            mask = mask._materialize(q.device)  # what torch does with it elsewhere
        return _BACKENDS.get(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=gqa)), "unknown")
    except (AttributeError, RuntimeError, TypeError):
        return "unknown"


def _attend_blocks(spec: PassSpec, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    if key.shape[2] != spec.key_pos.numel() or query.shape[2] != spec.query_pos.numel():
        raise RuntimeError(
            f"{spec.name}: the model attends {query.shape[2]} queries over {key.shape[2]} slots, "
            f"but the pass was planned for {spec.query_pos.numel()} over {spec.key_pos.numel()}"
        )
    groups = query.shape[1] // key.shape[1]
    record, spec.recorded = not spec.recorded, True  # every layer has the same shapes: ask at the first
    outs = []
    ape_cut = query.shape[2] - spec.ape_rows if spec.ape is not None and spec.ape.active and spec.ape_rows else None
    for block in spec.blocks:
        if ape_cut is not None and block.start >= ape_cut:  # the question's rows: attended with APE below
            outs.append(query.new_zeros(*query.shape[:2], block.stop - block.start, value.shape[-1]))
            continue
        q = query[:, :, block.start : block.stop]
        k, v = key[:, :, : block.keys], value[:, :, : block.keys]
        mask: Any = None
        if block.kind == "causal":
            mask = causal_lower_right(block.stop - block.start, block.keys)
        elif block.kind == "mask":
            mask = spec.mask(block)[None, None]
        gqa = groups > 1 and mask is None
        if groups > 1 and not gqa:
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        if record:
            name = _kernel(q, k, v, mask, gqa)
            spec.kernels[name] = spec.kernels.get(name, 0) + 1
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if spec.ape is not None and spec.ape.active:
        out = _with_ape(spec, query, key, value, scaling, out)
    return out.transpose(1, 2).contiguous()


def _with_ape(spec: PassSpec, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
              out: torch.Tensor) -> torch.Tensor:
    """The pass's last `ape_rows` rows (the question), which the blocks above left empty, attended with APE
    over the context slots; a few dozen rows, so one [rows, keys] score matrix a layer."""
    n = spec.ape_rows
    if n == 0 or spec.ape_context is None:
        return out
    q = query[:, :, -n:]
    qp, kp = spec.query_pos[-n:], spec.key_pos
    allowed = (kp[None, :] <= qp[:, None]) if spec.rule is None else spec.rule(qp, kp)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rows = ape_attention(q, key, value, allowed[None, None], spec.ape_context[None, None, None, :], spec.ape, scale)
    return torch.cat([out[:, :, :-n], rows.to(out.dtype)], dim=2) if n < out.shape[2] else rows.to(out.dtype)


def kvrag_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any):
    """transformers' attention interface: by position inside a `PassSpec`, stock SDPA outside one."""
    spec = _ACTIVE.get()
    if spec is None:
        dape = decode_ape()
        if dape is not None:  # a decode step with APE over the chunk slots (kvrag.model.ape)
            n_q, n_kv = query.shape[2], key.shape[2]
            allowed = allowed_from_mask(attention_mask, n_q, n_kv, query.device)
            scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
            out = ape_attention(query, key, value, allowed, dape.context(n_kv, query.device), dape.ape, scale)
            return out.to(query.dtype).transpose(1, 2).contiguous(), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return _attend_blocks(spec, module, query, key, value, kwargs.get("scaling")), None


def register() -> None:
    """Make `kvrag_sdpa` a transformers attention implementation (its masks: SDPA's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL, kvrag_sdpa)
    AttentionMaskInterface.register(IMPL, sdpa_mask)


def check_attention(model: Any) -> None:
    """Refuse attention kernels that would ignore kvrag's position masks; move SDPA to `kvrag_sdpa`.

    eager and SDPA honour an additive mask; flash-attention (2/3, paged, hub kernels) and flex
    attention take no arbitrary mask, so a stitched pass would silently attend to the wrong keys.
    """
    impl = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    if any(r in impl for r in REFUSED):
        raise UnsupportedModelError(
            f"the model was loaded with attn_implementation={impl!r}, which ignores the position masks kvrag's "
            "recompute pass needs (it would attend to the wrong keys): load it with attn_implementation='sdpa' "
            "(or 'eager')"
        )
    if impl == "sdpa":
        register()
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(IMPL)
        else:
            model.config._attn_implementation = IMPL


def uses_spec(model: Any) -> bool:
    """Whether this model's attention understands a `PassSpec` (else passes hand it a dense mask)."""
    return getattr(model.config, "_attn_implementation", None) == IMPL
