"""The training passes: the context KV of a micro-batch, the pass over it, the answer loss.

1. the context: each chunk's KV computed after the system prefix alone, RoPE-free, then stitched
   into the prompt by `kvrag.fuse.stitch.stitch` (keys re-rotated to the chunk's place), exactly as at
   inference. Mode `links` reads it from the engine (`load_context`); modes `lora`/`full` compute it
   here with gradients (`encode_context`). Both turn their stitched contexts into one padded
   `Context` with `stitched_context`;
2. the pass: the link tokens, the question and the answer in one forward over that context, at
   their inference positions, under KVLink's picture (`kvrag.fuse.links.link_picture`).
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from kvrag.model.cache import cache_arg, cache_from_kv, cache_kv, empty_cache
from kvrag.fuse.stitch import HIDDEN_POSITION, Stitched, stitch
from kvrag.kv.layout import LINK_PLACEHOLDER
from kvrag.fuse.links import additive, link_picture, link_row_index
from kvrag.model.cache import LayerStack, stack_layers
from kvrag.model.rope import Rotary
from kvrag.training.data import Example, context_positions


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


def stitched_context(examples: Sequence[Example], stitched: Sequence[Stitched]) -> Context:
    """Each example's stitched context without its (empty) link slots, right-padded into one batch."""
    keys, values, positions = [], [], []
    for e, st in zip(examples, stitched):
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


def load_context(rag: Any, examples: Sequence[Example]) -> Context:
    """Context KV from the engine (store hits; misses computed and kept), stitched exactly as at inference.

    Mode `links` reads it this way: the base model is frozen, so a chunk's KV never changes and each
    passage is computed once for the whole run (and shared with inference through the store).
    """
    return stitched_context(examples, [rag.stitched(e.chunks, e.segments) for e in examples])


class _GradRotary:
    """`stitch` rotates keys where they lie (`out=`), which autograd refuses for keys that carry
    gradients; this rotates, then copies: the same float ops, so the same keys."""

    def __init__(self, rotary: Rotary) -> None:
        self.rotary = rotary

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rotated = self.rotary.rotate(keys, positions)
        return rotated if out is None else out.copy_(rotated)

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions, like)

    def rotate_in_place(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        keys.copy_(self.rotary.rotate_at(keys, cos, sin))


def encode_context(model: Any, rotary: Any, examples: Sequence[Example]) -> Context:
    """Context KV computed here (with gradients: modes `lora` and `full`, where the model that encodes
    the chunks is the one being trained).

    One forward over [prefix | chunk 1 | ... | chunk N] per example, chunk tokens at their precompute
    positions under the picture's chunk rows (prefix + own chunk): each chunk's KV is then what
    precompute stores (keys made RoPE-free), and `fuse.stitch` places it in the prompt as at inference.
    """
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
    model(input_ids=input_ids, position_ids=rope_pos, attention_mask=mask, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    kv = cache_kv(cache)
    rot = _GradRotary(rotary) if torch.is_grad_enabled() else rotary
    return stitched_context(examples, [stitch(*_example_stacks(kv, b, e, rotary), e.segments, rot) for b, e in enumerate(examples)])


def _example_stacks(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], row: int, e: Example, rotary: Any) -> tuple[LayerStack, list[LayerStack]]:
    """Batch row `row` of the context forward as precompute's output: the prefix KV (rotated: it never
    moves) and each chunk's KV with its keys stripped of the rotation of its precompute positions."""
    p = len(e.segments.prefix)
    prefix = stack_layers(kv, 0, p, row=row)
    chunks, start = [], p
    for chunk in e.segments.chunks:
        keys, values = stack_layers(kv, start, start + len(chunk), row=row)
        chunks.append((rotary.unrotate(keys, torch.arange(p, p + len(chunk))), values))
        start += len(chunk)
    return prefix, chunks


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
    embeds = model.get_input_embeddings()(batch.input_ids)
    if batch.link_index.numel():
        flat = links.reshape(-1, links.shape[-1])[batch.link_index].to(embeds.dtype)
        embeds = embeds.masked_scatter(batch.is_link[..., None], flat)
    cache = cache_from_kv(list(zip(context.keys, context.values)))
    out = model(
        inputs_embeds=embeds,
        position_ids=batch.positions,
        attention_mask=batch.mask.to(embeds.dtype),
        **cache_arg(model, cache),
        use_cache=True,
        logits_to_keep=batch.predict,
    )
    return out.logits.reshape(-1, out.logits.shape[-1])


def batch_loss(model: Any, context: Context, batch: PassBatch, links: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens."""
    return torch.nn.functional.cross_entropy(batch_logits(model, context, batch, links).float(), batch.targets)


@contextlib.contextmanager
def base_weights(model: Any) -> Iterator[Any]:
    """The base model inside: a peft model with its adapter switched off, any other model as it is."""
    if hasattr(model, "disable_adapter") and hasattr(model, "peft_config"):
        with model.disable_adapter():
            yield model
    else:
        yield model


def batch_context(model: Any, examples: Sequence[Example], rag: Any = None, rotary: Any = None) -> Context:
    """A micro-batch's context: from the engine (`rag`, modes links and lora-after: the base weights' chunk KV, the
    LoRA switched off while a missing chunk is computed) or encoded here (`rotary`, with gradients)."""
    if rag is not None:
        with torch.no_grad(), base_weights(model):
            return load_context(rag, examples)
    return encode_context(model, rotary, examples)


def example_loss(model: Any, examples: Sequence[Example], links: torch.Tensor, max_chunks: int, rag: Any = None, rotary: Any = None) -> torch.Tensor:
    """The loss of a micro-batch: context from the engine (`rag`, mode links) or encoded here (`rotary`), then the pass."""
    context = batch_context(model, examples, rag, rotary)
    dtype = next(model.parameters()).dtype
    return batch_loss(model, context, pass_batch(examples, context, max_chunks, dtype), links)

