"""Mode trailers: link slots that see only the system prefix and their own chunk (KV Packet's trailer vectors
without its header), trained with the model frozen (tiny random models).

The picture is the one place that says who attends to whom, so training and serving agree by construction; these
tests hold it to that: the trailers of a chunk never read another chunk, the question reads them all, the served
first-token logits are the training pass's, and links-mode prompts are as they were."""

import math

import torch

from kvrag import Chunk, KVRag
from kvrag.defaults import BASE_CHUNK_MODES, link_scope
from kvrag.fuse.links import link_picture, owners
from kvrag.kv.layout import Links, Segments
from kvrag.link_adapter import load_adapter, read_adapter_header, save_adapter
from kvrag.training.config import TrainConfig
from kvrag.training.loop import train
from kvrag.training.passes import batch_logits, load_context, pass_batch
from kvlink_helpers import CHUNKS, IDS, Q, example_of, make_rag, random_adapter
from tiny import qa_rows

import pytest


def seg(scope):
    # prefix 2 | chunk 0: 3 tokens + 2 slots | chunk 1: 2 tokens + 2 slots | question 2
    return Segments([1, 2], [[3, 4, 5], [6, 7]], [8, 9], links=2, link_scope=scope)


def test_the_picture_keeps_each_chunks_trailers_to_their_own_chunk():
    s = seg("chunk")
    pos = torch.arange(s.total_len)
    allowed = link_picture(s, pos, pos)
    assert owners(s, pos).tolist() == [-1, -1, 0, 0, 0, 0, 0, 1, 1, 1, 1, -2, -2]
    t0, t1 = s.link_positions()[:2], s.link_positions()[2:]
    assert t0 == [5, 6] and t1 == [9, 10]
    for t in t1:  # chunk 1's trailers: the prefix, chunk 1, their earlier slots; nothing of chunk 0 or its trailers
        assert allowed[t, :2].all() and not allowed[t, 2:7].any() and allowed[t, 7:t + 1].all() and not allowed[t, t + 1:].any()
    for t in t0:
        assert allowed[t, :t + 1].all() and not allowed[t, t + 1:].any()
    for q in (11, 12):  # the question reads everything before it, every trailer included
        assert allowed[q, :q + 1].all()
    links = link_picture(seg("global"), pos, pos)  # KVLink's links: causal over everything, as before
    assert all(links[t, :t + 1].all() for t in t1)
    assert torch.equal(allowed[~torch.isin(pos, torch.tensor(t0 + t1))], links[~torch.isin(pos, torch.tensor(t0 + t1))])
    with pytest.raises(ValueError, match="link_scope"):
        Segments([1], [[2]], [3], links=1, link_scope="nearby")


def test_modes_say_their_scope():
    assert link_scope("trailers") == "chunk" and link_scope("links") == "global" and link_scope(None) == "global"
    assert "trailers" in BASE_CHUNK_MODES
    assert TrainConfig("o", mode="trailers", objective="distill", link_tokens=3).links == Links(3, "chunk")
    assert TrainConfig("o", mode="links", link_tokens=2).links == Links(2, "global")


def test_the_count_and_scope_reach_the_segments_together():
    rag = make_rag()
    ids = [rag.layout.chunk_ids(c) for c in CHUNKS[:2]]
    chunked = rag.layout.segments(ids, Q, Links(2, "chunk"))
    assert (chunked.links, chunked.link_scope) == (2, "chunk")
    assert rag.layout.segments(ids, Q, 2) == rag.layout.segments(ids, Q, Links(2, "global"))  # a bare count: global slots
    assert rag.layout.segments(ids, Q).links == 0
    for bad in (lambda: Links(1, "nearby"), lambda: Links(-1)):
        with pytest.raises(ValueError):
            bad()


def test_a_chunks_trailers_hold_what_their_chunk_gives_them_whatever_came_before():
    rag = make_rag()
    text = CHUNKS[0].text
    alt = Chunk(id="alt", text=("X" if text[0] != "X" else "Y") + text[1:])  # byte-level: the same length, another chunk
    rag.precompute([alt], progress=False)
    trailers = KVRag(rag.lm, store=rag.store, link_adapter=random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity,
                                                                          mode="trailers"), check=False)
    assert trailers.calibration_adapter is not None  # reads the base chunk KV: a calibration candidate
    a = trailers.prefill(Q, [IDS[0], IDS[1]], method="kvlink")
    b = trailers.prefill(Q, ["alt", IDS[1]], method="kvlink")
    assert a.segments.link_scope == "chunk" and a.stats.weights != "adapter"  # the base weights, no merged copy
    second = a.segments.link_positions()[2:]
    assert second == b.segments.link_positions()[2:]
    for la, lb in zip(a.output.cache.layers, b.output.cache.layers):  # chunk 1's trailers: the same whatever chunk 0 is
        assert torch.allclose(la.keys[:, :, second], lb.keys[:, :, second], atol=1e-5)
        assert torch.allclose(la.values[:, :, second], lb.values[:, :, second], atol=1e-5)
    assert (a.logits - b.logits).abs().max() > 1e-4  # the question reads chunk 0 all the same
    links = KVRag(rag.lm, store=rag.store, link_adapter=random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity), check=False)
    la, lb = (links.prefill(Q, ids, method="kvlink") for ids in ([IDS[0], IDS[1]], ["alt", IDS[1]]))
    assert la.segments.link_scope == "global"  # KVLink's links of chunk 1 read chunk 0: they differ
    assert not torch.allclose(la.output.cache.layers[-1].values[:, :, second], lb.output.cache.layers[-1].values[:, :, second], atol=1e-4)


def test_trailers_train_with_the_model_frozen_and_are_served_as_trained(tmp_path):
    rag = make_rag()
    before = {n: p.detach().clone() for n, p in rag.lm.model.named_parameters()}
    entries = len(rag.store)
    res = train(TrainConfig(out=str(tmp_path), mode="trailers", link_tokens=2, max_chunks=4, max_steps=2, grad_accum=1,
                            store="memory://", progress=False, objective="distill", teacher_tokens=3), lm=rag.lm, rows=qa_rows(2))
    assert all(math.isfinite(x) for x in res.losses)
    assert all(torch.equal(p, before[n]) for n, p in rag.lm.model.named_parameters())
    assert read_adapter_header(res.adapter_path)["mode"] == "trailers"
    adapter = load_adapter(res.adapter_path, rag.lm, rag.layout.identity)
    assert adapter.mode == "trailers" and not adapter.changes_model and adapter.reads_base_chunks
    again = load_adapter(save_adapter(tmp_path / "again.safetensors", adapter), rag.lm, rag.layout.identity)
    assert again.mode == "trailers" and torch.equal(again.embeds, adapter.embeds)
    served = KVRag(rag.lm, store=rag.store, link_adapter=adapter, check=False)
    pre = served.prefill(Q, IDS, method="kvlink")
    assert pre.stats.cache_misses == 0 and len(rag.store) == entries  # the base entries, nothing new stored
    ex = example_of(rag, pre)
    assert ex.segments.link_scope == "chunk"
    with torch.no_grad():
        ctx = load_context(rag, [ex])
        logits = batch_logits(rag.lm.model, ctx, pass_batch([ex], ctx, adapter.max_chunks, torch.float32), adapter.embeds)
    assert (logits[0] - pre.logits).abs().max().item() <= 1e-4
    # the same rows read as global links give another answer: the scope is what was trained
    as_links = KVRag(rag.lm, store=rag.store, link_adapter=random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity), check=False)
    assert as_links.prefill(Q, IDS, method="kvlink").segments.link_scope == "global"
