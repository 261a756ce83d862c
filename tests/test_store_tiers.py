"""Store tiers: format 3 (zero-copy views, xxh3, bounded headers), the disk tier's reads, buffers
and cap, the host tier, the N-tier tiered store, URL options, the default stack, the tier bench."""

import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvrag.cache_backends import (
    CorruptEntryError,
    DiskStore,
    HostStore,
    KVEntry,
    MemoryStore,
    StoreError,
    StoreURLError,
    TieredStore,
    content_key,
    default_store_url,
    open_store,
    tier_urls,
)
from kvrag.cache_backends.disk import DEFAULT_MAX_BYTES
from kvrag.cache_backends.format import FORMAT_VERSION, StaleEntryError, decode_entry, encode_entry, storage_of
from kvrag.defaults import DEFAULT_DISK_PRECISION
from kvrag.cache_backends.host import BufferPool, physical_memory

from devices import DEVICES
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def entry(seed=0, tokens=6, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(3, 2, tokens, 8, generator=g).to(dtype)
    v = torch.randn(3, 2, tokens, 8, generator=g).to(dtype)
    return KVEntry(k, v, meta={"kind": "chunk"}, token_ids=torch.arange(tokens))


def same(a: KVEntry, b: KVEntry) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def buffer_of(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _header(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


def _with_header(data: bytes, header: dict) -> bytes:
    """`data` with its header replaced (same data region), for crafting hostile entries."""
    n = int.from_bytes(data[:8], "little")
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 64)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


# -- format 3 --------------------------------------------------------------------------------------
def test_decoded_tensors_view_the_read_buffer():
    buf = buffer_of(encode_entry(entry()))
    got = decode_entry(buf)
    assert same(got, entry()) and torch.equal(got.token_ids, torch.arange(6))
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for t in (got.keys, got.values, got.token_ids):
        assert lo <= t.data_ptr() < hi  # a view, not a copy
    assert got.keys.data_ptr() % 8 == 0


def test_entries_are_valid_safetensors_with_an_xxh3_checksum():
    data = encode_entry(entry(dtype=torch.bfloat16))
    tensors = st_load(data)
    assert torch.equal(tensors["k"], entry(dtype=torch.bfloat16).keys)
    meta = _header(data)["__metadata__"]
    assert meta["format"] == FORMAT_VERSION == "3" and len(meta["checksum"]) == 16  # 64-bit xxh3
    assert (8 + int.from_bytes(data[:8], "little")) % 64 == 0


def test_the_checksum_covers_user_metadata():
    data = encode_entry(KVEntry(entry().keys, entry().values, meta={"model": "aaaa"}))
    forged = data.replace(b'"model":"aaaa"', b'"model":"bbbb"')
    assert forged != data
    with pytest.raises(CorruptEntryError, match="checksum"):
        decode_entry(forged)


def test_old_format_is_a_stale_miss_not_an_exception(tmp_path):
    old = st_save(
        {"k": entry().keys, "v": entry().values},
        metadata={"magic": "kvrag-entry", "format": "2", "shape": "[3, 2, 6, 8]", "vshape": "[3, 2, 6, 8]",
                  "dtype": "float32", "quant": "none", "checksum": "00000000"},
    )
    with pytest.raises(StaleEntryError):
        decode_entry(old)
    store = DiskStore(tmp_path)
    key = content_key("old")
    store._path(key).parent.mkdir(parents=True, exist_ok=True)
    store._path(key).write_bytes(old)
    assert store.get(key) is None
    assert not store._path(key).exists() and store.stats().errors == 0 and store.stats().misses == 1


@pytest.mark.parametrize(
    "mangle",
    [
        lambda h: h["k"].update(shape=[1 << 40, 1 << 40, 1, 1]),
        lambda h: h["k"].update(data_offsets=[0, 1 << 62]),
        lambda h: h["k"].update(shape=[3.0, 2, 6, 8]),
        lambda h: h["k"].update(dtype="F64"),
        lambda h: h.update(extra={"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}),
        lambda h: h["v"].update(data_offsets=h["k"]["data_offsets"]),
    ],
)
def test_hostile_tensor_tables_are_rejected_fast(mangle):
    data = encode_entry(entry())
    header = _header(data)
    mangle(header)
    t = time.perf_counter()
    with pytest.raises(CorruptEntryError):
        decode_entry(_with_header(data, header))
    assert time.perf_counter() - t < 0.5


def test_a_huge_header_length_is_rejected_without_allocating():
    data = (1 << 60).to_bytes(8, "little") + b"{}" * 10
    with pytest.raises(CorruptEntryError, match="header length"):
        decode_entry(data)
    with pytest.raises(CorruptEntryError):
        decode_entry(b"[" * 100000)  # deeply nested JSON


# -- the disk tier ----------------------------------------------------------------------------------
@pytest.mark.parametrize("read", ["map", "copy"])
def test_disk_get_many_is_parallel_ordered_and_sets_the_tier(tmp_path, read):
    store = DiskStore(tmp_path, threads=3, read=read)
    keys = [content_key(str(i)) for i in range(8)]
    for i, k in enumerate(keys):
        store.put(k, entry(seed=i))
    bad = store._path(keys[3])
    bad.write_bytes(bad.read_bytes()[:-5])
    asked = keys + [content_key("absent")]
    got = store.get_many(asked)
    assert got[3] is None and got[-1] is None
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert same(got[i], entry(seed=i)) and got[i].tier == "disk"
    assert store.stats().errors == 1 and store.stats().misses == 2 and not bad.exists()


@pytest.mark.parametrize("read", ["map", "copy"])
def test_disk_reads_an_entry_whose_header_is_longer_than_a_read_chunk(tmp_path, read):
    store = DiskStore(tmp_path, read=read)
    k = content_key("long")
    big = KVEntry(entry().keys, entry().values, meta={"note": "x" * (700 << 10)})
    store.put(k, big)
    got = store.get(k)
    assert same(got, big) and got.meta["note"] == big.meta["note"]


def test_disk_read_buffers_are_never_reused_while_viewed(tmp_path):
    store = DiskStore(tmp_path, read="copy")
    a, b = content_key("a"), content_key("b")
    store.put(a, entry(seed=1))
    store.put(b, entry(seed=2))
    held = store.get(a)
    held_slice = held.keys[1]  # a view of a view: still owns the buffer
    for _ in range(5):
        assert same(store.get(b), entry(seed=2))
    assert same(held, entry(seed=1)) and torch.equal(held_slice, entry(seed=1).keys[1])
    reused = store.buffers.reused
    del held, held_slice
    store.get(b)
    store.get(b)
    assert store.buffers.reused > reused  # once nothing views a buffer, it is recycled


def test_copy_reads_are_the_default_into_buffers_of_the_callers_own(tmp_path):
    """The default read lands every byte in a staging buffer of the process's (the pool's), which the
    entry's tensors view: no mapping of the file, no second copy."""
    assert DiskStore(tmp_path).read == "copy" and open_store(f"disk://{tmp_path}?read=auto").read == "copy"
    store = DiskStore(tmp_path / "d", max_bytes=None)
    k = content_key("owned")
    store.put(k, entry(seed=1))
    got = store.get(k)
    assert not got.mapped and same(got, entry(seed=1))
    base = got.keys.untyped_storage().data_ptr()
    assert got.values.untyped_storage().data_ptr() == base == got.token_ids.untyped_storage().data_ptr()
    assert store.buffers.allocated == 1


def test_a_cold_chunk_fills_the_tiers_above_with_the_disk_reads_own_buffer(tmp_path):
    """memory | host | disk (the CUDA default's shape, unpinned on the CPU): a cold get promotes the
    entry into both tiers above without copying it (the old default, a mapped read, cloned it)."""
    store = open_store(f"tiered://?tiers=memory|host|disk://{tmp_path}?max_bytes=none")
    k = content_key("cold")
    store.put(k, entry(seed=3))
    for t in store.tiers[:2]:
        t.clear()
    got = store.get(k)
    assert got.tier == "disk" and same(got, entry(seed=3))
    read = got.keys.untyped_storage().data_ptr()
    for t in store.tiers[:2]:
        kept = t.get(k)
        assert kept is not None and kept.keys.untyped_storage().data_ptr() == read
    assert store.get(k).tier == "memory"


def test_mapped_reads_outlive_their_file(tmp_path):
    """Mapped entries view the file's pages copy-on-write: a caller writing into them leaves the file
    alone, and they stay intact when the store replaces or deletes the file (rename, unlink)."""
    assert "read='map'" in repr(DiskStore(tmp_path, read="map"))
    store = DiskStore(tmp_path, read="map")
    k = content_key("mapped")
    store.put(k, entry(seed=1))
    held = store.get(k)
    held.keys.add_(1.0)  # private pages: the file keeps its bytes
    assert same(store.get(k), entry(seed=1))
    held = store.get(k)
    store.put(k, entry(seed=2))  # replaced by rename
    assert same(held, entry(seed=1)) and same(store.get(k), entry(seed=2))
    store.delete(k)
    assert same(held, entry(seed=1)) and store.get(k) is None


def test_mapped_reads_refuse_damaged_files_as_misses(tmp_path):
    store = DiskStore(tmp_path, read="map")
    keys = [content_key(f"d{i}") for i in range(3)]
    for i, k in enumerate(keys):
        store.put(k, entry(seed=i))
    store._path(keys[0]).write_bytes(b"")  # empty
    raw = bytearray(store._path(keys[1]).read_bytes())
    raw[-3] ^= 0x10  # one data bit
    store._path(keys[1]).write_bytes(bytes(raw))
    got = store.get_many(keys)
    assert got[0] is None and got[1] is None and same(got[2], entry(seed=2))
    assert store.stats().errors == 2


def test_disk_read_mode_is_checked(tmp_path):
    with pytest.raises(StoreError, match="read mode"):
        DiskStore(tmp_path, read="fast")
    with pytest.raises(StoreURLError, match="read must be"):
        open_store(f"disk://{tmp_path}?read=fast")
    assert open_store(f"disk://{tmp_path}?read=copy").read == "copy"


def test_buffer_pool_hands_out_exact_sizes_and_skips_busy_buffers():
    pool = BufferPool()
    one = pool.take(10_000)
    assert one.numel() == 10_000
    two = pool.take(10_000)
    assert two.data_ptr() != one.data_ptr()
    ptr = one.data_ptr()
    del one
    assert pool.take(9_000).data_ptr() == ptr


def test_disk_cleans_stale_temp_files_and_counts_fresh_ones(tmp_path):
    DiskStore(tmp_path)
    shard = tmp_path / "entries" / "ab" / "cd"
    shard.mkdir(parents=True)
    stale, fresh = shard / ".tmp-dead", shard / ".tmp-live"
    stale.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 700)
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    (tmp_path / "index" / "ef").mkdir(parents=True)
    (tmp_path / "index" / "ef" / ".tmp-ref").write_text("z")
    os.utime(tmp_path / "index" / "ef" / ".tmp-ref", (old, old))
    store = DiskStore(tmp_path)
    assert store.temp_cleaned == 2 and not stale.exists() and fresh.exists()
    assert store._scan_size() == 700  # a writer in flight counts toward the cap


def test_disk_overwrites_are_not_double_counted(tmp_path):
    store = DiskStore(tmp_path, max_bytes=10**9)
    key = content_key("same")
    store.put(content_key("other"), entry())
    for _ in range(5):
        store.put(key, entry())
    assert store._size == store._scan_size()
    store.put(key, entry(tokens=20))  # a larger overwrite
    assert store._size == store._scan_size()


def test_disk_default_cap_and_no_cap(tmp_path):
    assert DiskStore(tmp_path).max_bytes == DEFAULT_MAX_BYTES == 20 << 30
    assert open_store(f"disk://{tmp_path}").max_bytes == DEFAULT_MAX_BYTES
    assert open_store(f"disk://{tmp_path}?max_bytes=none").max_bytes is None
    assert open_store(f"disk://{tmp_path}?max_bytes=1e6").max_bytes == 10**6


def test_disk_rejects_a_file_larger_than_its_cap(tmp_path):
    store = DiskStore(tmp_path, max_bytes=4096)
    key = content_key("big")
    path = store._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * 10_000)
    assert store.get(key) is None and not path.exists()


# -- URL options -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, bad",
    [
        ("memory://?max_byte=5", "max_byte"),
        ("host://?pinned=1", "pinned"),
        ("disk://{tmp}?qantize=int8", "qantize"),
        ("tiered://?worker=2&tiers=memory|disk://{tmp}", "worker"),
        ("tiered://?tiers=memory|disk://{tmp}?bogus=1", "bogus"),
    ],
)
def test_unknown_url_options_name_the_option_and_the_allowed_ones(url, bad, tmp_path):
    with pytest.raises(ValueError, match=f"unknown option '{bad}'.*allowed: ") as err:
        open_store(url.format(tmp=tmp_path))
    assert isinstance(err.value, StoreURLError)


def test_redis_urls_go_to_the_redis_store_which_checks_its_own_options():
    pytest.importorskip("redis")
    store = open_store("redis://127.0.0.1:1/0?ttl=5")  # no connection is made here
    assert store.url == "redis://127.0.0.1:1/0?ttl=5" and store.ttl == 5
    with pytest.raises(ValueError, match="anything"):
        open_store("redis://127.0.0.1:1/0?ttl=5&anything=1")


# -- the host tier -----------------------------------------------------------------------------------
def test_host_tier_default_cap_lru_and_tier_name():
    assert HostStore().max_bytes == int(0.25 * physical_memory())
    one = entry().nbytes
    store = open_store(f"host://?max_bytes={2 * one}")
    assert isinstance(store, HostStore)
    a, b, c = (content_key(x) for x in "abc")
    store.put(a, entry(1))
    store.put(b, entry(2))
    assert store.get(a).tier == "host"
    store.put(c, entry(3))
    assert store.contains(a) and store.contains(c) and not store.contains(b)
    assert store.nbytes == 2 * one


def test_host_tier_is_thread_safe():
    one = entry().nbytes
    store = HostStore(max_bytes=5 * one)
    keys = [content_key(str(i)) for i in range(20)]

    def work(seed: int) -> None:
        for i in range(200):
            k = keys[(seed * 7 + i) % len(keys)]
            store.put(k, entry(seed=0)) if i % 3 else store.get(k)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.nbytes == len(store) * one <= 5 * one


# -- the tiered store --------------------------------------------------------------------------------
def three_tiers(tmp_path) -> TieredStore:
    return open_store(f"tiered://?workers=2&tiers=memory://?max_bytes=1e9|host://?max_bytes=1e9|disk://{tmp_path}?threads=2")


def test_tiered_url_builds_the_stack(tmp_path):
    store = three_tiers(tmp_path)
    assert [type(t) for t in store.tiers] == [MemoryStore, HostStore, DiskStore] and store.names == ["memory", "host", "disk"]
    assert store.tiers[0].max_bytes == 10**9 and store.tiers[2].threads == 2
    old = open_store(f"tiered://?lower=disk://{tmp_path}&max_bytes=1000")
    assert [type(t) for t in old.tiers] == [MemoryStore, DiskStore] and old.upper.max_bytes == 1000
    with pytest.raises(StoreURLError):
        open_store("tiered://?tiers=memory")
    assert tier_urls(f"tiered://?tiers=memory|disk://{tmp_path}?pin=1&max_bytes=5") == ["memory://", f"disk://{tmp_path}?pin=1&max_bytes=5"]
    assert tier_urls("tiered://?lower=disk:///x")[1] == "disk:///x" and tier_urls("disk:///y") == ["disk:///y"]


def test_tiered_get_reports_the_tier_and_promotes(tmp_path):
    store = three_tiers(tmp_path)
    mem, host, disk = store.tiers
    k = content_key("x")
    store.put(k, entry())
    assert mem.contains(k) and host.contains(k) and disk.contains(k)  # write-through
    assert store.get(k).tier == "memory"
    mem.delete(k)
    got = store.get(k)
    assert got.tier == "host" and same(got, entry()) and mem.contains(k)
    mem.delete(k)
    host.delete(k)
    got = store.get_many([k, content_key("absent")])
    assert got[0].tier == "disk" and same(got[0], entry()) and got[1] is None
    assert mem.contains(k) and host.contains(k)  # promoted into every tier above
    assert store.get(k).tier == "memory"
    assert store.stats().hits == 4 and store.stats().misses == 1
    assert store.tier_stats()["disk"].hits == 1


def test_tiered_prefetch_promotes_through_every_tier(tmp_path):
    disk = DiskStore(tmp_path)
    keys = [content_key(str(i)) for i in range(4)]
    for i, k in enumerate(keys):
        disk.put(k, entry(seed=i))
    store = TieredStore([MemoryStore(), HostStore(max_bytes=10**9), disk])
    store.prefetch(keys + keys[:1])
    store.wait(timeout=30)
    assert all(store.upper.contains(k) and store.tiers[1].contains(k) for k in keys)
    reads = disk.stats().hits
    got = store.get_many(keys)
    assert [g.tier for g in got] == ["memory"] * 4 and disk.stats().hits == reads == 4
    assert all(same(g, entry(seed=i)) for i, g in enumerate(got))


def test_tiered_get_waits_for_entries_in_flight(tmp_path):
    class Slow(DiskStore):
        def get_many(self, keys):
            time.sleep(0.3)
            return super().get_many(keys)

    disk = Slow(tmp_path)
    k = content_key("slow")
    disk.put(k, entry())
    store = TieredStore(disk)
    store.prefetch([k])
    got = store.get(k)
    assert got.tier == "disk" and same(got, entry()) and disk.stats().hits == 1  # read once


# -- the default stack -------------------------------------------------------------------------------
def test_default_store_url_per_device(tmp_path):
    cpu = default_store_url(tmp_path, "cpu")
    assert cpu.startswith("tiered://?tiers=memory://") and cpu.endswith(f"|disk://{tmp_path}?quantize={DEFAULT_DISK_PRECISION}")
    gpu = default_store_url(tmp_path, "cuda")
    assert "memory://?device=cuda" in gpu and "|host://?pin=1|" in gpu and gpu.endswith(f"?quantize={DEFAULT_DISK_PRECISION}&pin=1")
    store = open_store(None, tmp_path, device="cpu")
    assert isinstance(store, TieredStore) and store.names == ["memory", "disk"]
    assert storage_of(store.quantize) == DEFAULT_DISK_PRECISION  # what the default keys its entries by
    plain = open_store(None, tmp_path)  # no device: a plain disk store at the default precision
    assert isinstance(plain, DiskStore) and storage_of(plain.quantize) == DEFAULT_DISK_PRECISION


def test_a_lower_tier_is_read_in_groups_when_a_tier_above_is_on_a_gpu(tmp_path, monkeypatch):
    """The CUDA stack's pipelining, its logic on the CPU: with a GPU tier above, the disk tier is read
    READ_GROUP entries at a time (each group's upload runs while the next is read); without, at once."""
    from kvrag.cache_backends.memory import to_device
    from kvrag.cache_backends.tiered import READ_GROUP

    disk = DiskStore(tmp_path, max_bytes=None)
    assert TieredStore([MemoryStore(device="cuda"), disk])._group == READ_GROUP  # nothing touches CUDA here
    store = TieredStore([MemoryStore(), HostStore(), disk])
    assert store._group == 0
    keys = [content_key("g", str(i)) for i in range(5)]
    for i, k in enumerate(keys):
        store.put(k, entry(seed=i))
    store.tiers[0].clear()
    store.tiers[1].clear()
    store._group = 2  # as with a GPU tier on top
    calls, real = [], disk.get_many
    monkeypatch.setattr(disk, "get_many", lambda ks: calls.append(list(ks)) or real(ks))
    got = store.get_many(keys)
    assert calls == [keys[0:2], keys[2:4], keys[4:]]
    assert all(e.tier == "disk" and same(e, entry(seed=i)) for i, e in enumerate(got))
    assert all(store.tiers[1].contains(k) for k in keys)  # the host tier filled on the way
    t = torch.ones(3)
    assert to_device(t, torch.device("cpu")) is t and to_device(t, torch.device("cpu"), copy=True) is not t


# -- CUDA: pinned buffers and the GPU tier (the CPU runs the same calls: pin is ignored without CUDA) ---
@pytest.mark.parametrize("device", DEVICES)
def test_pinned_disk_reads_and_host_tier(tmp_path, device):
    disk = DiskStore(tmp_path, pin=True)
    k = content_key("p")
    disk.put(k, entry())
    got = disk.get(k)
    pinned = device == "cuda"
    assert disk.buffers.pin == pinned and disk.read == "copy"  # copy reads into the caller's buffers, on every device
    assert got.keys.is_pinned() == pinned and got.values.is_pinned() == pinned and same(got, entry())
    host = HostStore(pin=True)
    host.put(k, entry())
    assert host.pin == pinned and host.get(k).keys.is_pinned() == pinned


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_default_stack_serves_from_the_gpu(tmp_path, device):
    """The default stack for `device` (CUDA: GPU, pinned host, disk; CPU: memory, disk) serves a chunk
    only the disk holds from the disk, as the disk tier holds it (bf16 by default, not the float32 put),
    on the device, and from the top tier after that."""
    store = open_store(None, tmp_path, device=device)
    assert store.names == (["gpu", "host", "disk"] if device == "cuda" else ["memory", "disk"])
    k = content_key("g")
    store.put(k, entry())
    for t in store.tiers[:-1]:
        t.delete(k)
    held = store.tiers[-1].get(k)  # the entry as the disk tier holds it, at DEFAULT_DISK_PRECISION (bf16)
    torch.testing.assert_close(held.keys, entry().keys, rtol=2**-8, atol=0)  # within bf16's rounding of the put
    got = store.get(k)
    assert got.tier == "disk" and got.keys.device.type == device
    assert torch.equal(got.keys.cpu(), held.keys) and torch.equal(got.values.cpu(), held.values)
    assert store.get(k).tier == store.names[0]


@cuda
def test_cuda_default_stack_serves_cold_chunks_from_pinned_reads_and_fills_the_host_tier(tmp_path):
    """A cold get of bf16 KV (the GPU default): read into pinned staging buffers, kept as they are by
    the host tier (keys and values still views of one read buffer: no copy), uploaded on the side
    stream in groups (tiered.READ_GROUP) with the current stream ordered after the copies, so work
    queued next sees every byte without a host sync."""
    from kvrag.cache_backends.tiered import READ_GROUP

    store = open_store(None, tmp_path, device="cuda")
    keys = [content_key("c", str(i)) for i in range(READ_GROUP + 3)]  # more than one group
    want = [entry(seed=i, tokens=64, dtype=torch.bfloat16) for i in range(len(keys))]
    for k, e in zip(keys, want):
        store.put(k, e)
    for t in store.tiers[:2]:
        t.clear()
    got = store.get_many(keys)
    sums = [e.keys.float().sum() + e.values.float().sum() for e in got]  # queued right after the copies
    for k, e, w, total in zip(keys, got, want, sums):
        assert e.tier == "disk" and e.keys.is_cuda and torch.equal(e.keys.cpu(), w.keys) and torch.equal(e.values.cpu(), w.values)
        assert torch.allclose(total.cpu(), w.keys.float().sum() + w.values.float().sum())
        host = store.tiers[1].get(k)
        assert host is not None and host.keys.is_pinned()
        assert host.keys.untyped_storage().data_ptr() == host.values.untyped_storage().data_ptr()  # the read's own buffer
        ids = store.tiers[0].get(k).token_ids  # the GPU tier's own copy: no view keeps the read buffer alive
        assert ids.untyped_storage().data_ptr() != host.keys.untyped_storage().data_ptr()
    assert all(e.tier == "gpu" for e in store.get_many(keys))


# -- the bench ---------------------------------------------------------------------------------------
def test_tier_bandwidth_reports_every_tier_beside_the_plain_read(tmp_path):
    """The tier table's JSON carries the disk tier's get into the caller's memory against a plain
    readinto of the same files, as a ratio, and the rows it is made of (no speed is asserted)."""
    from kvrag.eval.store_bench import random_entries, tier_bandwidth, write_tiers

    t = tier_bandwidth(tmp_path, random_entries(3, shape=(2, 1, 16, 8)), rounds=2)
    paths = [r["path"] for r in t["rows"]]
    assert "plain file read" in paths and any(p.startswith("disk get_many") for p in paths)
    assert "plain file read, a buffer per file" in paths and t["disk_threads"] >= 1
    assert "memory get_many" in paths and "host get_many" in paths
    assert any(p.startswith("default stack, cold: disk -> host") for p in paths)
    assert all(r["gb_s"] > 0 for r in t["rows"]) and t["disk_default_read"] == "copy"
    md = write_tiers(tmp_path / "out", t)
    saved = json.loads((tmp_path / "out" / "tiers.json").read_text())
    d = saved["disk_vs_plain_read"]
    by = {r["path"]: r["gb_s"] for r in saved["rows"]}
    assert d["disk"] in by and d["disk"].endswith("(default)") and d["plain"] == "plain file read" and d["stack"] in by
    assert d["ratio"] == pytest.approx(by[d["disk"]] / by["plain file read"])
    assert d["ratio_vs_a_buffer_per_file"] == pytest.approx(by[d["disk"]] / by["plain file read, a buffer per file"])
    assert d["stack_ratio"] == pytest.approx(by[d["stack"]] / by["plain file read"])
    assert {"entries", "entry_mb", "rounds", "cpus", "load_avg", "pinned"} <= set(saved)
    assert "| plain file read |" in md and f"plain readinto of the same files: {d['ratio']:.2f}" in md
    # the summary line leads with the default get against reading and hashing the same files (issue 68)
    assert d["read_and_xxh3"] == "plain file read + xxh3" and "plain file read + xxh3" in by
    assert d["ratio_vs_read_and_xxh3"] == pytest.approx(by[d["disk"]] / by["plain file read + xxh3"])
    summary = next(line for line in md.splitlines() if line.startswith("**disk tier's default get"))
    assert f"plain file read + xxh3 of the same files: {d['ratio_vs_read_and_xxh3']:.2f}**" in summary


def test_the_bench_store_command_writes_the_tier_table(tmp_path, monkeypatch):
    from kvrag.cli.app import main
    from kvrag.eval import store_bench

    small = store_bench.random_entries(2, shape=(2, 1, 8, 8))
    monkeypatch.setattr(store_bench, "random_entries", lambda *a, **k: small)
    real = store_bench.tier_bandwidth
    monkeypatch.setattr("kvrag.cli.bench_run.tier_bandwidth", lambda out: real(out, rounds=1))
    assert main(["bench", "store", "--tiers-only", "--out", str(tmp_path)]) == 0
    assert {"ratio", "ratio_vs_read_and_xxh3"} <= set(json.loads((tmp_path / "tiers.json").read_text())["disk_vs_plain_read"])
    assert "÷ plain file read + xxh3 of the same files" in (tmp_path / "tiers.md").read_text()


@pytest.mark.parametrize("read", ["map", "copy"])
def test_disk_reads_racing_overwrites_and_deletes_see_whole_versions(tmp_path, read):
    """Readers of a key that another thread keeps replacing (rename) and deleting (unlink) get a
    whole version or a miss, never a mix or a damaged entry; held tensors keep their version."""
    store = DiskStore(tmp_path, read=read)
    k = content_key("raced")
    versions = [entry(seed=s) for s in range(3)]
    stop = threading.Event()

    def churn() -> None:
        i = 0
        while not stop.is_set():
            store.put(k, versions[i % 3])
            if i % 4 == 3:
                store.delete(k)
            i += 1

    store.put(k, versions[0])
    writer = threading.Thread(target=churn)
    writer.start()
    held, seen, reads = [], 0, 0
    deadline = time.monotonic() + 5
    try:
        while (seen < 100 or reads < 300) and time.monotonic() < deadline:  # a miss is fast: read on until enough hits
            reads += 1
            got = store.get(k)
            if got is not None:
                seen += 1
                assert any(same(got, v) for v in versions)
                held.append(got)
    finally:
        stop.set()
        writer.join()
    assert seen > 0 and store.stats().errors == 0
    assert all(any(same(h, v) for v in versions) for h in held[-20:])  # still whole after the churn
