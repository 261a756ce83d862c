"""KVLink adapters on tiny random models: the file round trip, refusals, merged weights served on kvlink only, shipped adapters."""

import copy
import os

import pytest
import torch


from kvrag import KVRag, from_model
from kvrag.core import AdapterPath as _AdapterPath
from kvrag.options import DEFAULT_METHOD, AnswerOptions
from kvrag.errors import AdapterMismatchError
from kvrag.kv.layout import LAYOUT_VERSION
from kvrag.link_adapter import LinkAdapter, adapter_header, apply_adapter, load_adapter, read_adapter_header, save_adapter
from tiny import tiny_model, tiny_tokenizer
from kvlink_helpers import CHUNKS, IDS, Q, lora_adapter, make_rag, random_adapter


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
    import kvrag.link_adapter as links_mod

    monkeypatch.setattr(links_mod, "SHIPPED_DIR", folder)
    monkeypatch.setattr(links_mod, "SHIPPED_ADAPTERS", {source: names})


def test_shipped_adapter_is_the_default_where_there_is_one(tmp_path, monkeypatch):
    rag = make_rag()
    assert rag.link_adapter is None and rag.default_method == DEFAULT_METHOD  # link_adapter=None
    auto = KVRag(rag.lm, store=rag.store, check=False)
    assert auto.link_adapter is None  # "auto" and no adapter shipped for this model
    save_adapter(tmp_path / "tiny.kvlink.safetensors", random_adapter(rag.lm, k=2, layout_identity=rag.layout.identity))
    ship(monkeypatch, tmp_path, rag.lm.source, links="tiny.kvlink.safetensors", tuned="absent.safetensors")
    auto = KVRag(rag.lm, store=rag.store, check=False)
    assert auto.prefill(Q, IDS, method="kvlink").segments.links == 2
    assert auto.lm is rag.lm and auto.default_method == DEFAULT_METHOD  # links only: the base weights, the base default
    terse = KVRag(rag.lm, store=rag.store, check=False, system_prompt="You are terse.")  # layout mismatch: untrained
    assert terse.link_adapter is None and terse.prefill(Q, chunks=CHUNKS, method="kvlink").segments.links == 0


def test_shipped_tuned_adapter_serves_kvlink_only_when_asked_for(tmp_path, monkeypatch):
    rag = make_rag()
    tuned, _ = lora_adapter(rag.lm, rag.layout.identity)
    save_adapter(tmp_path / "tuned.safetensors", tuned)
    save_adapter(tmp_path / "links.safetensors", random_adapter(rag.lm, k=3, layout_identity=rag.layout.identity))
    ship(monkeypatch, tmp_path, rag.lm.source, tuned="tuned.safetensors", links="links.safetensors")
    auto = KVRag(rag.lm, store="memory://", check=False)  # "auto": the links-only adapter, the base weights
    assert not auto.link_adapter.changes_model and auto.default_method == DEFAULT_METHOD and auto.adapter_lm is None
    opted = KVRag(rag.lm, store="memory://", check=False, link_adapter="tuned")  # the tuned one only when asked for
    assert opted.link_adapter.changes_model and opted.adapter_lm.fingerprint == apply_adapter(rag.lm, tuned).fingerprint
    assert opted.lm is rag.lm and opted.default_method == "kvlink"
    pre = opted.prefill(Q, chunks=CHUNKS)  # no method named: the engine's default
    assert pre.stats.method == "kvlink" and pre.segments.links == 2 and pre.stats.weights == "adapter"
    same = opted.prefill(Q, chunks=CHUNKS, options=AnswerOptions(recompute_ratio=0.5))  # options naming no method: the same
    assert same.stats.method == "kvlink" and torch.equal(same.logits, pre.logits)
    assert opted.prefill(Q, chunks=CHUNKS, method="reuse").stats.method == "reuse"  # a named method wins
    links = KVRag(rag.lm, store="memory://", check=False, link_adapter="links")  # the base weights, the links-only adapter
    assert links.lm is rag.lm and links.link_adapter.link_tokens == 3 and links.default_method == DEFAULT_METHOD
    base = KVRag(rag.lm, store="memory://", check=False, link_adapter=None)
    assert base.lm is rag.lm and base.link_adapter is None and base.prefill(Q, chunks=CHUNKS).stats.method == DEFAULT_METHOD
    named = KVRag(rag.lm, store="memory://", check=False, link_adapter="None")  # the command line's spelling, not a file
    assert named.lm is rag.lm and named.link_adapter is None and named.default_method == DEFAULT_METHOD
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


def test_every_shipped_adapter_file_is_where_the_engine_looks():
    """A missing shipped file is skipped on purpose (a checkout without it still runs), so a wrong folder
    would silently serve no adapter: after a move the files were once looked for one folder too high."""
    from kvrag.link_adapter import SHIPPED_ADAPTERS, SHIPPED_DIR, read_adapter_header

    for kinds in SHIPPED_ADAPTERS.values():
        for name in kinds.values():
            assert (SHIPPED_DIR / name).is_file(), SHIPPED_DIR / name
            assert read_adapter_header(SHIPPED_DIR / name)["format"]
