"""Store format and the simple memory/disk stores: bit-exact, safe on corrupt input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag.cache_backends import CorruptEntryError, KVEntry, StoreError, content_key, open_store
from kvrag.cache_backends.format import decode_entry, encode_entry


def entry(dtype=torch.float32, tokens=5):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 2, tokens, 8, generator=g).to(dtype)
    v = torch.randn(3, 2, tokens, 8, generator=g).to(dtype)
    return KVEntry(k, v, meta={"model": "m", "kind": "chunk"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    e = entry(dtype)
    back = decode_entry(encode_entry(e))
    assert back.keys.dtype == dtype and torch.equal(back.keys, e.keys) and torch.equal(back.values, e.values)
    assert back.meta["model"] == "m" and back.meta["kind"] == "chunk"


def test_flipped_byte_is_detected():
    data = bytearray(encode_entry(entry()))
    data[-3] ^= 0xFF
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode_entry(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_the_store_error(data):
    with pytest.raises(CorruptEntryError):
        decode_entry(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(min_value=0, max_value=255))
def test_mutated_entries_never_decode_silently_wrong(pos, byte):
    good = encode_entry(entry())
    data = bytearray(good)
    pos %= len(data)
    data[pos] = byte
    try:
        back = decode_entry(bytes(data))
    except CorruptEntryError:
        return
    ref = entry()
    assert torch.equal(back.keys, ref.keys) and torch.equal(back.values, ref.values)


@pytest.mark.parametrize("url", ["memory://", "disk"])
def test_store_put_get_delete(url, tmp_path):
    store = open_store(f"disk://{tmp_path}/s" if url == "disk" else url)
    key = content_key("fp", "layout", [1, 2, 3])
    assert store.get(key) is None and not store.contains(key)
    store.put(key, entry())
    got = store.get(key)
    assert got is not None and torch.equal(got.keys, entry().keys)
    assert store.contains(key) and store.get_many([key, content_key("x")])[1] is None
    store.delete(key)
    assert store.get(key) is None


def test_truncated_disk_entry_is_a_miss_and_deleted(tmp_path):
    store = open_store(f"disk://{tmp_path}")
    key = content_key("k")
    store.put(key, entry())
    path = store._path(key)
    path.write_bytes(path.read_bytes()[:100])
    assert store.get(key) is None
    assert not path.exists()


def test_keys_are_hashes_never_user_text(tmp_path):
    store = open_store(f"disk://{tmp_path}")
    with pytest.raises(StoreError):
        store.put("../../etc/passwd", entry())
    key = content_key("../../etc/passwd")
    store.put(key, entry())
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 1 and files[0].name.startswith(key) and files[0].is_relative_to(tmp_path)


def test_memory_store_evicts_least_recently_used():
    one = entry().nbytes
    store = open_store(f"memory://?max_bytes={2 * one}")
    a, b, c = (content_key(x) for x in "abc")
    store.put(a, entry()); store.put(b, entry())
    store.get(a)
    store.put(c, entry())
    assert store.contains(a) and store.contains(c) and not store.contains(b)


def test_unknown_scheme_is_a_clear_error():
    with pytest.raises(StoreError, match="unknown store URL scheme"):
        open_store("ftp://x")
