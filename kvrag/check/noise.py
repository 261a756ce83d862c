"""The gate's noise floor: how far the model's own half-precision computation lands from fp32.

A fixed tolerance per dtype cannot fit every model: bf16 rounding accumulates with depth, so a
32-layer 8B model's own Full Attention sits several times further from exact arithmetic than a
16-layer 1B model's (issue #22, item 3). So each numeric check measures the model's own noise on
the check's prompt: the same computation (the keys computed in place; Full Attention's logits)
run once as the model runs it and once in fp32 on the same weights, and accepts KV reuse when its
error is within `MULTIPLE` times that noise, never stricter than an absolute per-dtype `FLOORS`.

The fp32 reference does not copy the model: `fp32_reference` casts one decoder layer (and the
final norm / LM head) at a time to fp32 while it runs and back afterwards. bf16/fp16 -> fp32 ->
bf16/fp16 is exact, so the weights come back bit for bit, and the extra memory is one layer in
fp32 plus fp32 activations, so a model that fits on its device can always be checked.

A float32 model is its own reference: its noise is 0 by definition and its tolerance is the strict
floor (1e-4, as before).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, NamedTuple

import torch

from kvrag.model.loading import decoder_of

# Absolute floors on the tolerance, relative L2 (see kvrag/check/checks.py for the measurements).
# float32: the strict tolerance of before (rounding-only differences are <= 5e-6). bf16/fp16:
# about two roundings of the dtype (bf16 unit roundoff 2^-9 = 2e-3, fp16 2^-12 = 2.4e-4), so a
# noise measurement that happens to come out tiny cannot make the check fail on one rounding.
FLOORS: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"keys": 1e-4, "logits": 1e-4},
    torch.bfloat16: {"keys": 8e-3, "logits": 8e-3},
    torch.float16: {"keys": 1e-3, "logits": 1e-3},
}

# Reuse may land this many times further from Full Attention than Full Attention lands from fp32.
# Two independent half-precision computations of the same value differ by ~sqrt(2) x the noise of
# either, and a reused key is rounded twice more (stored RoPE-free, re-rotated): measured ratios
# (reuse error / noise, worst check) are 0.66 .. 1.26 on random llama/qwen2 models of 3..32 layers
# in bf16 and fp16 (`python tests/test_gate_noise.py`); 3 leaves >2x headroom above the worst of
# those, and every planted defect measured lands far above it (tests/test_gate_noise.py).
MULTIPLE = 3.0

# Beyond this a tolerance says nothing: the model's own half-precision computation is more than
# CEILING / MULTIPLE (~17%) away from fp32, so the gate cannot tell reuse from a defect and refuses.
# Not lower: deep random-weight models' own bf16 logits sit 4e-2 (24 layers, CPU) .. ~7e-2 (8B shape,
# H100) from fp32, so their tolerance reaches 0.1 .. 0.2. Key defects are still caught on the early
# layers, whose noise stays ~4e-3 (each layer is judged by its own noise).
CEILING = 0.5


def tolerance(noise: float, dtype: torch.dtype, kind: str) -> float:
    """max(MULTIPLE * noise, floor): the tolerance a check of `kind` ("keys"/"logits") is judged by."""
    floor = FLOORS.get(dtype, FLOORS[torch.bfloat16])[kind]
    return max(MULTIPLE * noise, floor)


class Judged(NamedTuple):
    index: int  # the part (layer) closest to, or furthest past, its tolerance
    passed: bool
    error: float
    tolerance: float
    noise: float | None
    multiple: float | None
    remark: str


def judge(errs: list[float], noises: list[float] | None, dtype: torch.dtype, kind: str, fixed: float) -> Judged:
    """Judge each part (a layer's keys, or the logits) by its own tolerance, max(MULTIPLE * noise, floor),
    so a quiet early layer keeps its check strict on a deep model; report the worst part.

    `noises` None: the noise could not be measured, every part is judged by the `fixed` tolerance.
    """
    tols = [fixed] * len(errs) if noises is None else [tolerance(n, dtype, kind) for n in noises]
    ratio = [e / t if math.isfinite(e) else math.inf for e, t in zip(errs, tols)]
    i = max(range(len(errs)), key=lambda j: ratio[j])
    passed, remark = ratio[i] <= 1.0, ""
    if noises is not None and max(tols) > CEILING:
        passed = False
        remark = f"; the model's own {str(dtype).removeprefix('torch.')} noise is too large to verify reuse (tolerance > {CEILING:g})"
    return Judged(i, passed, errs[i], tols[i], None if noises is None else noises[i], None if noises is None else MULTIPLE, remark)


def describe(dtype: torch.dtype) -> str:
    """What a report's noise column was measured against (printed under the table, kept in the verdict)."""
    if dtype == torch.float32:
        return "0 in float32 (the model is its own fp32 reference), so tolerance = floor"
    floor = FLOORS.get(dtype, FLOORS[torch.bfloat16])["keys"]
    return (f"the same computation in {str(dtype).removeprefix('torch.')} vs in fp32 on the same weights "
            f"(layer by layer); x = {MULTIPLE:g}, floor {floor:.1e}")


def _float_tree(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        return x.float() if x.dtype == dtype else x
    if isinstance(x, tuple):
        return tuple(_float_tree(v, dtype) for v in x)
    if isinstance(x, list):
        return [_float_tree(v, dtype) for v in x]
    if isinstance(x, dict):
        return {k: _float_tree(v, dtype) for k, v in x.items()}
    return x


@contextlib.contextmanager
def fp32_reference(model: Any) -> Iterator[None]:
    """Within this block the model computes in fp32 on its own (half-precision) weights, layer by layer.

    Each decoder layer, the final norm and the LM head are cast to fp32 just before they run and back
    just after (exact both ways); the embedding's output is cast to fp32, so the rotary cos/sin and
    every activation are fp32. Weights are restored even if the forward raises.
    """
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32:
        yield
        return
    dec = decoder_of(model)
    blocks = [*dec.layers, getattr(dec, "norm", None), model.get_output_embeddings()]
    upcast: dict[int, tuple[torch.nn.Parameter, torch.dtype]] = {}

    def up(mod: Any, args: Any, kwargs: Any) -> Any:
        for p in mod.parameters():
            if p.dtype == dtype and id(p) not in upcast:
                upcast[id(p)] = (p, p.dtype)
                p.data = p.data.float()
        return _float_tree(args, dtype), _float_tree(kwargs, dtype)

    def down(mod: Any, args: Any, kwargs: Any, out: Any) -> Any:
        for p in mod.parameters():
            if id(p) in upcast:
                p.data = p.data.to(upcast.pop(id(p))[1])
        return out

    handles = [model.get_input_embeddings().register_forward_hook(lambda m, a, o: _float_tree(o, dtype))]
    for block in blocks:
        if block is not None:
            handles.append(block.register_forward_pre_hook(up, with_kwargs=True))
            handles.append(block.register_forward_hook(down, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p, dt in upcast.values():  # an exception inside a block: put its weights back
            p.data = p.data.to(dt)
        upcast.clear()


def reference_keys(model: Any, seq: torch.Tensor, positions: torch.Tensor, start: int, end: int) -> list[torch.Tensor]:
    """Per-layer fp32 keys of tokens [start, end) of `seq` run at `positions` (the key check's in-place keys)."""
    from kvrag.model.cache import cache_arg, cache_kv, empty_cache

    cache = empty_cache()
    with torch.no_grad(), fp32_reference(model):
        model(input_ids=seq, position_ids=positions, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    return [k[0, :, start:end].float() for k, _ in cache_kv(cache)]


def reference_logits(model: Any, ids: list[int], device: Any) -> torch.Tensor:
    """fp32 last-position logits of the whole prompt `ids` in one pass (Full Attention's reference)."""
    seq = torch.tensor([ids], device=device)
    with torch.no_grad(), fp32_reference(model):
        out = model(input_ids=seq, position_ids=torch.arange(len(ids), device=device)[None], use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].float()


__all__ = ["CEILING", "FLOORS", "MULTIPLE", "Judged", "describe", "fp32_reference", "judge", "reference_keys", "reference_logits", "tolerance"]
