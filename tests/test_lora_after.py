"""Mode lora-after: a LoRA that acts only at the positions after the cached chunks (tiny random models).

The chunks' KV stays the base weights' (one store entry per chunk serves every method); the merged weights read
the stitched prompt and decode. Training reads the same entries from the store, and the served pass is the
trained one."""

import math

import pytest
import torch

from kvrag import KVRag
from kvrag.link_adapter import LinkAdapter, load_adapter, read_adapter_header, save_adapter
from kvrag.training.config import TrainConfig
from kvrag.training.loop import train
from kvrag.training.passes import base_weights, batch_logits, load_context, pass_batch
from kvlink_helpers import CHUNKS, IDS, Q, example_of, lora_adapter, make_rag
from tiny import qa_rows

pytest.importorskip("peft")


def as_mode(adapter, mode, zero=False):
    lora = {k: (torch.zeros_like(v) if zero and k.endswith(".B") else v) for k, v in adapter.lora.items()} if mode != "links" else {}
    return LinkAdapter(embeds=adapter.embeds, mode=mode, lora=lora, meta={**adapter.meta, "mode": mode})


def test_the_merged_weights_read_the_base_chunk_entries():
    rag = make_rag()  # the base engine: CHUNKS precomputed into its store
    adapter, _ = lora_adapter(rag.lm, rag.layout.identity)
    entries = len(rag.store)
    after = KVRag(rag.lm, store=rag.store, link_adapter=as_mode(adapter, "lora-after"), check=False)
    after.precompute(CHUNKS, progress=False)  # nothing of its own to store
    pre = after.prefill(Q, IDS, method="kvlink")
    assert pre.stats.weights == "adapter" and pre.stats.cache_hits == 3 and pre.stats.cache_misses == 0
    assert len(rag.store) == entries
    # with its LoRA at zero it is exactly the links-only adapter over the base weights
    links = KVRag(rag.lm, store=rag.store, link_adapter=as_mode(adapter, "links"), check=False).prefill(Q, IDS, method="kvlink")
    zero = KVRag(rag.lm, store=rag.store, link_adapter=as_mode(adapter, "lora-after", zero=True), check=False)
    assert torch.allclose(zero.prefill(Q, IDS, method="kvlink").logits, links.logits, atol=1e-6)
    # its LoRA acts: not the links-only answer, and not mode lora's, whose merged weights encode the chunks again
    lora = KVRag(rag.lm, store=rag.store, link_adapter=as_mode(adapter, "lora"), check=False).prefill(Q, IDS, method="kvlink")
    assert (pre.logits - links.logits).abs().max() > 1e-4 and (pre.logits - lora.logits).abs().max() > 1e-4
    assert lora.stats.cache_misses == 3  # mode lora: entries of its own
    # every other method, Full Attention first, reads the base weights
    for method in ("full", "reuse"):
        assert torch.equal(after.prefill(Q, IDS, method=method).logits, rag.prefill(Q, IDS, method=method).logits)
    answer = after.answer(Q, chunk_ids=IDS, method="kvlink", max_new_tokens=4, stop_at="none")
    assert answer.stats.weights == "adapter" and answer.stats.generated_tokens == 4
    held = len(rag.store)
    assert after.forget(CHUNKS[:1]) == 1 and len(rag.store) == held - 1  # forgotten once, from the one store


def test_lora_after_trains_from_the_store_and_is_served_as_trained(tmp_path):
    rag = make_rag()
    before = {n: p.detach().clone() for n, p in rag.lm.model.named_parameters()}
    res = train(TrainConfig(out=str(tmp_path), mode="lora-after", link_tokens=1, max_chunks=4, max_steps=2, grad_accum=1, lora_r=2,
                            store="memory://", progress=False, objective="distill", teacher_tokens=3), lm=rag.lm, rows=qa_rows(2))
    assert all(math.isfinite(x) for x in res.losses)
    assert all(torch.equal(p, before[n]) for n, p in rag.lm.model.named_parameters())  # the caller's model untouched
    assert read_adapter_header(res.adapter_path)["mode"] == "lora-after"
    adapter = load_adapter(res.adapter_path, rag.lm, rag.layout.identity)
    assert adapter.mode == "lora-after" and adapter.lora and any(v.abs().max() > 0 for k, v in adapter.lora.items() if k.endswith(".B"))
    path = save_adapter(tmp_path / "again.safetensors", adapter)  # the file round trip keeps the mode and the factors
    again = load_adapter(path, rag.lm, rag.layout.identity)
    assert again.mode == "lora-after" and all(torch.equal(again.lora[k], adapter.lora[k]) for k in adapter.lora)
    # the training pass (LoRA on, chunk KV from the store with the LoRA off) gives the served first-token logits
    served = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    pre = served.prefill(Q, IDS, method="kvlink")
    from peft import LoraConfig, get_peft_model
    import copy

    wrapped = get_peft_model(copy.deepcopy(rag.lm.model), LoraConfig(r=2, lora_alpha=adapter.meta["lora"]["alpha"],
                                                                      target_modules=adapter.meta["lora"]["targets"], lora_dropout=0.0))
    for name, module in wrapped.named_modules():
        base = name.removeprefix("base_model.model.")
        if f"{base}.A" in adapter.lora:
            module.lora_A["default"].weight.data.copy_(adapter.lora[f"{base}.A"])
            module.lora_B["default"].weight.data.copy_(adapter.lora[f"{base}.B"])
    ex = example_of(rag, pre)
    with torch.no_grad(), base_weights(wrapped):
        ctx = load_context(rag, [ex])
    with torch.no_grad():
        logits = batch_logits(wrapped, ctx, pass_batch([ex], ctx, adapter.max_chunks, torch.float32), adapter.embeds)
    assert (logits[0] - pre.logits).abs().max().item() <= 1e-4
