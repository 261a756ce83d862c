"""The training context (modes lora/full) goes through fuse.stitch and equals the old hand-rolled encode_context.

`reference_encode_context` is the encode_context of kvrag/train.py before the split (commit f89218b),
kept here verbatim except that it reads the cache through kvrag.model.cache.cache_kv: the loss and the
gradients of the shared path must match it on a fixed padded batch.
"""

import copy
import random

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.model.cache import cache_kv, empty_cache
from kvrag.fuse.stitch import HIDDEN_POSITION
from kvrag.fuse.links import additive, default_link_embeds, link_picture
from kvrag.model.rope import Rotary
from kvrag.train import Context, TrainConfig, batch_loss, build_example, context_positions, encode_context, pass_batch, prepare_model
from kvrag.train import _pad_stack
from tiny import ARCHS, qa_rows, tiny_model, tiny_tokenizer

TOL = 1e-5


def reference_encode_context(model, rotary, examples):
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
    rope_pos = _pad_stack(loc, width, dim=0).to(device)
    mask_pos = _pad_stack(glob, width, dim=0, value=HIDDEN_POSITION)
    allowed = torch.stack([link_picture(e.segments, mask_pos[b], mask_pos[b]) for b, e in enumerate(examples)])[:, None]
    mask = additive(allowed, dtype).to(device)
    cache = empty_cache()
    model(input_ids=input_ids, position_ids=rope_pos, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    keys, values = [], []
    for layer_keys, layer_values in cache_kv(cache):
        k_rows = []
        for b, e in enumerate(examples):
            p, n = len(e.segments.prefix), glob[b].numel()
            kb = layer_keys[b : b + 1]
            chunk = rotary.rotate(rotary.unrotate(kb[:, :, p:n], loc[b][p:]), glob[b][p:])
            k_rows.append(torch.cat([kb[:, :, :p], chunk.to(kb.dtype), kb[:, :, n:]], dim=2))
        keys.append(torch.cat(k_rows))
        values.append(layer_values)
    return Context(keys, values, mask_pos.to(device))


def loss_and_grads(encode, mode, arch, k=2):
    torch.manual_seed(0)
    base = tiny_model(arch, seed=0)
    rag = KVRag(from_model(base, tiny_tokenizer()), store="memory://", check=False)
    examples = [build_example(rag.layout, r, random.Random(i), k, 4, 4096) for i, r in enumerate(qa_rows(3))]
    assert len({e.segments.total_len for e in examples}) > 1  # a padded batch
    cfg = TrainConfig(out="unused", mode=mode, link_tokens=k, max_chunks=4, lora_r=4)
    model, named = prepare_model(copy.deepcopy(base), cfg)
    if mode == "lora":  # peft starts B at zero: move it so the LoRA path changes the chunk KV
        with torch.no_grad():
            for n, p in named:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    links = torch.nn.Parameter(default_link_embeds(model, k, 4) + 0.1 * torch.randn(4, k, base.config.hidden_size, generator=torch.Generator().manual_seed(1)))
    rotary = Rotary(model.get_base_model() if hasattr(model, "get_base_model") else model)
    ctx = encode(model, rotary, examples)
    loss = batch_loss(model, ctx, pass_batch(examples, ctx, 4, torch.float32), links)
    loss.backward()
    grads = {"links": links.grad.clone()} | {n: p.grad.clone() for n, p in named}
    return ctx, loss.detach(), grads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_shared_context_path_equals_the_old_encode_context(arch, mode):
    if mode == "lora":
        pytest.importorskip("peft")
    ctx_old, loss_old, grads_old = loss_and_grads(reference_encode_context, mode, arch)
    ctx_new, loss_new, grads_new = loss_and_grads(encode_context, mode, arch)
    assert torch.equal(ctx_old.positions, ctx_new.positions)
    real = ctx_old.positions != HIDDEN_POSITION  # pad slots hold nothing anyone sees
    kv_diff = max(
        max((a.detach() - b.detach()).abs().permute(0, 2, 1, 3)[real].max().item() for a, b in zip(ctx_old.keys, ctx_new.keys)),
        max((a.detach() - b.detach()).abs().permute(0, 2, 1, 3)[real].max().item() for a, b in zip(ctx_old.values, ctx_new.values)),
    )
    assert kv_diff <= TOL
    assert (loss_old - loss_new).abs().item() <= TOL
    assert grads_old.keys() == grads_new.keys() and len(grads_old) > 1
    grad_diff = max((grads_old[n] - grads_new[n]).abs().max().item() for n in grads_old)
    print(f"{arch} {mode}: loss {loss_old.item():.6f} |dloss| {(loss_old - loss_new).abs().item():.2e} "
          f"max |dKV| {kv_diff:.2e} max |dgrad| {grad_diff:.2e} over {len(grads_old)} tensors")
    assert grad_diff <= TOL
