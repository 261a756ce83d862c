"""Selection methods on the one shared recompute path: exactness at the ends, sizes, and behaviour."""

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.methods import METHODS, get_method, token_budget
from kvrag.methods.base import SelectContext
from kvrag.fuse.probe import probe
from tiny import ARCHS, tiny_model, tiny_tokenizer

SELECTIVE = ["cacheblend", "epic", "a3", "fusionrag"]
CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon long."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below the crust.", title="Geology"),
    Chunk("c", "Stock markets rose today after the central bank spoke."),
]
IDS = [c.id for c in CHUNKS]
Q = "What did the cat do on the mat?"


@pytest.fixture(scope="module", params=ARCHS)
def rag(request):
    r = KVRag(from_model(tiny_model(request.param), tiny_tokenizer()), store="memory://")
    r.precompute(CHUNKS, progress=False)
    return r


def test_all_papers_methods_are_registered():
    assert {"full", "reuse", *SELECTIVE} <= set(METHODS)


@pytest.mark.parametrize("method", SELECTIVE)
def test_ratio_one_is_full_attention_and_ratio_zero_is_reuse(rag, method):
    full = rag.prefill(Q, IDS, method="full")
    reuse = rag.prefill(Q, IDS, method="reuse")
    all_ = rag.prefill(Q, IDS, method=method, recompute_ratio=1.0)
    none = rag.prefill(Q, IDS, method=method, recompute_ratio=0.0)
    assert (all_.logits - full.logits).abs().max().item() <= 1e-4
    assert torch.equal(none.logits, reuse.logits)
    assert none.stats.recomputed_tokens == 0


@pytest.mark.parametrize("method", SELECTIVE)
@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3, 0.5])
def test_selection_has_the_requested_size_and_lies_inside_chunks(rag, method, ratio):
    pre = rag.prefill(Q, IDS, method=method, recompute_ratio=ratio)
    seg = pre.segments
    n_ctx = seg.context_len - len(seg.prefix)
    sel = pre.selected
    assert sel.numel() == token_budget(ratio, n_ctx) == pre.stats.recomputed_tokens
    assert sel.unique().numel() == sel.numel()
    assert int(sel.min()) >= len(seg.prefix) and int(sel.max()) < seg.context_len  # never prefix or question


def test_partial_recompute_sits_between_reuse_and_full(rag):
    full = rag.prefill(Q, IDS, method="full").logits
    reuse = rag.prefill(Q, IDS, method="reuse").logits
    half = rag.prefill(Q, IDS, method="epic", recompute_ratio=0.5).logits
    assert (half - full).abs().max() < (reuse - full).abs().max()


def test_epic_picks_the_head_of_every_chunk(rag):
    """...of every chunk but the first, whose KV (computed right after the prefix) is already exact."""
    pre = rag.prefill(Q, IDS, method="epic", recompute_ratio=0.15)
    seg, sel = pre.segments, set(pre.selected.tolist())
    per_chunk = len(sel) // (len(seg.chunks) - 1)
    assert not any(p in sel for p in range(seg.chunk_starts[0], seg.chunk_starts[0] + len(seg.chunks[0])))
    for start, chunk in zip(seg.chunk_starts[1:], seg.chunks[1:]):
        assert set(range(start, start + per_chunk)) <= sel  # the first tokens of each chunk
        assert not any(p in sel for p in range(start + per_chunk + 1, start + len(chunk)))


def test_question_guided_rules_follow_the_question_and_the_others_do_not(rag):
    other_q = "Which markets rose after the bank's statement today?"
    for method, follows in [("a3", True), ("fusionrag", True), ("epic", False), ("cacheblend", False)]:
        s1 = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15).selected
        s2 = rag.prefill(other_q, IDS, method=method, recompute_ratio=0.15).selected
        assert (not torch.equal(s1, s2)) == follows, method


def test_probe_leaves_the_stitched_cache_untouched(rag):
    pre = rag.prefill(Q, IDS, method="reuse")
    keys, values = pre.stitched.keys.clone(), pre.stitched.values.clone()
    result = probe(rag.lm, rag.rotary, pre.stitched, [0, 1], recompute=pre.stitched.chunk_positions())
    assert torch.equal(pre.stitched.keys, keys) and torch.equal(pre.stitched.values, values)
    assert set(result.queries) == {0, 1} and result.keys[1].shape[1] == pre.segments.total_len
    # a recompute probe at layer 0 reproduces Full Attention's layer-0 KV exactly (it depends on tokens only)
    full = rag.prefill(Q, IDS, method="full").output.cache.layers[0]
    assert (result.keys[0] - full.keys[0]).abs().max() <= 1e-5


def test_a_keys_values_probe_stops_before_attending_and_gives_the_same_keys_and_values(rag, monkeypatch):
    """CacheBlend's probe wants only layer 1's keys and values: it stops before that layer attends, and
    they are the very tensors the full layer would have written (every architecture: k_norm, biases, GQA)."""
    pre = rag.prefill(Q, IDS, method="reuse")
    over = pre.stitched.chunk_positions()
    whole = probe(rag.lm, rag.rotary, pre.stitched, [1], recompute=over)
    attended = []
    monkeypatch.setattr(rag.lm.model.model.layers[1].self_attn, "forward", lambda *a, **k: attended.append(1))
    short = probe(rag.lm, rag.rotary, pre.stitched, [1], recompute=over, queries=False)
    assert not attended and not short.queries
    assert torch.equal(short.keys[1], whole.keys[1]) and torch.equal(short.values[1], whole.values[1])


def test_method_parameters(rag):
    key = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.2, deviation="key")
    value = rag.prefill(Q, IDS, method="cacheblend", recompute_ratio=0.2)
    assert key.selected.numel() == value.selected.numel()
    deep = rag.prefill(Q, IDS, method="a3", recompute_ratio=0.2, layer=2)
    assert deep.selected.numel() == value.selected.numel()
    with pytest.raises(TypeError, match="a3"):
        get_method("a3", window=3)
    with pytest.raises(ValueError, match="out of range"):
        rag.prefill(Q, IDS, method="a3", layer=99)
    with pytest.raises(ValueError, match="deviation"):
        get_method("cacheblend", deviation="both")


@pytest.mark.parametrize("method", ["fusionrag", "a3"])
def test_whole_chunks_makes_the_named_then_most_attended_chunks_exact(rag, method):
    """`whole_chunks=N`: the top tokens as before, plus every token of the N chunks the question names,
    then attends to most; the first chunk (which this question names) is exact already, so it takes
    a place in the N but is not recomputed."""
    plain = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, whole_chunks=0)
    one = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, whole_chunks=1)
    two = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, whole_chunks=2)
    three = rag.prefill(Q, IDS, method=method, recompute_ratio=0.15, whole_chunks=3)
    seg = two.segments
    spans = [set(range(start, start + len(chunk))) for start, chunk in zip(seg.chunk_starts, seg.chunks)]
    base = set(plain.selected.tolist())
    assert set(one.selected.tolist()) == base  # the named chunk is the exact first one
    picked = set(two.selected.tolist())
    whole = [i for i, span in enumerate(spans) if span <= picked]
    assert base <= picked and len(whole) == 1 and whole[0] != 0  # one later chunk, whole
    assert picked == base | spans[whole[0]] and two.stats.recomputed_tokens == len(picked)
    assert set(three.selected.tolist()) == base | spans[1] | spans[2]  # both chunks after the exact first
    assert not spans[0] & set(three.selected.tolist())
    assert [p.stats.whole_chunks for p in (plain, one, two, three)] == [0, 0, 1, 2]
    for bad in (-1, "all", 1.5, True):
        with pytest.raises(ValueError, match="whole_chunks"):
            get_method(method, whole_chunks=bad)


RECORDS = [
    Chunk(f"r{i}", f"The {name} lamp weighs {kg} kilograms. The {name} lamp was made in {year}. "
          f"The {name} lamp is kept in the town of {town}. The colour of the {name} lamp is {colour}.")
    for i, (name, kg, year, town, colour) in enumerate([
        ("Nororssa", 169, 1893, "Keloen", "red"), ("Wenardra", 235, 1755, "Braar", "blue"),
        ("Faloven", 88, 1601, "Iskan", "green"), ("Marorsk", 307, 1537, "Eldel", "black"),
    ])
]


@pytest.mark.parametrize("method", ["fusionrag", "a3"])
def test_the_whole_chunk_is_the_record_the_question_names(rag, method):
    """Among records of one kind the chunk recomputed whole is the one asked about, wherever it sits."""
    rag.precompute(RECORDS, progress=False)
    ids = [c.id for c in RECORDS]
    for i, name in [(1, "Wenardra"), (2, "Faloven"), (3, "Marorsk")]:
        pre = rag.prefill(f"How much does the {name} lamp weigh?", ids, method=method, recompute_ratio=0.15,
                          short_context=0, min_recompute=0, whole_chunks=1)
        seg, picked = pre.segments, set(pre.selected.tolist())
        whole = [j for j, (s, c) in enumerate(zip(seg.chunk_starts, seg.chunks)) if set(range(s, s + len(c))) <= picked]
        assert whole == [i], (name, whole)




def test_similarity_guided_entries_are_their_own_kind(rag):
    report = rag.precompute(CHUNKS, kind="similarity", neighbours={"a": ["b"], "b": ["a", "c"], "c": []}, progress=False)
    assert report.computed == 3
    sim = rag.prefill(Q, IDS, method="reuse", kv_kind="similarity")
    plain = rag.prefill(Q, IDS, method="reuse")
    assert sim.stats.cache_hits == 3 and sim.stats.chunk_prefill_tokens == 0 and sim.stats.path == "similarity"
    assert not torch.equal(sim.logits, plain.logits)
    # a chunk with no neighbours computes exactly its plain KV
    c0, c1 = sim.stitched.chunk_spans[2]
    assert (sim.stitched.keys[:, :, c0:c1] - plain.stitched.keys[:, :, c0:c1]).abs().max() <= 1e-5
    a0, a1 = sim.stitched.chunk_spans[0]
    assert (sim.stitched.values[:, :, a0:a1] - plain.stitched.values[:, :, a0:a1]).abs().max() > 1e-4
    same = {"a": ["b"], "b": ["a", "c"], "c": []}
    assert rag.precompute(CHUNKS, kind="similarity", neighbours=same, progress=False).already_cached == 3
    # another neighbour set (here: embedding similarity) is another entry, never the stale one (#18)
    assert rag.precompute(CHUNKS, kind="similarity", progress=False).already_cached < 3


def test_similarity_kind_falls_back_to_plain_entries():
    r = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://")
    r.precompute(CHUNKS, progress=False)  # plain only
    out = r.prefill(Q, IDS, method="reuse", kv_kind="similarity")
    assert out.stats.cache_hits == 3 and out.stats.chunk_prefill_tokens == 0


def test_probe_attention_equals_the_models_own_attention_weights():
    """The probe's softmax attention is what the eager attention computes inside the model."""
    from kvrag.model.cache import SpliceCache
    from kvrag.model.masks import causal_mask_by_position
    from kvrag.model.cache import unstack_layers
    from kvrag.fuse.probe import attention_probs

    for arch in ("llama", "qwen3"):
        r = KVRag(from_model(tiny_model(arch, attn="eager"), tiny_tokenizer()), store="memory://")
        r.precompute(CHUNKS, progress=False)
        st = r.prefill(Q, IDS, method="reuse").stitched
        seg = st.segments
        result = probe(r.lm, r.rotary, st, [1, 2])
        pos = torch.arange(seg.context_len, seg.total_len)
        cache = SpliceCache(unstack_layers(st.keys.clone(), st.values.clone()))
        out = r.lm.model(
            input_ids=torch.tensor(seg.all_ids())[pos][None],
            position_ids=pos[None],
            attention_mask=causal_mask_by_position(pos, seg.total_len, torch.float32),
            past_key_values=cache,
            output_attentions=True,
        )
        for layer in (1, 2):
            assert (out.attentions[layer][0] - attention_probs(result, layer)).abs().max() <= 1e-5
