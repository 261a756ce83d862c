"""Issue #18: nothing that comes back from a store is trusted without proof (each test failed before the fix)."""

import logging

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.cache_backends import KVEntry, open_store
from kvrag.model.loading import model_fingerprint
from kvrag.options import KIND_CHUNK
from tiny import tiny_model, tiny_tokenizer

CHUNKS = [
    Chunk("a", "The cat sat on the mat and purred all afternoon long."),
    Chunk("b", "Volcanoes erupt lava, ash and gas from deep below the crust."),
    Chunk("c", "Stock markets rose today after the central bank spoke."),
]
Q = "What did the cat do?"


def _lm():
    return from_model(tiny_model("llama"), tiny_tokenizer())


def _engine(lm=None, store="memory://", **kw):
    rag = KVRag(lm or _lm(), store=store, **kw)
    rag.precompute(CHUNKS, progress=False)
    return rag


def _key(rag, chunk):
    return rag._resolve([chunk]).keys[0]


def _tamper(rag, chunk, fn):
    key = _key(rag, chunk)
    e = rag.store.get(key)
    rag.store.put(key, fn(e))
    return key


@pytest.mark.parametrize(
    "name,fn",
    [
        ("another chunk's entry", None),
        ("one kv head", lambda e: KVEntry(e.keys[:, :1].clone(), e.values[:, :1].clone(), dict(e.meta), e.token_ids)),
        ("NaN values", lambda e: KVEntry(e.keys.clone(), torch.full_like(e.values, float("nan")), dict(e.meta), e.token_ids)),
        ("wrong head size", lambda e: KVEntry(e.keys[..., :-2].clone(), e.values[..., :-2].clone(), dict(e.meta), e.token_ids)),
        ("integer tensors", lambda e: KVEntry(e.keys.to(torch.int32), e.values.to(torch.int32), dict(e.meta), e.token_ids)),
    ],
)
def test_a_bad_entry_under_a_good_key_is_a_miss_and_is_replaced(name, fn, caplog):
    rag = _engine()
    want = rag.answer(Q, ["a"], method="reuse", max_new_tokens=6)
    if fn is None:  # copy chunk b's entry (same meta, valid checksum) over chunk a's key
        other = rag.store.get(_key(rag, CHUNKS[1]))
        rag.store.put(_key(rag, CHUNKS[0]), other)
        key = _key(rag, CHUNKS[0])
    else:
        key = _tamper(rag, CHUNKS[0], fn)
    with caplog.at_level(logging.WARNING):
        got = rag.answer(Q, ["a"], method="reuse", max_new_tokens=6)
    assert got.stats.cache_hits == 0 and got.stats.cache_misses == 1, name
    assert got.text == want.text
    assert "ignoring" in caplog.text
    fixed = rag.store.get(key)
    assert fixed.token_ids.tolist() == rag.layout.chunk_ids(CHUNKS[0]) and torch.isfinite(fixed.values).all()
    assert rag.answer(Q, ["a"], method="reuse", max_new_tokens=6).stats.cache_hits == 1  # replaced


def test_an_int8_entry_is_never_read_by_an_exact_store(tmp_path):
    lm = _lm()
    _engine(lm, store=f"disk://{tmp_path}?quantize=int8")
    exact = KVRag(lm, store=f"disk://{tmp_path}")
    out = exact.prefill(Q, chunks=CHUNKS, method="reuse")
    assert out.stats.cache_hits == 0 and out.stats.cache_misses == 3


def test_a_changed_neighbour_set_recomputes_the_similarity_entry():
    rag = _engine()
    first = rag.precompute(CHUNKS, kind="similarity", neighbours={"a": ["b"], "b": ["a"], "c": ["a"]}, progress=False)
    again = rag.precompute(CHUNKS, kind="similarity", neighbours={"a": ["b"], "b": ["a"], "c": ["a"]}, progress=False)
    changed = rag.precompute(CHUNKS, kind="similarity", neighbours={"a": ["c"], "b": ["a"], "c": ["a"]}, progress=False)
    assert first.computed == 3 and again.already_cached == 3
    assert changed.computed == 1 and changed.already_cached == 2


def test_the_fingerprint_sees_every_weight():
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj.weight.view(-1)
        w[1:576:1] += 1e-3  # 575 weights, most of them between any fixed sample points
    assert model_fingerprint(model) != before


def test_the_chunk_id_index_is_namespaced_per_model_and_layout():
    lm = _lm()
    store = open_store("memory://")
    _engine(lm, store=store)
    _engine(lm, store=store, system_prompt="You answer in French.")  # same ids, another layout
    fresh = KVRag(lm, store=store)  # knows no ids itself: resolves them through the store's index
    out = fresh.prefill(Q, ["a", "b"], method="reuse")
    assert out.stats.cache_hits == 2


def test_precompute_relinks_ids_after_the_store_lost_its_index():
    lm = _lm()
    store = open_store("memory://")
    rag = _engine(lm, store=store)
    store._index.clear()  # what FLUSHALL / a restart / an allkeys-lru eviction does to a Redis index
    rag.precompute(CHUNKS, progress=False)  # all cached already: still re-links the ids
    assert KVRag(lm, store=store).prefill(Q, ["a"], method="reuse").stats.cache_hits == 1


def test_a_short_chunk_never_cuts_a_word_out_of_a_prompt():
    rag = _engine()
    rag.register([Chunk("tiny", "a")])
    chunks, rest = rag.match_prompt("What is the capital of France?")
    assert chunks == [] and rest == "What is the capital of France?"
    chunks, rest = rag.match_prompt(f"Context:\n{CHUNKS[1].text}\n\nWhat is inside?")
    assert [c.id for c in chunks] == ["b"] and rest == "What is inside?"


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"chunk_ids": "ab"}, TypeError),
        ({"chunk_ids": ["a"], "method": "full", "recompute_ratio": 7}, ValueError),
        ({"chunk_ids": ["a"], "temperature": float("nan")}, ValueError),
        ({"chunk_ids": ["a"], "max_new_tokens": 2.5}, ValueError),
        ({"chunks": [Chunk("empty", "")]}, ValueError),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, error):
    rag = _engine()
    with pytest.raises(error) as info:
        rag.answer(Q, **kwargs)
    assert "must" in str(info.value) or "no tokens" in str(info.value)


def test_the_finiteness_scan_runs_once_per_unmodified_tensor(monkeypatch):
    """A memory tier hands back the same tensors on every hit: scanned once (its sum's finiteness), again
    only after an in-place edit."""
    import kvrag.kv.entry_check as ec

    t = torch.randn(2, 3, 4)
    scans = []
    real = torch.isfinite
    monkeypatch.setattr(ec.torch, "isfinite", lambda x: scans.append(1) or real(x))
    assert ec.all_finite(t) and ec.all_finite(t) and len(scans) == 1
    t[0, 0, 0] = float("nan")  # an in-place write bumps the version: scanned again, and caught
    assert not ec.all_finite(t) and len(scans) > 1
    u = torch.randn(3)
    assert ec.all_finite(u)
    key = id(u)
    del u
    assert key not in ec._FINITE  # forgotten with the tensor


def test_a_scanned_tensor_dying_inside_a_scan_never_hangs():
    """A scanned tensor can die inside any allocation that starts a garbage collection, also one made while
    another tensor is being marked; forgetting it must never wait on anything the dying thread holds (it
    once waited on a lock that thread held, forever: the fault soak hung)."""
    import gc
    import threading

    import kvrag.kv.entry_check as ec

    def churn() -> None:
        for _ in range(3000):
            box: list = [torch.zeros(4)]
            box.append(box)  # only a collection frees it, at whatever allocation starts one
            ec.all_finite(box[0])
            del box

    before = gc.get_threshold()
    gc.set_threshold(1)
    try:
        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        worker.join(60)
    finally:
        gc.set_threshold(*before)
    assert not worker.is_alive(), "a scanned tensor's death inside a scan blocked it"
