"""Probes: run a few tokens part-way through the model over the stitched cache and look inside.

Selection rules need signals from inside the model (the question's attention at some layer, the
KV deviation of a real recompute at an early layer). A probe runs the stock decoder layers on the
chosen tokens at their true positions over a scratch copy of the stitched cache, captures queries
and the layer's full keys/values, and stops right after the deepest layer asked for. The stored
and stitched tensors are never written.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

from kvrag.model.cache import SpliceCache, layer_kv
from kvrag.fuse.stitch import Stitched, forward_pass, pass_inputs
from kvrag.model.masks import question_attention
from kvrag.model.loading import LoadedModel, decoder_of
from kvrag.model.cache import unstack_layers
from kvrag.model.rope import Rotary


class _StopProbe(Exception):
    pass


@dataclass
class ProbeResult:
    positions: torch.Tensor  # [n] positions of the probed tokens (overwritten chunk tokens first, then the question)
    key_positions: torch.Tensor  # [slots] position of every key slot (context slots, then the question)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, n, head_dim], rotated
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [kv_heads, slots, head_dim]
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)


def resolve_layer(lm: LoadedModel, layer: int) -> int:
    n = len(decoder_of(lm.model).layers)
    idx = layer if layer >= 0 else n + layer
    if not 0 <= idx < n:
        raise ValueError(f"layer {layer} out of range for a {n}-layer model")
    return idx


def _queries(attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """The attention module's rotated queries, computed the way its forward does (q_norm if any)."""
    head_dim = getattr(attn, "head_dim", None) or attn.q_proj.out_features // attn.config.num_attention_heads
    q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    q = q.transpose(1, 2)
    return rotary._apply(q, q, cos, sin)[0]


def _keys_values(attn: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention module's rotated keys and its values, computed the way its forward does (k_norm if any)."""
    head_dim = getattr(attn, "head_dim", None) or attn.k_proj.out_features // attn.config.num_key_value_heads
    shape = (*hidden.shape[:-1], -1, head_dim)
    k = attn.k_proj(hidden).view(shape)
    if getattr(attn, "k_norm", None) is not None:
        k = attn.k_norm(k)
    k = k.transpose(1, 2)
    v = attn.v_proj(hidden).view(shape).transpose(1, 2)
    return rotary._apply(k, k, cos, sin)[1], v


@contextmanager
def capture_queries(
    lm: LoadedModel, rotary: Rotary, layers: Iterable[int], into: ProbeResult, rows: slice | None = None, cache: Any = None,
    stop_after: int | None = None, kv_only: bool = False,
) -> Iterator[ProbeResult]:
    """Hooks that record each layer's rotated queries (optionally only `rows` of them), the layer's
    full keys/values from `cache` after its update, and stop the forward after layer `stop_after`.

    `kv_only`: no queries; at `stop_after` the keys and values are written into `cache` as the layer's
    attention would write them, and the forward stops there, before that layer attends (its attention
    output is what no caller of a keys/values probe reads: CacheBlend's deviation)."""
    layers_mod = decoder_of(lm.model).layers
    hooks = []

    def make_pre(i: int):
        def pre(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            if kv_only:
                if i == stop_after:
                    k, v = _keys_values(module, hidden, cos, sin, rotary)
                    cache.update(k, v, i)
                    keys, values = layer_kv(cache, i)
                    into.keys[i], into.values[i] = keys[0], values[0]
                    raise _StopProbe
                return
            if rows is not None:
                hidden = hidden[:, rows]
            if rows is not None:
                cos, sin = cos[:, rows], sin[:, rows]
            into.queries[i] = _queries(module, hidden, cos, sin, rotary)[0]
            into.scaling[i] = float(getattr(module, "scaling", hidden.shape[-1] ** -0.5))

        return pre

    def make_post(i: int):
        def post(module, args, output):
            if cache is not None:
                keys, values = layer_kv(cache, i)
                into.keys[i], into.values[i] = keys[0], values[0]
            if i == stop_after:
                raise _StopProbe

        return post

    for i in layers:
        attn = layers_mod[i].self_attn
        hooks.append(attn.register_forward_pre_hook(make_pre(i), with_kwargs=True))
        hooks.append(attn.register_forward_hook(make_post(i)))
    try:
        yield into
    except _StopProbe:
        pass
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def probe(
    lm: LoadedModel,
    rotary: Rotary,
    stitched: Stitched,
    layers: Iterable[int],
    recompute: torch.Tensor | None = None,
    queries: bool = True,
) -> ProbeResult:
    """Run `recompute` chunk positions (overwriting) plus the question through layers 0..max(layers);
    `queries=False`: only the layers' keys and values are wanted, so the deepest layer stops before it attends."""
    want = sorted({resolve_layer(lm, l) for l in layers})
    last = want[-1]
    device = lm.device
    over = (recompute if recompute is not None else torch.empty(0, dtype=torch.long)).to(device).sort().values
    ids, positions, key_pos = pass_inputs(stitched, over, device)
    # appending the question reallocates (no room is reserved here), so the stitched tensors are
    # only at risk from overwrites: scratch copies then, and only of the layers the probe reaches
    stitched.ensure(range(last + 1))  # layer-wise loading: fill the layers this probe reaches, no more
    kv = unstack_layers(stitched.keys, stitched.values)
    if over.numel():
        kv = [(k.clone(), v.clone()) if i <= last else (k, v) for i, (k, v) in enumerate(kv)]
    cache = SpliceCache(kv)
    cache.overwrite(stitched.slots_of(over).to(device) if over.numel() else None)
    result = ProbeResult(positions=positions, key_positions=key_pos)
    with capture_queries(lm, rotary, want, result, cache=cache, stop_after=last, kv_only=not queries):
        forward_pass(lm, cache, ids, positions, key_pos, name="probe")
    return result


def attention_probs(result: ProbeResult, layer: int, query_rows: slice | None = None) -> torch.Tensor:
    """Softmax attention of the probed tokens at `layer`: [heads, n, total], causal by position."""
    q = result.queries[layer]
    pos = result.positions
    if query_rows is not None:
        q, pos = q[:, query_rows], pos[query_rows]
    return question_attention(q, result.keys[layer], result.scaling[layer], pos, result.key_positions)
