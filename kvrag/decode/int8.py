"""Int8 weights for decoding on the CPU, opt-in (`KVRag(decode_weights="int8")`, `--decode-weights int8`).

Why: one decode step reads every weight once, and on this kind of machine that read is most of the
step (the bundled model: 538 MB of fp32 weights, ~21 ms of a ~37 ms step at 1k context). Stored as
int8, one byte a weight, the same step reads about a quarter of that. The price is the answer: int8
weights are not the user's weights, so the tokens may part from the model's own after some point;
`kvrag bench-decode --int8` reports how often and where beside the speed. Prefill (the context, the
recomputed tokens, the stored KV, the first token) always reads the model's own weights; only the
decode steps after it read int8. Off by default: answers are then the model's own.

How: every linear layer a decode step reads (q/k/v as one matrix, o, gate/up as one matrix, down,
and the LM head) keeps its weight as int8 with one scale per output channel (weight-only: the
activations are not quantized, only rounded to bfloat16 for the kernel, torch's
`_weight_int8pack_mm`, the int8 weight-only product gpt-fast and torchao use on the CPU). Chosen by
measurement (`kvrag bench-decode --int8`, the bundled model, this 2-core CPU): torch's dynamically
quantized linears (activations quantized to int8 as well) decoded 41.0 tok/s at 1.3k context against
these 36.2, but their answers over the sample's questions parted from the model's in 30 of 36 at 64
tokens, these in 16.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvrag.defaults import DECODE_WEIGHTS  # "model": the model's own weights (the default); "int8": see above

log = logging.getLogger(__name__)


def int8_available() -> bool:
    """Whether this torch has the CPU kernel for int8 weight-only products."""
    return hasattr(torch, "_weight_int8pack_mm")


def check_decode_weights(kind: str) -> str:
    if kind not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {kind!r}")
    return kind


class Int8Linear(torch.nn.Module):
    """The given linears' outputs side by side, from int8 weights with a scale per output channel."""

    def __init__(self, *linears: torch.nn.Module) -> None:
        super().__init__()
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
        scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(torch.bfloat16))
        biases = [getattr(lin, "bias", None) for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach().float() if b is not None else weight.new_zeros(lin.out_features) for b, lin in zip(biases, linears)])
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int8pack_mm(flat, self.weight, self.scale).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], -1)


@dataclass
class Int8Layer:
    qkv: Int8Linear  # q, k and v projections, one matrix
    sizes: tuple[int, int, int]  # where qkv's output splits
    o: Int8Linear
    gate_up: Int8Linear  # gate and up projections, one matrix
    down: Int8Linear
    act: Any  # the MLP's activation (its own module's)


class Int8Weights:
    """The int8 linears a decode step of `model` reads (see the module docstring); `nbytes` what they hold."""

    def __init__(self, model: Any) -> None:
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("int8 decode weights run on the CPU only")
        self.layers: list[Int8Layer] = []
        for layer in model.model.layers[: model.config.num_hidden_layers]:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(Int8Layer(
                qkv=Int8Linear(attn.q_proj, attn.k_proj, attn.v_proj),
                sizes=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
                o=Int8Linear(attn.o_proj),
                gate_up=Int8Linear(mlp.gate_proj, mlp.up_proj),
                down=Int8Linear(mlp.down_proj),
                act=mlp.act_fn,
            ))
        self.lm_head = Int8Linear(model.lm_head)

    @property
    def nbytes(self) -> int:
        """Bytes of int8 weights (and their per-channel scales) one decode step reads."""
        mods = [m for lay in self.layers for m in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [self.lm_head]
        return sum(b.numel() * b.element_size() for m in mods for b in m.buffers())
