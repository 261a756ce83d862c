"""KVLink on tiny random models: one picture for training and inference, K=0 is reuse, adapters, training."""

import argparse
import copy
import json
import os
import random

import pytest
import torch

from kvrag.model.attention import active_spec
from kvrag.model.masks import additive

from kvrag import Chunk, KVRag, from_model
from kvrag.engine import _AdapterPath
from kvrag.options import AnswerOptions
from kvrag.errors import AdapterMismatchError
from kvrag.kv.layout import LAYOUT_VERSION, Segments
from kvrag.fuse.links import default_link_embeds, link_rows
from kvrag.link_adapter import LinkAdapter, adapter_header, apply_adapter, load_adapter, read_adapter_header, save_adapter
from kvrag.methods import get_method, token_budget
from kvrag.model.rope import Rotary
from kvrag.train import (
    Example,
    TrainConfig,
    add_train_links_parser,
    batch_logits,
    build_example,
    encode_context,
    example_loss,
    load_context,
    load_rows,
    lora_factors,
    main,
    pass_batch,
    prepare_model,
    train,
    training_mask,
)
from tiny import ARCHS, qa_rows, tiny_model, tiny_tokenizer, THREE_CHUNKS, THREE_IDS, THREE_Q

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


# -- layout and the picture ----------------------------------------------------------------------
def test_segments_with_link_slots():
    seg = Segments(prefix=[1, 2], chunks=[[3, 4, 5], [6]], question=[7, 8], links=2)
    assert seg.chunk_starts == [2, 7]
    assert seg.link_positions() == [5, 6, 8, 9]
    assert seg.context_len == 10 and seg.total_len == 12 and seg.chunk_tokens == 4
    assert seg.all_ids() == [1, 2, 3, 4, 5, 0, 0, 6, 0, 0, 7, 8]
    plain = Segments(prefix=[1, 2], chunks=[[3, 4, 5], [6]], question=[7, 8])
    assert plain.chunk_starts == [2, 5] and plain.link_positions() == [] and plain.context_len == 6
    m = training_mask(seg, seg.total_len)
    assert m[3, :4].tolist() == [True, True, True, True] and not m[3, 4:].any()  # chunk 1 token: prefix + own chunk
    assert m[7, :2].all() and not m[7, 2:7].any() and m[7, 7]  # chunk 2's token never sees chunk 1 or its links
    assert m[8, :9].all() and not m[8, 9:].any()  # link(2, 1): everything before it
    assert m[11].all()  # the question's last token sees everything


@pytest.mark.parametrize("k", [1, 5])
def test_inference_and_training_masks_are_blocks_of_one_picture(k):
    rag = make_rag()
    seen, h = capture_masks(rag.lm.model)
    try:
        pre = rag.prefill(Q, IDS, method="kvlink", link_tokens=k)
    finally:
        h.remove()
    seg = pre.segments
    assert len(seen) == 1  # links, question: one recompute pass
    (pos, mask), = seen
    pos = pos[0]
    key_pos = torch.cat([pre.stitched.positions, torch.arange(seg.context_len, seg.total_len)])
    ex = example_of(rag, pre)
    picture = training_mask(seg, seg.total_len + len(ex.answer))
    assert set(seg.link_positions()) <= set(pos.tolist())
    assert torch.equal(mask[0, 0] == 0, picture[pos][:, key_pos])
    # training: the chunk encoding (stage 1) and the pass (stage 2) see blocks of the same picture
    seen, h = capture_masks(rag.lm.model)
    try:
        with torch.no_grad():
            ctx = encode_context(rag.lm.model, rag.rotary, [ex])
            batch = pass_batch([ex], ctx, 10, torch.float32)
            batch_logits(rag.lm.model, ctx, batch, default_link_embeds(rag.lm.model, k))
    finally:
        h.remove()
    (_, m1), (_, m2) = seen
    glob = ctx.positions[0]
    assert torch.equal(m1[0, 0] == 0, picture[glob][:, glob])
    rows_ = batch.positions[0]
    assert torch.equal(m2[0, 0] == 0, picture[rows_][:, torch.cat([glob, rows_])])
    # with a selection rule, the recomputed chunk tokens are global rows (causal), the rest is the picture
    seen, h = capture_masks(rag.lm.model)
    try:
        sel = rag.prefill(Q, IDS, method="kvlink+epic", link_tokens=k, recompute_ratio=0.2)
    finally:
        h.remove()
    (pos, mask), = seen
    pos = pos[0]
    recomputed = torch.isin(pos, sel.selected)
    assert recomputed.sum() == sel.selected.numel() > 0
    allowed = mask[0, 0] == 0
    assert torch.equal(allowed[~recomputed], picture[pos[~recomputed]][:, key_pos])
    assert torch.equal(allowed[recomputed], key_pos[None, :] <= pos[recomputed][:, None])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [0, 1, 5])
def test_training_forward_reproduces_the_inference_prefill(arch, k):
    """Same layout, same link embeddings: the training pass gives the engine's first-token logits."""
    rag = make_rag(arch)
    adapter = random_adapter(rag.lm, k=k, max_chunks=2, layout_identity=rag.layout.identity) if k else None
    if adapter is not None:
        rag = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    pre = rag.prefill(Q, IDS, method="kvlink")
    assert pre.segments.links == k
    ex = example_of(rag, pre)
    table = adapter.embeds if adapter is not None else torch.zeros(2, 0, rag.lm.model.config.hidden_size)
    with torch.no_grad():
        for ctx in (load_context(rag, [ex]), encode_context(rag.lm.model, rag.rotary, [ex])):
            logits = batch_logits(rag.lm.model, ctx, pass_batch([ex], ctx, table.shape[0], torch.float32), table)
            assert (logits[0] - pre.logits).abs().max().item() <= 1e-5


# -- inference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_kvlink_with_no_links_and_no_adapter_is_exactly_reuse(arch):
    rag = make_rag(arch)
    reuse = rag.prefill(Q, IDS, method="reuse")
    for params in ({}, {"link_tokens": 0}):
        k0 = rag.prefill(Q, IDS, method="kvlink", **params)
        assert k0.segments == reuse.segments
        assert torch.equal(k0.logits, reuse.logits)
        for a, b in zip(k0.output.cache.layers, reuse.output.cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    a3 = rag.prefill(Q, IDS, method="a3", recompute_ratio=0.3)
    k0a3 = rag.prefill(Q, IDS, method="kvlink+a3", link_tokens=0, recompute_ratio=0.3)
    assert torch.equal(a3.selected, k0a3.selected) and torch.equal(a3.logits, k0a3.logits)


def test_link_tokens_are_computed_in_the_one_recompute_pass():
    rag = make_rag()
    adapter = random_adapter(rag.lm, k=5, layout_identity=rag.layout.identity)
    rag = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    reuse = rag.prefill(Q, IDS, method="reuse")
    calls, h = capture_masks(rag.lm.model)
    try:
        pre = rag.prefill(Q, IDS, method="kvlink")
    finally:
        h.remove()
    assert len(calls) == 1
    seg = pre.segments
    assert seg.links == 5 and pre.stats.recomputed_tokens == 0 and pre.stats.cache_hits == 3
    assert pre.stats.prompt_tokens == reuse.stats.prompt_tokens + 5 * 3
    assert pre.stats.context_tokens == reuse.stats.context_tokens
    layer = pre.output.cache.layers[0]
    link = torch.tensor(seg.link_positions())
    assert layer.keys.shape[2] == seg.total_len
    assert (layer.keys[0, :, link].abs().sum(dim=(0, 2)) > 0).all()  # every link slot was written
    # the chunk tokens are the stored KV, untouched, at their shifted positions
    s0, e0 = pre.stitched.chunk_spans[1]
    r0, r1 = reuse.stitched.chunk_spans[1]
    assert torch.equal(layer.values[0, :, s0:e0], reuse.output.cache.layers[0].values[0, :, r0:r1])
    assert not torch.equal(pre.logits, reuse.logits)
    out = rag.answer(Q, IDS, method="kvlink", max_new_tokens=4)
    assert out.stats.method == "kvlink" and out.stats.generated_tokens > 0
    # more chunks than the adapter has rows: the last row set is reused
    rows_ = link_rows(adapter.embeds, 6)
    assert torch.equal(rows_[-5:], adapter.embeds[-1]) and torch.equal(rows_[:5], adapter.embeds[0])


def test_kvlink_with_every_chunk_token_recomputed_is_full_attention_over_the_linked_prompt():
    rag = make_rag("qwen2")
    adapter = random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity)
    rag = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    pre = rag.prefill(Q, IDS, method="kvlink+a3", recompute_ratio=1.0)
    seg = pre.segments
    assert pre.selected.numel() == seg.chunk_tokens
    ids = torch.tensor(seg.all_ids())[None]
    embeds = rag.lm.model.get_input_embeddings()(ids)
    embeds[0, seg.link_positions()] = adapter.rows(len(seg.chunks))
    with torch.no_grad():
        full = rag.lm.model(inputs_embeds=embeds, position_ids=torch.arange(seg.total_len)[None]).logits[0, -1]
    assert (full - pre.logits).abs().max().item() <= 1e-4


def test_kvlink_composes_with_a3_and_samkv():
    rag = make_rag()
    k = 3
    adapter = random_adapter(rag.lm, k=k, layout_identity=rag.layout.identity)
    rag = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    alone = rag.prefill(Q, IDS, method="kvlink")
    a3 = rag.prefill(Q, IDS, method="kvlink", select="a3", recompute_ratio=0.3)
    seg = a3.segments
    links = set(seg.link_positions())
    assert a3.selected.numel() == token_budget(0.3, seg.chunk_tokens) == a3.stats.recomputed_tokens
    assert not links & set(a3.selected.tolist())
    assert all(any(s <= p < e for s, e in a3.stitched.chunk_spans) for p in a3.selected.tolist())
    assert not torch.equal(a3.logits, alone.logits)
    same = rag.prefill(Q, IDS, method="kvlink+a3", recompute_ratio=0.3)
    assert torch.equal(same.selected, a3.selected) and torch.equal(same.logits, a3.logits)
    # samkv: the sparse cache keeps every link slot; fusion never blends a link slot with its empty placeholder
    over = rag.prefill(Q, IDS, method="kvlink+samkv", recompute_ratio=0.3, block_size=4)
    fused = rag.prefill(Q, IDS, method="kvlink+samkv", recompute_ratio=0.3, block_size=4, update="fusion")
    assert links <= set(over.stitched.positions.tolist())
    assert over.stats.kept_kv_ratio < 1.0
    for pre in (over, fused):
        slots = pre.stitched.slots_of(torch.tensor(sorted(links)))
        assert (pre.output.cache.layers[0].keys[0, :, slots].abs().sum(dim=(0, 2)) > 0).all()
    # layer-0 KV of a link token depends only on its embedding and position: equal in both modes
    so, sf = over.stitched.slots_of(torch.tensor(sorted(links))), fused.stitched.slots_of(torch.tensor(sorted(links)))
    assert (over.output.cache.layers[0].keys[0, :, so] - fused.output.cache.layers[0].keys[0, :, sf]).abs().max() <= 1e-6
    assert rag.answer(Q, IDS, method="kvlink+samkv", update="fusion", max_new_tokens=3).stats.generated_tokens > 0


def test_selection_probes_do_not_see_empty_link_slots_and_snapkv_keeps_links():
    from kvrag.methods.snapkv import SnapKV
    from kvrag.fuse.probe import attention_probs, probe

    rag = make_rag()
    pre = rag.prefill(Q, IDS, method="kvlink", link_tokens=4)
    st = pre.stitched
    # a probe (what a3 / cacheblend / samkv run before the pass) over a fresh context: links not computed yet
    fresh = rag.stitched(CHUNKS, pre.segments)
    result = probe(rag.lm, rag.rotary, fresh, [1])
    probs = attention_probs(result, 1)
    link_slots = fresh.slots_of(fresh.link_positions())
    assert probs[..., link_slots].abs().max() == 0 and probs[..., : fresh.positions.numel()].sum() > 0
    out = rag.answer(Q, IDS, method="kvlink", link_tokens=4, evict=SnapKV(budget=5), max_new_tokens=3)
    assert out.stats.generated_tokens > 0
    evicted = rag.prefill(Q, IDS, method="kvlink", link_tokens=4, evict=SnapKV(budget=5))
    rag.decode(evicted, max_new_tokens=1, evict=SnapKV(budget=5)).answer()
    seg = evicted.segments
    kept = evicted.output.cache.layers[0].keys.shape[2]
    assert kept == len(seg.prefix) + 5 + len(seg.link_positions()) + len(seg.question)
    assert st.link_positions().tolist() == seg.link_positions()


def test_method_parameters_and_errors():
    rag = make_rag()
    with pytest.raises(ValueError, match="selection rule"):
        get_method("kvlink+full")
    with pytest.raises(ValueError, match="link_tokens"):
        get_method("kvlink", link_tokens=-1)
    with pytest.raises(TypeError, match="a3"):
        get_method("kvlink+a3", window=3)
    adapter = random_adapter(rag.lm, k=5, layout_identity=rag.layout.identity)
    linked = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    with pytest.raises(ValueError, match="trained with 5"):
        linked.prefill(Q, IDS, method="kvlink", link_tokens=2)
    assert linked.prefill(Q, IDS, method="kvlink", link_tokens=0).segments.links == 0
    # no adapter, K > 0: untrained (mean-embedding) links
    untrained = rag.prefill(Q, IDS, method="kvlink", link_tokens=2)
    assert untrained.segments.links == 2


# -- adapters -----------------------------------------------------------------------------------
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


def test_adapter_round_trip_is_exact(tmp_path):
    rag = make_rag()
    lm = rag.lm
    links = random_adapter(lm, layout_identity=rag.layout.identity)
    links.meta["data"] = [{"file": "nq10_dev.jsonl", "rows": "0:1200", "sha256": "ab" * 32}]
    lora, _ = lora_adapter(lm, rag.layout.identity)
    full = LinkAdapter(
        embeds=torch.randn(2, 1, 64, dtype=torch.float32),
        mode="full",
        weights={n: p.detach().clone() + 0.01 for n, p in lm.model.named_parameters()},
        meta=adapter_header(lm, 1, "full", rag.layout.identity),
    )
    for adapter in (links, lora, full):
        path = save_adapter(tmp_path / f"{adapter.mode}.safetensors", adapter)
        back = load_adapter(path, lm, rag.layout.identity)
        assert back.mode == adapter.mode and back.link_tokens == adapter.link_tokens
        assert torch.equal(back.embeds, adapter.embeds)
        assert back.lora.keys() == adapter.lora.keys() and all(torch.equal(back.lora[k], v) for k, v in adapter.lora.items())
        assert back.weights.keys() == adapter.weights.keys() and all(torch.equal(back.weights[k], v) for k, v in adapter.weights.items())
        header = read_adapter_header(path)
        for key in ("base_fingerprint", "base_identity", "link_tokens", "mode", "layout_version", "layout_identity", "data"):
            assert header[key] == back.meta[key]
        assert header["base_fingerprint"] == lm.fingerprint and header["layout_version"] == LAYOUT_VERSION
        assert back.weights_digest() == adapter.weights_digest()
    # an engine loading the links adapter from disk answers exactly as one given the object
    a = KVRag(lm, store=rag.store, link_adapter=tmp_path / "links.safetensors", check=False).prefill(Q, IDS, method="kvlink")
    b = KVRag(lm, store=rag.store, link_adapter=links, check=False).prefill(Q, IDS, method="kvlink")
    assert torch.equal(a.logits, b.logits)
    assert (tmp_path / "links.safetensors").stat().st_size < 10e6
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "links.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # shareable, not mkstemp's 0600


def test_adapter_over_another_model_or_layout_is_a_clear_error(tmp_path):
    rag = make_rag(seed=0)
    path = save_adapter(tmp_path / "a.safetensors", random_adapter(rag.lm, layout_identity=rag.layout.identity))
    other = from_model(tiny_model("llama", seed=1), tiny_tokenizer())
    with pytest.raises(AdapterMismatchError, match="another base model"):
        load_adapter(path, other)
    with pytest.raises(AdapterMismatchError, match="another base model"):
        KVRag(other, store="memory://", link_adapter=path, check=False)
    with pytest.raises(AdapterMismatchError, match="prompt layout"):
        KVRag(rag.lm, store="memory://", link_adapter=path, check=False, system_prompt="You are terse.")
    old = load_adapter(path)
    old.meta["layout_version"] = "0"
    with pytest.raises(AdapterMismatchError, match="layout version"):
        KVRag(rag.lm, store="memory://", link_adapter=old, check=False)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(Exception):
        load_adapter(tmp_path / "junk.safetensors")
    # the same weights in another dtype are the same base model
    half = from_model(copy.deepcopy(rag.lm.model).to(torch.bfloat16), rag.lm.tokenizer)
    assert half.fingerprint != rag.lm.fingerprint
    assert load_adapter(path, half).link_tokens == 5


def test_lora_adapter_serves_a_merged_model_with_its_own_fingerprint_and_caches():
    rag = make_rag()
    base = rag.lm
    before = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    adapter, wrapped = lora_adapter(base, rag.layout.identity)
    merged = apply_adapter(base, adapter)
    ids = torch.tensor([base.tokenizer("hello world, links")["input_ids"]])
    with torch.no_grad():
        assert (merged.model(input_ids=ids).logits - wrapped(input_ids=ids).logits).abs().max() <= 1e-5
    assert merged.fingerprint != base.fingerprint
    assert all(torch.equal(before[n], p) for n, p in base.model.named_parameters())  # the caller's model is untouched
    tuned = KVRag(base, store=rag.store, link_adapter=adapter, check=False)  # same store as the base engine
    assert tuned.lm is base and tuned.adapter_lm.fingerprint == merged.fingerprint
    out = tuned.prefill(Q, IDS, method="kvlink")  # ids resolve through the base path, KV is the adapter's own
    assert out.stats.weights == "adapter" and out.stats.cache_hits == 0 and out.stats.cache_misses == 3
    assert tuned.prefill(Q, IDS, method="kvlink").stats.cache_hits == 3
    ref = _AdapterPath(merged, KVRag(base, store="memory://", link_adapter=None, check=False), adapter)  # merged weights, own store
    assert torch.allclose(ref.prefill(Q, chunks=CHUNKS, method="kvlink").logits, out.logits, atol=1e-5)
    again = tuned.prefill(Q, IDS, method="reuse")  # every other method: the base weights and their entries
    assert again.stats.weights == "base" and again.stats.cache_hits == 3
    full = tuned.prefill(Q, IDS, method="full")
    assert torch.equal(full.logits, rag.prefill(Q, IDS, method="full").logits)  # Full Attention is the base model's
    assert all(torch.equal(before[n], p) for n, p in base.model.named_parameters())


def test_full_attention_answers_as_the_base_weights_with_a_tuned_adapter_loaded():
    """Issue #34: with a weight-changing adapter, Full (and every method but kvlink) answers token for
    token as an engine with no adapter does; kvlink answers over the merged copy, which shares the
    untouched parameters with the base model."""
    rag = make_rag()
    adapter, _ = lora_adapter(rag.lm, rag.layout.identity)
    tuned = KVRag(rag.lm, store="memory://", link_adapter=adapter, check=False)
    plain = KVRag(rag.lm, store="memory://", link_adapter=None, check=False)
    for method in ("full", "reuse", "cacheblend"):
        a = tuned.answer(Q, chunks=CHUNKS, method=method, max_new_tokens=6, stop_at="none")
        b = plain.answer(Q, chunks=CHUNKS, method=method, max_new_tokens=6, stop_at="none")
        assert a.text == b.text and a.stats.weights == "base", method
    fast = tuned.answer(Q, chunks=CHUNKS, max_new_tokens=6, stop_at="none")  # the default: kvlink, adapter weights
    assert fast.stats.method == "kvlink" and fast.stats.weights == "adapter" and fast.stats.generated_tokens > 0
    shared = {id(p) for p in rag.lm.model.parameters()}
    merged = [n for n, p in tuned.adapter_lm.model.named_parameters() if id(p) not in shared]
    assert merged and all(n.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "k_proj", "o_proj") for n in merged), merged


def ship(monkeypatch, folder, source, **names):
    """Pretend the package ships these adapter files (kind -> file name in `folder`) for `source`."""
    import kvrag.fuse.links as links_mod

    monkeypatch.setattr(links_mod, "SHIPPED_DIR", folder)
    monkeypatch.setattr(links_mod, "SHIPPED_ADAPTERS", {source: names})


def test_shipped_adapter_is_the_default_where_there_is_one(tmp_path, monkeypatch):
    rag = make_rag()
    assert rag.link_adapter is None and rag.default_method == "cacheblend"  # link_adapter=None
    auto = KVRag(rag.lm, store=rag.store, check=False)
    assert auto.link_adapter is None  # "auto" and no adapter shipped for this model
    save_adapter(tmp_path / "tiny.kvlink.safetensors", random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity))
    ship(monkeypatch, tmp_path, rag.lm.source, links="tiny.kvlink.safetensors", tuned="absent.safetensors")
    auto = KVRag(rag.lm, store=rag.store, check=False)
    assert auto.prefill(Q, IDS, method="kvlink").segments.links == 2
    assert auto.lm is rag.lm and auto.default_method == "cacheblend"  # links only: the base weights, the base default
    terse = KVRag(rag.lm, store=rag.store, check=False, system_prompt="You are terse.")  # layout mismatch: untrained
    assert terse.link_adapter is None and terse.prefill(Q, chunks=CHUNKS, method="kvlink").segments.links == 0


def test_shipped_tuned_adapter_serves_kvlink_only_when_asked_for(tmp_path, monkeypatch):
    rag = make_rag()
    tuned, _ = lora_adapter(rag.lm, rag.layout.identity)
    save_adapter(tmp_path / "tuned.safetensors", tuned)
    save_adapter(tmp_path / "links.safetensors", random_adapter(rag.lm, k=3, layout_identity=rag.layout.identity))
    ship(monkeypatch, tmp_path, rag.lm.source, tuned="tuned.safetensors", links="links.safetensors")
    auto = KVRag(rag.lm, store="memory://", check=False)  # "auto": the links-only adapter, the base weights
    assert not auto.link_adapter.changes_model and auto.default_method == "cacheblend" and auto.adapter_lm is None
    opted = KVRag(rag.lm, store="memory://", check=False, link_adapter="tuned")  # the tuned one only when asked for
    assert opted.link_adapter.changes_model and opted.adapter_lm.fingerprint == apply_adapter(rag.lm, tuned).fingerprint
    assert opted.lm is rag.lm and opted.default_method == "kvlink"
    pre = opted.prefill(Q, chunks=CHUNKS)  # no method named: the engine's default
    assert pre.stats.method == "kvlink" and pre.segments.links == 2 and pre.stats.weights == "adapter"
    same = opted.prefill(Q, chunks=CHUNKS, options=AnswerOptions(recompute_ratio=0.5))  # options naming no method: the same
    assert same.stats.method == "kvlink" and torch.equal(same.logits, pre.logits)
    assert opted.prefill(Q, chunks=CHUNKS, method="reuse").stats.method == "reuse"  # a named method wins
    links = KVRag(rag.lm, store="memory://", check=False, link_adapter="links")  # the base weights, the links-only adapter
    assert links.lm is rag.lm and links.link_adapter.link_tokens == 3 and links.default_method == "cacheblend"
    base = KVRag(rag.lm, store="memory://", check=False, link_adapter=None)
    assert base.lm is rag.lm and base.link_adapter is None and base.prefill(Q, chunks=CHUNKS).stats.method == "cacheblend"
    named = KVRag(rag.lm, store="memory://", check=False, link_adapter="None")  # the command line's spelling, not a file
    assert named.lm is rag.lm and named.link_adapter is None and named.default_method == "cacheblend"
    terse = KVRag(rag.lm, store="memory://", check=False, system_prompt="You are terse.")  # neither fits this layout
    assert terse.lm is rag.lm and terse.link_adapter is None


def test_an_adapter_over_a_model_with_one_merged_in_is_refused_and_with_store_shares_the_prepared_model():
    rag = make_rag()
    adapter, _ = lora_adapter(rag.lm, rag.layout.identity)
    tuned = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    with pytest.raises(AdapterMismatchError, match="merged in already"):  # never merged twice
        KVRag(tuned.adapter_lm, store="memory://", link_adapter=adapter, check=False)
    other = tuned.with_store("memory://")
    assert other.lm is tuned.lm and other.adapter_lm is tuned.adapter_lm and other.link_adapter is adapter
    assert other.default_method == "kvlink"
    assert other.store is not tuned.store and other.layout is tuned.layout
    a = tuned.prefill(Q, chunks=CHUNKS)
    b = other.prefill(Q, chunks=CHUNKS)
    assert b.stats.cache_misses == 3 and torch.equal(a.logits, b.logits)


# -- training -----------------------------------------------------------------------------------
def test_min_chunks_varies_the_passage_count_and_keeps_the_gold_one():
    """`min_chunks` makes examples of 1..max passages, the gold one always among them; unset, an
    example is what it was before the option (same passages, same order: no extra draw)."""
    rag = make_rag()
    counts = set()
    for i, r in enumerate(rows(6)):
        for seed in range(12):
            ex = build_example(rag.layout, r, random.Random(f"{seed}:{i}"), 2, 4, 4096, min_chunks=1)
            counts.add(len(ex.chunks))
            gold_text = r["ctxs"][r["gold_index"]]["text"]
            assert ex.gold is not None and ex.chunks[ex.gold].text == gold_text
            assert len(ex.segments.chunks) == len(ex.chunks)
        before = build_example(rag.layout, r, random.Random(i), 2, 4, 4096)
        assert [c.text for c in before.chunks] == [c.text for c in build_example(rag.layout, r, random.Random(i), 2, 4, 4096, None).chunks]
        assert len(before.chunks) == 4
    assert counts == {1, 2, 3, 4}
    assert "min_chunks" not in TrainConfig(out="x").resume_key()  # runs from before the option resume
    assert TrainConfig(out="x", min_chunks=2).resume_key()["min_chunks"] == 2
    with pytest.raises(ValueError, match="min_chunks"):
        TrainConfig(out="x", max_chunks=4, min_chunks=5)


@pytest.mark.parametrize("mode", ["links", "lora", "full"])
def test_a_few_training_steps_lower_the_loss_on_a_fixed_batch(mode):
    if mode == "lora":
        pytest.importorskip("peft")
    rag = make_rag()
    cfg = TrainConfig(out="unused", mode=mode, link_tokens=2, max_chunks=4, lr=3e-3 if mode == "lora" else 5e-4, link_lr=5e-2)
    examples = [build_example(rag.layout, r, random.Random(i), 2, 4, 4096) for i, r in enumerate(rows(2))]
    model = rag.lm.model if mode == "links" else copy.deepcopy(rag.lm.model)
    model, named = prepare_model(model, cfg)
    links = torch.nn.Parameter(default_link_embeds(model, 2, 4))
    opt = torch.optim.AdamW([{"params": [links], "lr": cfg.link_lr}] + ([{"params": [p for _, p in named], "lr": cfg.lr}] if named else []))
    rotary = Rotary(model.get_base_model() if hasattr(model, "get_base_model") else model)
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = example_loss(model, examples, links, 4, rag=rag if mode == "links" else None, rotary=rotary)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(b <= a + 1e-6 for a, b in zip(losses, losses[1:])), losses
    # a random tiny model barely listens to a handful of link tokens: links alone move its loss a little
    assert losses[-1] < losses[0] - (5e-3 if mode == "links" else 0.05), losses
    if mode == "links":
        assert all(not p.requires_grad for p in rag.lm.model.parameters())
    else:
        assert named and all(p.grad is not None for _, p in named)


def test_a_padded_batch_gives_each_example_its_own_loss():
    rag = make_rag("qwen3")
    examples = [build_example(rag.layout, r, random.Random(i), 2, 4, 4096) for i, r in enumerate(rows(3))]
    assert len({e.segments.total_len for e in examples}) > 1
    links = default_link_embeds(rag.lm.model, 2, 4) + 0.1 * torch.randn(4, 2, 64)
    with torch.no_grad():
        for kw in ({"rag": rag}, {"rotary": rag.rotary}):
            batched = example_loss(rag.lm.model, examples, links, 4, **kw)
            one_by_one = [example_loss(rag.lm.model, [e], links, 4, **kw) for e in examples]
            weights = torch.tensor([len(e.answer) for e in examples], dtype=torch.float32)
            expected = (torch.stack(one_by_one) * weights).sum() / weights.sum()  # the mean over answer tokens
            assert (batched - expected).abs().item() <= 1e-5


def test_training_run_checkpoints_and_resumes_exactly(tmp_path, monkeypatch):
    import kvrag.training.loop as train_mod

    rag = make_rag()
    data = rows(6)
    base = dict(mode="links", link_tokens=2, max_chunks=4, batch_size=2, grad_accum=2, max_steps=4, save_every=2, progress=False, store="memory://", warmup=1)
    straight = train(TrainConfig(out=str(tmp_path / "a"), **base), lm=rag.lm, rows=data)
    assert straight.steps == 4 and len(straight.losses) == 4
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0
    assert (tmp_path / "a" / "checkpoint" / "optimizer.safetensors").exists()
    header = read_adapter_header(straight.adapter_path)
    assert header["mode"] == "links" and header["link_tokens"] == 2 and header["training"]["steps"] == 4
    assert header["data"] and header["base_fingerprint"] == rag.lm.fingerprint
    # interrupted during step 3 (after the step-2 checkpoint), then resumed: the same adapter, bit for bit
    real, calls = train_mod.example_loss, {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2 * 2 + 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_mod, "example_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "b"), **base), lm=rag.lm, rows=data)
    assert json.loads((tmp_path / "b" / "checkpoint" / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(train_mod, "example_loss", real)
    resumed = train(TrainConfig(out=str(tmp_path / "b"), resume=True, **base), lm=rag.lm, rows=data)
    assert resumed.losses == straight.losses
    assert torch.equal(resumed.adapter.embeds, straight.adapter.embeds)
    with pytest.raises(ValueError, match="other settings"):
        train(TrainConfig(out=str(tmp_path / "b"), resume=True, **{**base, "seed": 1}), lm=rag.lm, rows=data)
    # the trained adapter is what kvlink uses
    tuned = KVRag(rag.lm, store=rag.store, link_adapter=straight.adapter_path, check=False)
    assert tuned.prefill(Q, IDS, method="kvlink").segments.links == 2


def test_lora_training_run_writes_a_loadable_adapter(tmp_path):
    pytest.importorskip("peft")
    rag = make_rag()
    res = train(
        TrainConfig(out=str(tmp_path), mode="lora", link_tokens=1, max_chunks=4, max_steps=2, grad_accum=1, lora_r=2, progress=False),
        lm=rag.lm,
        rows=rows(2),
    )
    adapter = load_adapter(res.adapter_path, rag.lm, rag.layout.identity)
    assert adapter.mode == "lora" and adapter.lora and adapter.meta["lora"]["r"] == 2
    tuned = KVRag(rag.lm, store="memory://", link_adapter=res.adapter_path, check=False)
    assert tuned.adapter_lm.fingerprint != rag.lm.fingerprint and tuned.lm is rag.lm
    assert tuned.answer(Q, chunks=CHUNKS, method="kvlink", max_new_tokens=2).stats.generated_tokens > 0


def test_data_rows_shuffle_the_gold_passage_and_keep_provenance(tmp_path):
    rag = make_rag()
    row = rows(1)[0]
    gold_text = row["ctxs"][row["gold_index"]]["text"]
    golds = set()
    for seed in range(12):
        ex = build_example(rag.layout, row, random.Random(seed), 1, 10, 4096)
        assert ex.chunks[ex.gold].text == gold_text
        assert ex.segments.links == 1 and len(ex.segments.chunks) == 4
        golds.add(ex.gold)
    assert len(golds) >= 3  # the gold passage moves around
    capped = build_example(rag.layout, row, random.Random(0), 1, 2, 4096)
    assert len(capped.chunks) == 2 and capped.chunks[capped.gold].text == gold_text
    path = tmp_path / "nq10_dev.jsonl"
    path.write_text("".join(json.dumps({**r, "id": str(i)}) + "\n" for i, r in enumerate(rows(1) * 1300)))
    picked, prov = load_rows([str(path)], "0:1200")
    assert len(picked) == 1200 and prov[0]["rows"] == "0:1200" and len(prov[0]["sha256"]) == 64 and prov[0]["sources"] == ["synthetic"]
    with pytest.raises(ValueError, match="evaluation split"):
        load_rows([str(path)], "1100:1300")
    with pytest.raises(ValueError, match="evaluation split"):
        load_rows([f"{path}@1200:"], "0:1200")


def test_train_links_command(tmp_path):
    pytest.importorskip("peft")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows(4)))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_train_links_parser(sub)
    args = parser.parse_args(["train-links", "--data", str(data), "--out", str(tmp_path / "run"), "--mode", "lora"])
    assert args.mode == "lora" and args.link_tokens == 5 and args.func.__name__ == "cmd_train_links"
    rc = main(
        ["--data", f"{data}@0:4", "--out", str(tmp_path / "run"), "--model", str(tmp_path / "model"), "--link-tokens", "1",
         "--max-chunks", "4", "--max-steps", "2", "--grad-accum", "1", "--store", "memory://", "--no-progress", "--device", "cpu"]
    )
    assert rc == 0
    header = read_adapter_header(tmp_path / "run" / "adapter.safetensors")
    assert header["data"][0]["rows"] == "0:4" and header["training"]["steps"] == 2
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "train_summary.json").exists()
