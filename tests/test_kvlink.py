"""KVLink on tiny random models: one picture for training and inference, and K=0 is reuse (adapters:
test_link_adapter.py; training: test_kvlink_training.py)."""


import pytest
import torch


from kvrag import KVRag
from kvrag.kv.layout import Segments
from kvrag.fuse.links import default_link_embeds, link_rows
from kvrag.methods import get_method, token_budget
from kvrag.train import (
    batch_logits,
    encode_context,
    load_context,
    pass_batch,
    training_mask,
)
from tiny import ARCHS
from kvlink_helpers import CHUNKS, IDS, Q, capture_masks, example_of, make_rag, random_adapter


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
