"""Helpers of the KVLink tests (test_kvlink*, test_link_adapter): tiny engines, random adapters, captured masks."""

import copy

import pytest
import torch

from kvrag.model.attention import active_spec
from kvrag.model.masks import additive

from kvrag import KVRag, from_model
from kvrag.link_adapter import LinkAdapter, adapter_header
from kvrag.train import (
    Example,
    lora_factors,
)
from tiny import qa_rows, tiny_model, tiny_tokenizer, THREE_CHUNKS, THREE_IDS, THREE_Q


CHUNKS, IDS, Q = THREE_CHUNKS, THREE_IDS, THREE_Q


def make_rag(arch="llama", seed=0, link_adapter=None, store="memory://", **kw):
    rag = KVRag(from_model(tiny_model(arch, seed=seed, **kw), tiny_tokenizer()), store=store, link_adapter=link_adapter, check=False)
    rag.precompute(CHUNKS, progress=False)
    return rag


def random_adapter(lm, k=5, max_chunks=4, seed=0, layout_identity=None, mode="links", **extra):
    g = torch.Generator().manual_seed(seed)
    hidden = lm.model.config.hidden_size
    meta = adapter_header(lm, k, mode, layout_identity)
    return LinkAdapter(embeds=torch.randn(max_chunks, k, hidden, generator=g) * 0.5, mode=mode, meta=meta, **extra)


def capture_masks(model):
    """Record (positions, attention mask) of every forward of `model`."""
    seen = []

    def hook(module, args, kwargs):
        spec = active_spec()  # kvrag_sdpa attends by the pass's rule: record it as the dense mask it replaces
        mask = kwargs.get("attention_mask") if spec is None else additive(spec.dense_allowed(), torch.float32)[None, None]
        seen.append((kwargs.get("position_ids"), mask))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def example_of(rag, pre, answer=(5, 6)):
    return Example(pre.segments, list(answer), None, list(CHUNKS))


rows = qa_rows


def peft_lora(model, seed=0):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return wrapped.eval()


def lora_adapter(lm, layout_identity, seed=0):
    wrapped = peft_lora(lm.model, seed)
    factors, cfg = lora_factors(wrapped)
    meta = adapter_header(lm, 2, "lora", layout_identity, lora={**cfg, "targets": ["q_proj", "v_proj"]})
    g = torch.Generator().manual_seed(seed)
    return LinkAdapter(embeds=torch.randn(3, 2, lm.model.config.hidden_size, generator=g), mode="lora", lora=factors, meta=meta), wrapped
