"""One decode step through the model's own modules, without the transformers forward around them.

Why: a decode step of a small model on the CPU is bound by per-call overhead, not by reading the
weights (issue #39: 17 tok/s against a ~63 tok/s weights-read bound for the bundled model). The stock
forward spends much of a step on what a fixed-shape step does not need: building the mask, the cache
object's bookkeeping, output dataclasses, keyword plumbing through every layer. This step calls the
same submodules in the same order as the decoder layers' own forwards (norms, projections, RoPE, the
configured attention function, MLP), so its multi-row steps (`many`, drafts on the CPU) are
bit-identical to the stock forward; the fixed-shape steps (`rows`, over a slot pool: the one CUDA
graphs capture, one per batch bucket; `__call__`, one sequence over its own buffer) attend with
kvrag.decode.attend instead (grouped heads, no K/V repeated per head, keys split on a GPU), equal to
the stock forward up to float rounding (tests/test_lean_decode.py checks every supported
architecture). It is a plain function of tensors.

`__call__`: tokens and positions are [B, 1], the KV buffers [B, kv_heads, capacity, head_dim], `slot`
[B] (where each sequence writes this step) and the mask [B, 1, 1, capacity] (each sequence sees its
own written slots). B = 1 is the single-stream decode of a sequence outside the pool.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Callable, Sequence

import torch

from kvrag.decode.attend import attend_rows
from kvrag.defaults import Ape
from kvrag.decode.int8 import Int8Layer, Int8Weights, check_decode_weights, int8_available

log = logging.getLogger(__name__)
KV = tuple[torch.Tensor, torch.Tensor]

# decoder layers whose forward is exactly: norm, attention (q/k/v projections, optional q/k norms
# on the heads, RoPE, cache write, attention function, o_proj), residual, norm, MLP, residual
SUPPORTED = frozenset({"llama", "mistral", "qwen2", "qwen3"})
ATTENTION = frozenset({"sdpa", "eager", "kvrag_sdpa"})  # kvrag_sdpa: stock SDPA outside a stitched pass


def lean_supported(model: Any) -> bool:
    """Whether `model` is one whose decoder layers this step reproduces exactly."""
    cfg = getattr(model, "config", None)
    return (
        getattr(cfg, "model_type", None) in SUPPORTED
        and getattr(cfg, "_attn_implementation", None) in ATTENTION
        and hasattr(getattr(model, "model", None), "layers")
        and hasattr(model, "lm_head")
    )


class LeanStep:
    """`step(tokens, positions, buffers, slot, mask) -> logits [B, vocab]` for a supported model."""

    def __init__(self, model: Any, int8: Int8Weights | None = None) -> None:
        """`int8`: read these int8 linears instead of the model's own (kvrag.decode.int8, opt-in)."""
        if not lean_supported(model):
            raise ValueError(f"no lean decode step for {getattr(model.config, 'model_type', type(model).__name__)}")
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers[: model.config.num_hidden_layers])
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.int8 = int8
        self.weights = "int8" if int8 is not None else "model"
        module = sys.modules[type(self.layers[0].self_attn).__module__]
        self.apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = module.apply_rotary_pos_emb
        impl = model.config._attn_implementation
        self.attend: Callable[..., tuple[torch.Tensor, Any]] = ALL_ATTENTION_FUNCTIONS.get_interface(
            impl, module.eager_attention_forward)  # as the attention module's forward chooses it
        if impl == "kvrag_sdpa":  # which is stock SDPA outside a stitched pass (decoding is never inside one)
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            self.attend = sdpa_attention_forward

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, buffers: Sequence[KV], slot: torch.Tensor,
                 mask: torch.Tensor, ape: "tuple[torch.Tensor, Ape] | None" = None) -> torch.Tensor:
        """Every sequence writes its `slot` of the shared buffers and attends over them through `mask`;
        `ape`: (bool [1, 1, 1, slots] marking the chunk slots, the Ape), one sequence only (kvrag.model.ape)."""
        if ape is not None and tokens.shape[0] != 1:
            raise ValueError("APE decodes one sequence a step")

        def attend(i: int, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kbuf, vbuf = buffers[i]
            _write(kbuf, k, slot)
            _write(vbuf, v, slot)
            if q.shape[0] == 1:  # the static (CUDA-graph) step: one sequence over its whole buffer
                return attend_rows(q, kbuf, vbuf, mask, attn.scaling, ape=ape)
            return self.attend(attn, q, kbuf, vbuf, mask, dropout=0.0, scaling=attn.scaling)[0]

        return self._forward(tokens, positions, attend)

    @torch.no_grad()
    def many(self, tokens: torch.Tensor, positions: torch.Tensor, seqs: Sequence[tuple[Sequence[KV], int]],
             rows: Sequence[int] | None = None) -> torch.Tensor:
        """One step for several sequences that each keep their own buffers: `seqs[b]` is (its per-layer
        [1, kv_heads, capacity, d] buffers, its first slot) and `rows[b]` how many consecutive rows of
        `tokens`/`positions` ([R, 1]) are its (None: one each; more: a token and the drafts after it,
        kvrag.decode.draft). Projections and MLP run on all rows at once (the weights are read once
        for the batch); a sequence's rows write the slots from its first on, and each attends over the
        sequence's own slots up to its own, unmasked where a sequence has one row, exactly as it would
        alone. Logits [R, vocab]."""
        counts = list(rows) if rows is not None else [1] * len(seqs)

        def attend(i: int, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs, r = [], 0
            for (buffers, slot), n in zip(seqs, counts):
                kbuf, vbuf = buffers[i]
                kbuf[:, :, slot : slot + n].copy_(k[r : r + n].transpose(0, 2))
                vbuf[:, :, slot : slot + n].copy_(v[r : r + n].transpose(0, 2))
                if n == 1:
                    outs.append(self.attend(attn, q[r : r + 1], kbuf[:, :, : slot + 1], vbuf[:, :, : slot + 1], None,
                                            dropout=0.0, scaling=attn.scaling)[0])
                else:
                    outs.append(_attend_rows(q[r : r + n], kbuf[:, :, : slot + n], vbuf[:, :, : slot + n], attn.scaling))
                r += n
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

        return self._forward(tokens, positions, attend)

    @torch.no_grad()
    def rows(self, tokens: torch.Tensor, positions: torch.Tensor, buffers: Sequence[KV], write: torch.Tensor,
             slots: torch.Tensor, splits: int = 1) -> torch.Tensor:
        """The fixed-shape step over a slot pool (kvrag.decode.pool), the region a CUDA graph captures:
        row b feeds tokens[b] ([B, 1]) at positions[b], writes its K/V at slot write[b] of row b of
        every layer's buffers ([>= B, kv_heads, capacity, d]) and attends over its own slots up to
        write[b] among the first len(slots) (`slots` = 0..span-1). One bias for every layer hides the
        rest; `splits`: blocks of keys for the product with V (kvrag.decode.attend). No host sync and no
        shape that depends on a value: every step of the same (B, span) is the same kernels. Logits [B, vocab]."""
        B, span = tokens.shape[0], slots.shape[0]
        dtype = buffers[0][0].dtype
        hidden = slots[None, :] > write[:, None]  # [B, span]: after the row's own slot
        bias = torch.zeros((B, 1, 1, span), dtype=dtype, device=tokens.device).masked_fill_(
            hidden[:, None, None, :], torch.finfo(dtype).min)
        # each row's new K/V into its own slot by index (index_put_: no host sync, captured as gpt-fast's cache
        # writes are); scatter_ did the same, but on the CPU into a bfloat16 buffer it copied the whole buffer
        # (22 ms a call for 8 rows of 8k slots, two thirds of the step)
        rows_at = torch.arange(B, device=tokens.device)

        def attend(i: int, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kbuf, vbuf = buffers[i][0][:B], buffers[i][1][:B]
            kbuf[rows_at, :, write] = k[:, :, 0].to(dtype)
            vbuf[rows_at, :, write] = v[:, :, 0].to(dtype)
            return attend_rows(q, kbuf[:, :, :span], vbuf[:, :, :span], bias, attn.scaling, splits)

        return self._forward(tokens, positions, attend)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The decoder layers as their own forwards run them; `attend(layer index, attn, q, k, v)` writes
        the new K/V where the caller keeps them and returns the attention output [B, 1, heads, d]."""
        hidden = self.embed(tokens)
        cos, sin = self.rotary(hidden, position_ids=positions)
        q8 = self.int8.layers if self.int8 is not None else None
        for i, layer in enumerate(self.layers):
            residual = hidden
            x = layer.input_layernorm(hidden)
            attn = layer.self_attn
            q, k, v = self._qkv(attn, x, cos, sin, q8[i] if q8 else None)
            out = attend(i, attn, q, k, v).reshape(*x.shape[:-1], -1).contiguous()
            hidden = residual + (q8[i].o(out) if q8 else attn.o_proj(out))
            residual = hidden
            x = layer.post_attention_layernorm(hidden)
            if q8:
                gate, up = q8[i].gate_up(x).chunk(2, dim=-1)
                hidden = residual + q8[i].down(q8[i].act(gate) * up)
            else:
                hidden = residual + layer.mlp(x)
        head = self.int8.lm_head if self.int8 is not None else self.lm_head
        return head(self.norm(hidden)[:, -1, :])

    def _qkv(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q8: Int8Layer | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries and keys [B, heads, 1, d] and values, as the attention module's forward makes them."""
        shape = (*x.shape[:-1], -1, attn.head_dim)
        if q8 is not None:
            q, k, v = q8.qkv(x).split(q8.sizes, dim=-1)
            q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        else:
            q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:  # qwen3: RMSNorm over each head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.transpose(1, 2)
        q, k = self.apply_rotary(q, k, cos, sin)
        return q, k, v


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """One query row (q [1, heads, 1, d]) over a whole fixed-size buffer (k, v [1, kv_heads, S, d]) with an
    additive `mask` [1, 1, 1, S]: kvrag.decode.attend.attend_rows for one sequence. Returns [1, 1, heads, d]."""
    return attend_rows(q, k, v, mask, scaling)


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of one sequence's n consecutive rows (q [n, heads, 1, d]) over its slots
    (k, v [1, kv_heads, S, d], the rows' own the last n): row j sees the slots up to S - n + j. The
    query heads that share a K/V head are stacked along the query axis, so the K/V are read as they
    are, never repeated per head. Returns [n, 1, heads, d], as the attention functions do."""
    n, heads, _, d = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    group = heads // kv_heads
    seen = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
    mask = torch.zeros(n, S, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    grouped = q.permute(2, 1, 0, 3).reshape(1, kv_heads, group * n, d)  # [1, kv_heads, group x n, d]
    out = torch.nn.functional.scaled_dot_product_attention(grouped, k, v, attn_mask=mask.repeat(group, 1)[None, None], scale=scaling)
    return out.reshape(1, heads, n, d).permute(2, 0, 1, 3)


def _write(buf: torch.Tensor, new: torch.Tensor, slot: torch.Tensor) -> None:
    """Write each sequence's one new K (or V) [B, kv_heads, 1, d] at its own slot, in place."""
    new = new.to(buf.dtype)
    if buf.shape[0] == 1:
        buf.index_copy_(2, slot, new)
    else:
        rows = torch.arange(buf.shape[0], device=buf.device)
        buf[rows, :, slot] = new[:, :, 0]


_STEPS: "weakref.WeakKeyDictionary[Any, dict[str, LeanStep]]" = weakref.WeakKeyDictionary()
_WEIGHTS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()  # model -> the decode weights chosen for it


def use_decode_weights(model: Any, kind: str) -> str:
    """Choose the weights every decode step of `model` reads: "model" (its own) or "int8"
    (kvrag.decode.int8). Per model, as the batcher that steps its sequences together is: every engine
    over these weights decodes alike. Returns what will be used: "model" where int8 is unavailable
    (logged) or the model is not on the CPU or has no lean step."""
    check_decode_weights(kind)
    if kind == "int8":
        why = ("this torch has no quantized CPU kernels" if not int8_available() else
               "the model is not on the CPU" if next(model.parameters()).device.type != "cpu" else
               "the model's architecture has no lean decode step" if not lean_supported(model) else "")
        if why:
            log.warning("int8 decode weights are not used: %s; decoding with the model's own weights", why)
            kind = "model"
    _WEIGHTS[model] = kind
    lean_step(model)  # made now (int8: ~1 s of quantising), so no answer pays for it
    return kind


def lean_step(model: Any, weights: str | None = None) -> LeanStep | None:
    """The model's lean step over `weights` (None: the decode weights chosen for it), made once per model
    and kind; None if its architecture is not one it reproduces."""
    if not lean_supported(model):
        return None
    kind = weights or _WEIGHTS.get(model, "model")
    steps = _STEPS.setdefault(model, {})
    step = steps.get(kind)
    if step is None:
        step = steps[kind] = LeanStep(model, Int8Weights(model) if kind == "int8" else None)
    return step
