"""Int8 weights for decoding on the CPU, opt-in (`KVRag(decode_weights="int8")`, `--decode-weights int8`).

Why: one decode step reads every weight once, and on this kind of machine that read is most of the
step (the bundled model: 540 MB of fp32 weights, ~21 ms of a ~37 ms step at 1k context). Stored as
int8, one byte a weight, the same step reads a quarter of that: the bundled model decodes ~1.5x
faster. The price is the answer: int8 weights are not the user's weights, so the tokens may differ
from the model's own after some point; the decode benchmark reports how often and where beside the
speed. Prefill (the context, the recomputed tokens, the KV stored) always uses the model's weights;
only the decode steps' projections and head read int8. Off by default: `method="full"` answers are
then the model's own.

How: every linear layer a decode step reads (q/k/v as one matrix, o, gate/up as one matrix, down,
and the LM head) becomes one of torch's dynamically quantized linears (fbgemm/x86 kernels): weights
int8 per output channel, each step's activations quantized per tensor on the fly, products summed
in int32. Fusing q/k/v and gate/up is exact: each output channel keeps its own scale and the
activations are quantized once either way.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from kvrag.defaults import DECODE_WEIGHTS  # "model": the model's own weights (the default); "int8": see above

log = logging.getLogger(__name__)


def int8_available() -> bool:
    """Whether this torch has the CPU kernels for dynamically quantized linears."""
    try:
        import torch.ao.nn.quantized.dynamic  # noqa: F401

        return "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines
    except Exception:  # a build without quantized kernels
        return False


def check_decode_weights(kind: str) -> str:
    if kind not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {DECODE_WEIGHTS}, got {kind!r}")
    return kind


def _quantized(*linears: torch.nn.Module) -> torch.nn.Module:
    """One dynamically quantized linear computing the given linears' outputs side by side."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    weight = torch.cat([lin.weight.detach().float() for lin in linears])
    has_bias = any(getattr(lin, "bias", None) is not None for lin in linears)
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if has_bias:
            fused.bias.copy_(torch.cat([lin.bias.detach().float() if lin.bias is not None else weight.new_zeros(lin.out_features)
                                        for lin in linears]))
    fused.qconfig = per_channel_dynamic_qconfig
    with warnings.catch_warnings():  # torch.ao.quantization's deprecation notices: its kernels are what we use
        warnings.simplefilter("ignore")
        return DynamicLinear.from_float(fused)


@dataclass
class Int8Layer:
    qkv: torch.nn.Module  # q, k and v projections, one matrix
    sizes: tuple[int, int, int]  # where qkv's output splits
    o: torch.nn.Module
    gate_up: torch.nn.Module  # gate and up projections, one matrix
    down: torch.nn.Module
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
                qkv=_quantized(attn.q_proj, attn.k_proj, attn.v_proj),
                sizes=(attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features),
                o=_quantized(attn.o_proj),
                gate_up=_quantized(mlp.gate_proj, mlp.up_proj),
                down=_quantized(mlp.down_proj),
                act=mlp.act_fn,
            ))
        self.lm_head = _quantized(model.lm_head)

    @property
    def nbytes(self) -> int:
        """Bytes of int8 weights (and their per-channel scales) one decode step reads."""
        mods = [m for lay in self.layers for m in (lay.qkv, lay.o, lay.gate_up, lay.down)] + [self.lm_head]
        total = 0
        for m in mods:
            w = m.weight()
            total += w.numel() + w.q_per_channel_scales().numel() * 8
        return total
