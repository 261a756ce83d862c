"""Storage precision: a store keeps KV at most at the model's compute dtype; bf16 halves a float32
entry and reads back as float32; entries kept at different precisions never share a cache key."""

from __future__ import annotations

import pytest
import torch

from kvrag import Chunk, KVRag, from_model
from kvrag.cache_backends import KVEntry, StoreURLError, content_key, open_store
from kvrag.cache_backends.base import CorruptEntryError
from kvrag.cache_backends.format import decode_entry, encode_entry, storage_of, stored_bytes_per_token
from tiny import tiny_model, tiny_tokenizer


def entry(dtype=torch.float32, tokens=32, head_dim=64) -> KVEntry:
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(3, 2, tokens, head_dim, generator=g) * 3).to(dtype)
    v = torch.randn(3, 2, tokens, head_dim, generator=g).to(dtype)
    return KVEntry(k, v, meta={"kind": "chunk"}, token_ids=torch.arange(tokens))


def test_bf16_halves_a_float32_entry_and_reads_back_as_float32():
    e = entry()
    plain, half = encode_entry(e), encode_entry(e, quantize="bf16")
    assert len(half) < 0.56 * len(plain)
    back = decode_entry(half)
    assert back.keys.dtype == back.values.dtype == torch.float32
    assert torch.equal(back.keys, e.keys.to(torch.bfloat16).float())  # exactly bf16's rounding, nothing else
    assert torch.equal(back.values, e.values.to(torch.bfloat16).float())
    assert torch.equal(back.token_ids, e.token_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_byte_entries_are_kept_as_computed(dtype):
    e = entry(dtype)
    assert encode_entry(e, quantize="bf16") == encode_entry(e)  # never re-rounded, never widened
    assert torch.equal(decode_entry(encode_entry(e, quantize="bf16")).keys, e.keys)


def test_a_bf16_entry_whose_tensors_are_not_bf16_is_corrupt():
    data = bytearray(encode_entry(entry(), quantize="bf16"))
    text = data[8:8 + int.from_bytes(data[:8], "little")].decode()
    forged = text.replace('"quant":"bf16"', '"quant":"none"')  # same length: a relabel, caught by the checksum
    assert len(forged) == len(text)
    data[8:8 + len(text)] = forged.encode()
    with pytest.raises(CorruptEntryError):
        decode_entry(bytes(data))


def test_store_urls_take_the_precision(tmp_path):
    for value, kept in (("none", "none"), ("bf16", "bf16"), ("int8", "int8")):
        store = open_store(f"disk://{tmp_path / value}?quantize={value}")
        assert storage_of(store.quantize) == kept
        store.put(content_key("x"), entry())
        assert store.get(content_key("x")).keys.dtype == torch.float32
    with pytest.raises(StoreURLError, match="bf16"):
        open_store(f"disk://{tmp_path}/bad?quantize=fp8")


def test_bytes_per_token_of_each_precision():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64: 46,080 bytes a token in float32
    assert stored_bytes_per_token(30, 3, 64, 4, "none") == 30 * 2 * 3 * 64 * 4 + 8
    assert stored_bytes_per_token(30, 3, 64, 4, "bf16") == 30 * 2 * 3 * 64 * 2 + 8
    assert stored_bytes_per_token(30, 3, 64, 2, "bf16") == stored_bytes_per_token(30, 3, 64, 2, "none")
    assert stored_bytes_per_token(30, 3, 64, 4, "int8") == 30 * 2 * 3 * 64 + 30 * 3 * 4 + 8


def test_precisions_never_share_a_cache_key_and_bf16_answers_like_float32(tmp_path):
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    chunks = [Chunk(id="a", text="The cat sat on the mat all day."), Chunk(id="b", text="Paris is in France.")]
    rags = {q: KVRag(lm, store=f"disk://{tmp_path / q}?quantize={q}") for q in ("none", "bf16", "int8")}
    ids = rags["none"].layout.chunk_ids(chunks[0])
    assert len({r.repo.key("chunk", ids) for r in rags.values()}) == 3
    logits = {}
    for q, rag in rags.items():
        rag.precompute(chunks, progress=False)
        logits[q] = rag.prefill("Where is Paris?", chunk_ids=["a", "b"], method="reuse").logits.float()
    assert (logits["bf16"] - logits["none"]).abs().max() < 0.05
    assert (logits["bf16"] - logits["none"]).abs().max() > 0  # it is lossy, as documented


def test_a_tiered_store_keys_entries_by_its_coarsest_tier(tmp_path):
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    plain = KVRag(lm, store=f"disk://{tmp_path / 'a'}")
    tiered = KVRag(lm, store=f"tiered://?tiers=memory://|disk://{tmp_path / 'b'}?quantize=bf16")
    assert storage_of(tiered.store.quantize) == "bf16"
    ids = plain.layout.chunk_ids(Chunk(id="a", text="The cat sat on the mat all day."))
    assert plain.repo.key("chunk", ids) != tiered.repo.key("chunk", ids)


@pytest.mark.parametrize("precision", ["none", "bf16", "int8"])
def test_the_projection_of_a_corpus_matches_what_ingesting_it_stores(tmp_path, precision):
    from kvrag.ingest.documents import load_documents
    from kvrag.kv.projection import project
    from kvrag.ingest.samples import sample_corpus_dir

    folder = tmp_path / "model"
    model, tok = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    projection = project([sample_corpus_dir()], model=str(folder))
    assert projection.layers == 3 and projection.kv_heads == 2 and projection.head_dim == 16
    rag = KVRag(from_model(model, tok), store=f"disk://{tmp_path / 'kv'}?quantize={precision}")
    chunks = load_documents([sample_corpus_dir()], tokenizer=tok)
    rag.precompute(chunks, progress=False)
    stored = sum(p.stat().st_size for p in (tmp_path / "kv" / "entries").rglob("*") if p.is_file())
    assert projection.chunks == len(chunks)
    assert abs(projection.total(precision) - stored) < 0.1 * stored, (projection.total(precision), stored)


def test_the_storage_rule_picks_the_narrowest_precision_that_keeps_every_sets_answers():
    from kvrag.eval.storage_eval import choose, summarise

    def records(changed: dict[str, int]) -> list[dict]:
        out = []
        for i in range(10):
            for precision in ("", "bf16", "int8"):
                answer = "1893" if i >= changed.get(precision or "none", 0) else "It opened in 1893, in spring"
                name = "reuse" + (f"{{{precision}}}" if precision else "")
                out.append({"example": f"q{i}", "setting": name, "answer": answer, "contains": "1893" in answer,
                            "agree": 1.0, "ttft_s": 0.1})
        return out

    both_hold = {"facts": summarise(records({})), "nq10": summarise(records({"int8": 1}))}
    assert both_hold["nq10"]["reuse|int8"]["agree_fp32"] == 0.9 and choose(both_hold)[0] == "int8"
    int8_fails = {"facts": summarise(records({})), "nq10": summarise(records({"int8": 2}))}
    chosen, notes = choose(int8_fails)
    assert chosen == "bf16" and any("nq10 reuse" in n for n in notes)
    assert choose({"facts": summarise(records({"bf16": 3, "int8": 3}))})[0] == "none"
