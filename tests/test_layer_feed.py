"""Layer-wise loading (kvrag.fuse.layer_feed) on the CPU: the same results as loading everything first,
each layer filled when a pass first needs it (and no earlier), probes filling only what they reach."""

import pytest
import torch

from kvrag import KVRag, from_model
from kvrag.fuse.stitch import stitch
from kvrag.fuse.layer_feed import LayerFeed
from kvrag.methods import METHODS, get_method
from kvrag.methods.cacheblend import CacheBlend
from kvrag.model.loading import decoder_of
from kvrag.pipeline import RequestPipeline
from kvrag.fuse.probe import probe
from kvrag.types import AnswerStats
from test_gpu_readiness import CHUNKS as SYNC_CHUNKS, Q as SYNC_Q, count_syncs
from tiny import THREE_CHUNKS, THREE_IDS, THREE_Q, tiny_model, tiny_tokenizer

LAYERS = 4
# every registered method at r = 0.15, and the variants with their own paths (KVLink link slots, SamKV's fusion)
CASES = {name: (name, {}) for name in sorted(METHODS)}
CASES.update({
    "kvlink": ("kvlink", {"link_tokens": 3}),
    "kvlink+a3": ("kvlink+a3", {"link_tokens": 2}),
    "kvlink+samkv": ("kvlink+samkv", {"link_tokens": 2}),
    "kvlink+cacheblend": ("kvlink+cacheblend", {"link_tokens": 2}),
    "samkv:fusion": ("samkv", {"update": "fusion"}),
    "cacheblend:gradual": ("cacheblend", {"gradual": True}),
    "a3:layer2": ("a3", {"layer": 2}),
})
# the layers each rule's selection fills before the recompute pass (the rest load during the pass)
FILLED_BY_SELECTION = {
    "reuse": [], "epic": [], "kvlink": [], "full": None,
    "a3": [0, 1], "a3:layer2": [0, 1, 2], "kvlink+a3": [0, 1],
    "cacheblend": [0, 1], "kvlink+cacheblend": [0, 1], "cacheblend:gradual": [0, 1, 2],
    "fusionrag": [0, 1, 2, 3], "samkv": [0, 1, 2, 3], "samkv:fusion": [0, 1, 2, 3], "kvlink+samkv": [0, 1, 2, 3],
}


def make_rag(dtype=torch.float32, store="memory://", layers=LAYERS, chunks=THREE_CHUNKS):
    rag = KVRag(from_model(tiny_model("llama", layers=layers).to(dtype=dtype), tiny_tokenizer()), store=store, check=False)
    rag.precompute(chunks, progress=False)
    return rag


@pytest.fixture(scope="module")
def rag():
    return make_rag()


def both(rag, fn):
    """fn() loading everything first, then layer by layer."""
    out = []
    for layerwise in (False, True):
        rag.repo.layerwise = layerwise
        try:
            out.append(fn())
        finally:
            rag.repo.layerwise = None
    return out


def test_default_is_off_on_the_cpu(rag):
    assert rag.repo.layerwise is None and not rag.repo.layerwise_load
    assert not rag.prefill(THREE_Q, THREE_IDS, method="reuse").stats.layerwise


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_logits_and_answer_as_loading_everything_first(rag, case):
    method, params = CASES[case]
    eager, lw = both(rag, lambda: rag.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.15, **params))
    assert torch.equal(eager.logits, lw.logits)
    assert torch.equal(eager.selected, lw.selected)
    if eager.stitched is not None:  # what decoding reads: every layer filled, the feed gone
        assert lw.stitched.feed is None
        assert torch.equal(eager.stitched.keys, lw.stitched.keys) and torch.equal(eager.stitched.values, lw.stitched.values)
        assert lw.stats.layerwise and lw.stats.layer_load_s > 0 and lw.stats.load_wait_s == lw.stats.layer_load_s
    texts = both(rag, lambda: rag.answer(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.15, max_new_tokens=8, stop_at="none", **params))
    assert texts[0].text == texts[1].text and texts[0].stats.generated_tokens == texts[1].stats.generated_tokens


def test_bf16_int8_entries_from_disk(tmp_path):
    """Entries of another dtype (int8 on disk, dequantised) are cast in the per-layer copy, as `_to_device` casts them."""
    r = make_rag(torch.bfloat16, store=f"disk://{tmp_path}?quantize=int8")
    for method in ("reuse", "cacheblend", "samkv"):
        eager, lw = both(r, lambda: r.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.15))
        assert torch.equal(eager.logits, lw.logits)


@pytest.mark.parametrize("links", [0, 3])
def test_layerwise_stitch_fills_exactly_the_eager_stitch(rag, links):
    segments = rag.layout.segments([rag.layout.chunk_ids(c) for c in THREE_CHUNKS], THREE_Q, links=links)
    stacks = rag.repo.load_chunks(rag.repo.resolve(THREE_CHUNKS), AnswerStats())
    host = rag.repo.load_chunks(rag.repo.resolve(THREE_CHUNKS), AnswerStats(), to_device=False)
    eager = stitch(rag.repo.prefix_kv(), stacks, segments, rag.rotary, reserve=5)
    lw = stitch(rag.repo.prefix_kv(), host, segments, rag.rotary, reserve=5, layerwise=True)
    assert lw.feed.issued == [False] * LAYERS
    lw.ensure([2])
    assert lw.feed.issued == [False, False, True, False]  # on the CPU: that layer, no other
    assert torch.equal(lw.keys[2], eager.keys[2]) and torch.equal(lw.values[2], eager.values[2])
    lw.ensure_all()
    assert lw.feed.order == [2, 0, 1, 3] and lw.feed.complete
    assert torch.equal(lw.keys, eager.keys) and torch.equal(lw.values, eager.values)


def test_a_probe_fills_only_the_layers_it_reaches(rag):
    segments = rag.layout.segments([rag.layout.chunk_ids(c) for c in THREE_CHUNKS], THREE_Q)
    host = rag.repo.load_chunks(rag.repo.resolve(THREE_CHUNKS), AnswerStats(), to_device=False)
    lw = stitch(rag.repo.prefix_kv(), host, segments, rag.rotary, layerwise=True)
    probe(rag.lm, rag.rotary, lw, [1], recompute=torch.tensor(segments.chunk_starts))
    assert lw.feed.issued == [True, True, False, False]


def test_keep_fills_every_layer_first(rag):
    segments = rag.layout.segments([rag.layout.chunk_ids(c) for c in THREE_CHUNKS], THREE_Q)
    host = rag.repo.load_chunks(rag.repo.resolve(THREE_CHUNKS), AnswerStats(), to_device=False)
    stacks = rag.repo.load_chunks(rag.repo.resolve(THREE_CHUNKS), AnswerStats())
    keep = torch.arange(segments.chunk_starts[1], segments.chunk_starts[1] + 5)
    lw = stitch(rag.repo.prefix_kv(), host, segments, rag.rotary, layerwise=True).keep(keep)
    eager = stitch(rag.repo.prefix_kv(), stacks, segments, rag.rotary).keep(keep)
    assert lw.feed is None and torch.equal(lw.keys, eager.keys) and torch.equal(lw.values, eager.values)


def record_order(rag, monkeypatch, fn):
    """Run fn() layer-wise, recording layer starts, ensure calls, fills and attention ends in order,
    and the layers filled when the selection step returns."""
    events, after_select = [], {}
    layers = decoder_of(rag.lm.model).layers
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("layer", i))))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: events.append(("attn", i))))
    issue, ensure, select = LayerFeed._issue, LayerFeed.ensure, RequestPipeline._select
    monkeypatch.setattr(LayerFeed, "_issue", lambda self, i: (events.append(("fill", i)), issue(self, i))[1])
    monkeypatch.setattr(LayerFeed, "ensure", lambda self, i: (events.append(("ensure", i)), ensure(self, i))[1])

    def selecting(self, meth, stitched, *args):
        out = select(self, meth, stitched, *args)
        after_select["filled"] = [i for i, done in enumerate(stitched.feed.issued) if done] if stitched.feed else None
        events.append(("selected", -1))
        return out

    monkeypatch.setattr(RequestPipeline, "_select", selecting)
    rag.repo.layerwise = True
    try:
        fn()
    finally:
        rag.repo.layerwise = None
        for h in hooks:
            h.remove()
    return events, after_select.get("filled")


@pytest.mark.parametrize("case", sorted(FILLED_BY_SELECTION))
def test_each_layer_is_filled_before_its_attention_and_no_earlier_than_needed(rag, monkeypatch, case):
    method, params = CASES[case]
    events, filled = record_order(rag, monkeypatch, lambda: rag.prefill(THREE_Q, THREE_IDS, method=method, recompute_ratio=0.15, **params))
    assert filled == FILLED_BY_SELECTION[case]  # probes fill only the layers they reach
    fills = [e for e in events if e[0] == "fill"]
    if method == "full":
        assert not fills
        return
    assert sorted(i for _, i in fills) == list(range(LAYERS))  # each layer once
    for n, (kind, i) in enumerate(events):
        if kind == "attn":  # every attention, in a probe or the pass, runs over a filled layer
            assert ("fill", i) in events[:n], (case, i, events)
    recompute = events[events.index(("selected", -1)) :]
    for i in range(LAYERS):
        if i in filled:
            continue
        # loaded in the pass, on demand: after the pass reached the layer, before its attention ended
        at = recompute.index(("fill", i))
        assert recompute[at - 1] == ("ensure", i)
        assert recompute.index(("layer", i)) < at < recompute.index(("attn", i))
        assert all(("fill", j) not in recompute[:at] for j in range(i + 1, LAYERS))


def test_decoding_after_a_layerwise_prefill_sees_every_layer(rag):
    eager, lw = both(rag, lambda: rag.prefill(THREE_Q, THREE_IDS, method="epic", recompute_ratio=0.15))
    for (ek, ev), layer in zip([(l.keys, l.values) for l in eager.output.cache.layers], lw.output.cache.layers):
        assert layer.ready is None  # the pass consumed every layer's hook
        assert torch.equal(ek, layer.keys) and torch.equal(ev, layer.values)


def test_which_rules_read_only_probed_layers():
    safe = {"reuse", "epic", "cacheblend", "a3", "fusionrag", "kvlink"}
    for name in METHODS:
        assert get_method(name).probed_layers_only == (name in safe), name
    assert get_method("kvlink+cacheblend").probed_layers_only and not get_method("kvlink+samkv").probed_layers_only

    class Deeper(CacheBlend):  # a subclass may read more than its parent: every layer first
        pass

    assert not Deeper().probed_layers_only


def test_a_failed_prefill_closes_its_feed(rag, monkeypatch):
    feeds = []
    init = LayerFeed.__init__
    monkeypatch.setattr(LayerFeed, "__init__", lambda self, *a, **k: (feeds.append(self), init(self, *a, **k))[1])

    class Broken(CacheBlend):
        name = "broken"

        def select(self, ctx, budget):
            raise RuntimeError("boom")

    rag.repo.layerwise = True
    try:
        with pytest.raises(RuntimeError, match="boom"):
            rag.prefill(THREE_Q, THREE_IDS, method=Broken())
    finally:
        rag.repo.layerwise = None
    assert feeds[0].complete  # a rule not known to read only probed layers gets every layer first
    with pytest.raises(RuntimeError, match="closed"):
        feeds[0]._issue(0)


@pytest.mark.parametrize("method", ["reuse", "a3", "cacheblend", "samkv", "kvlink"])
def test_layerwise_host_syncs_do_not_grow_with_the_layer_count(method):
    """The per-layer path (fills, ensures, the cache hook) adds no host sync (issue #20)."""

    def syncs(layers):
        r = make_rag(layers=layers, chunks=SYNC_CHUNKS)
        r.repo.layerwise = True
        params = {"link_tokens": 2} if method == "kvlink" else {}
        r.prefill(SYNC_Q, ["a", "b", "c"], method=method, **params)  # warm
        with count_syncs() as counts:
            pre = r.prefill(SYNC_Q, ["a", "b", "c"], method=method, **params)
        assert pre.stats.layerwise
        return counts["n"]

    assert syncs(4) == syncs(8)
