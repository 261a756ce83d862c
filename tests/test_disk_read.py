"""The disk tier's read pipeline (cache_backends/disk_read.py, disk_entry.py): reader threads fill each
entry's buffer piece by piece and hash the pieces in order. Small pieces here make every entry span
many of them, so the hand-offs between threads are exercised on tiny files; the pooled staging
buffers are checked never to be handed out while a returned tensor still views them."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvrag.cache_backends import CorruptEntryError, DiskStore, KVEntry, StoreError, content_key
from kvrag.cache_backends import disk_entry, disk_read
from kvrag.cache_backends.disk_read import EntryFile, ReadBatch, read_entry
from kvrag.cache_backends.format import encode_entry


def entry(seed: int = 0, tokens: int = 40, meta: dict | None = None) -> KVEntry:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(4, 2, tokens, 16, generator=g)
    v = torch.randn(4, 2, tokens, 16, generator=g)
    return KVEntry(k, v, meta=meta or {"kind": "chunk"}, token_ids=torch.arange(tokens))


def same(a: KVEntry, b: KVEntry) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and a.meta == b.meta


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1000 bytes (not a multiple of anything in the format): a 40-token entry is ~41 pieces."""
    monkeypatch.setattr(ReadBatch.__init__, "__defaults__", (1000,))


def fill(store: DiskStore, n: int) -> list[str]:
    keys = [content_key("read", str(i)) for i in range(n)]
    for i, k in enumerate(keys):
        store.put(k, entry(seed=i))
    return keys


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_entry_comes_back_whole_in_order(tmp_path, small_pieces, threads):
    store = DiskStore(tmp_path, threads=threads, read="copy")
    keys = fill(store, 12)
    asked = keys[:5] + [content_key("absent")] + keys[5:]
    for _ in range(3):
        got = store.get_many(asked)
        assert got[5] is None
        assert all(same(g, entry(seed=i)) for i, g in enumerate(got[:5] + got[6:]))
        assert all(g.tier == "disk" for g in got[:5] + got[6:])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", [0.0, 0.02, 0.5, 0.999])  # header, first data piece, middle, last byte
def test_a_flipped_byte_in_any_piece_is_a_miss(tmp_path, small_pieces, threads, where):
    store = DiskStore(tmp_path, threads=threads, read="copy")
    keys = fill(store, 4)
    path = store._path(keys[2])
    data = bytearray(path.read_bytes())
    pos = min(len(data) - 1, max(12, int(where * len(data))))  # past the length field
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))
    got = store.get_many(keys)
    assert got[2] is None and not path.exists() and store.stats().errors == 1
    assert all(same(got[i], entry(seed=i)) for i in (0, 1, 3))


@pytest.mark.parametrize("threads", [1, 2])
def test_truncated_empty_garbage_and_stale_files_are_misses(tmp_path, small_pieces, threads):
    store = DiskStore(tmp_path, threads=threads, read="copy")
    keys = fill(store, 6)
    paths = [store._path(k) for k in keys]
    paths[0].write_bytes(paths[0].read_bytes()[:-1])  # one byte short
    paths[1].write_bytes(b"")
    paths[2].write_bytes(os.urandom(5000))
    paths[3].write_bytes(paths[3].read_bytes().replace(b'"format":"3"', b'"format":"9"'))
    got = store.get_many(keys)
    assert got[:4] == [None] * 4 and not any(p.exists() for p in paths[:4])
    assert same(got[4], entry(seed=4)) and same(got[5], entry(seed=5))
    assert store.stats().errors == 3  # the stale one is a miss, not damage


def test_a_file_that_shrinks_while_read_is_corrupt(tmp_path, small_pieces):
    path = tmp_path / "e.kv"
    path.write_bytes(encode_entry(entry()))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.truncate(path, size - 3000)  # after the reader sized its buffer
        got, _ = read_entry(fd, torch.empty(size, dtype=torch.uint8))
        assert isinstance(got, CorruptEntryError) and "shrank" in str(got)
        got, _ = read_entry(fd, torch.empty(size + 100, dtype=torch.uint8))  # longer than the table says
        assert isinstance(got, CorruptEntryError)
    finally:
        os.close(fd)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_header_longer_than_several_pieces(tmp_path, small_pieces, threads):
    store = DiskStore(tmp_path, threads=threads, read="copy")
    k = content_key("long")
    big = entry(meta={"note": "x" * 5500})  # the header spans six pieces
    store.put(k, big)
    got = store.get_many([k, k])
    assert same(got[0], big) and same(got[1], big)


def test_a_large_request_keeps_few_files_open(tmp_path, small_pieces):
    store = DiskStore(tmp_path, threads=2, read="copy")
    keys = fill(store, 60)
    before, seen = open_fds(), []
    opener = store._open_entry

    def counting(i, key):
        seen.append(open_fds())
        return opener(i, key)

    store._open_entry = counting  # type: ignore[method-assign]
    got = store.get_many(keys)
    assert all(same(g, entry(seed=i)) for i, g in enumerate(got))
    # files are opened a window at a time as threads reach them, and closed once hashed
    assert max(seen) - before <= store.threads * (disk_read.WINDOW + 1) + 2 < 60
    assert open_fds() == before


def test_a_read_error_in_a_helper_is_raised_and_every_file_closed(tmp_path, small_pieces):
    store = DiskStore(tmp_path, threads=2, read="copy")
    keys = fill(store, 8)
    store.get_many(keys)  # the helper pool exists
    before = open_fds()
    opener = store._open_entry

    def failing(i, key):
        if i == 5:
            raise StoreError("disk on fire")
        return opener(i, key)

    store._open_entry = failing  # type: ignore[method-assign]
    with pytest.raises(StoreError, match="on fire"):
        store.get_many(keys)
    assert open_fds() == before


def test_pieces_are_hashed_in_order_while_helpers_read_ahead(tmp_path):
    """Slow reads on the helper: the caller waits for the piece it needs, never hashes out of order."""
    data = encode_entry(entry(tokens=64))
    path = tmp_path / "e.kv"
    path.write_bytes(data)
    real = disk_entry.pread_into
    slow = threading.local()

    def pread(fd, view, start, stop):
        if threading.current_thread().name.startswith("helper"):
            threading.Event().wait(0.002)
        slow.n = getattr(slow, "n", 0) + 1
        return real(fd, view, start, stop)

    disk_entry.pread_into = pread
    try:
        fds = [os.open(path, os.O_RDONLY) for _ in range(3)]
        files = [EntryFile(i, "e", fd, torch.empty(len(data), dtype=torch.uint8)) for i, fd in enumerate(fds)]
        with ThreadPoolExecutor(2, thread_name_prefix="helper") as pool:
            got = ReadBatch(lambda i: files[i], 3, piece=777).run(pool, helpers=2)
    finally:
        disk_entry.pread_into = real
    assert all(same(g, entry(tokens=64)) and n == len(data) for g, n in got)
    assert all(f.fd == -1 for f in files)  # the batch closed them


def test_concurrent_requests_share_the_helper_pool(tmp_path, small_pieces):
    store = DiskStore(tmp_path, threads=2, read="copy")
    keys = fill(store, 10)
    errors = []

    def work(seed: int) -> None:
        for r in range(5):
            ks = keys[(seed + r) % 10 :] + keys[: (seed + r) % 10]
            got = store.get_many(ks)
            if not all(same(g, entry(seed=keys.index(k))) for g, k in zip(got, ks)):
                errors.append(seed)

    ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and store.stats().hits == 200


def test_default_threads_use_every_core_up_to_four(tmp_path):
    assert DiskStore(tmp_path).threads == max(1, min(4, os.cpu_count() or 1))


def test_read_buffers_are_recycled_without_the_garbage_collector(tmp_path, small_pieces):
    """Nothing of a finished request may keep its buffers alive (a reference cycle would, until gc)."""
    import gc

    store = DiskStore(tmp_path, threads=2, read="copy")
    keys = fill(store, 4)
    gc.disable()
    try:
        store.get_many(keys)
        allocated = store.buffers.allocated
        for _ in range(5):
            store.get_many(keys)
        assert store.buffers.allocated == allocated and store.buffers.reused >= 20
    finally:
        gc.enable()


def test_a_closed_store_still_reads_on_the_caller(tmp_path, small_pieces):
    store = DiskStore(tmp_path, threads=2, read="copy")
    keys = fill(store, 3)
    store.get_many(keys)
    store.close()  # the helper pool refuses work now
    assert all(same(g, entry(seed=i)) for i, g in enumerate(store.get_many(keys)))


def test_large_read_buffers_are_mmap_backed_and_live_as_long_as_their_views():
    from kvrag.cache_backends.host import HUGE_MIN, BufferPool

    pool = BufferPool()
    buf = pool.take(HUGE_MIN + 12345)
    assert buf.numel() == HUGE_MIN + 12345 and buf.dtype == torch.uint8
    buf.fill_(7)
    view = buf[HUGE_MIN:].view(torch.int8)
    ptr = buf.data_ptr()
    del buf
    assert pool.take(HUGE_MIN + 100).data_ptr() != ptr  # still viewed: not handed out again
    assert int(view.sum()) == 7 * 12345  # the memory is still there
    del view
    assert pool.take(HUGE_MIN + 100).data_ptr() == ptr


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_that_shrinks_between_its_open_and_its_read_is_a_miss(tmp_path, threads):
    """The tight read-and-hash loop meets the end of the file early: a corrupt entry, never a short one."""
    store = DiskStore(tmp_path, threads=threads, read="copy")
    keys = [content_key("shrink", str(i)) for i in range(4)]
    for i, k in enumerate(keys):
        store.put(k, entry(seed=i, tokens=2000))  # ~1 MB: past the first piece
    opener = store._open_entry

    def shrinking(i, key):
        got = opener(i, key)
        if i == 2:
            os.truncate(store._path(key), os.path.getsize(store._path(key)) - 70_000)
        return got

    store._open_entry = shrinking  # type: ignore[method-assign]
    got = store.get_many(keys)
    assert got[2] is None and store.stats().errors == 1
    assert all(same(got[i], entry(seed=i, tokens=2000)) for i in (0, 1, 3))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_returned_tensor_is_never_overwritten_by_a_later_get(tmp_path, threads):
    """Pooled staging buffers are reused only once nothing views them: tensors a caller still holds
    (whole entries, a slice, a reinterpretation, a numpy array or a storage of theirs) keep their
    bytes through many later gets of other entries of the same size, and no later entry lands in
    their memory; the buffers the caller dropped are reused."""
    store = DiskStore(tmp_path, threads=threads, read="copy")
    held_keys = [content_key("held", str(i)) for i in range(6)]
    other_keys = [content_key("other", str(i)) for i in range(6)]
    for i, k in enumerate(held_keys + other_keys):
        store.put(k, entry(seed=100 + i, tokens=300))
    got = store.get_many(held_keys)
    want = [entry(seed=100 + i, tokens=300) for i in range(6)]
    held = {
        "entry": got[0],
        "slice": got[1].keys[2, 1],  # a view of a view
        "reinterpreted": got[2].values.view(torch.int32),
        "ids": got[3].token_ids,
        "numpy": got[4].keys.numpy(),
        "storage": got[5].values.untyped_storage(),
    }
    expect = {
        "entry": want[0].keys.clone(),
        "slice": want[1].keys[2, 1].clone(),
        "reinterpreted": want[2].values.view(torch.int32).clone(),
        "ids": want[3].token_ids.clone(),
        "numpy": want[4].keys.numpy().copy(),
        "storage": bytes(got[5].values.untyped_storage()),
    }
    spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in (g.keys.untyped_storage() for g in got)]
    del got
    reused = store.buffers.reused
    for r in range(8):
        fresh = store.get_many(other_keys if r % 2 else held_keys[1:])
        for g in fresh:
            s = g.keys.untyped_storage()
            begin, end = s.data_ptr(), s.data_ptr() + s.nbytes()
            assert all(end <= b or begin >= e for b, e in spans), "a later get landed in memory a caller still views"
        del fresh
    assert torch.equal(held["entry"].keys, expect["entry"]) and same(held["entry"], want[0])
    assert torch.equal(held["slice"], expect["slice"]) and torch.equal(held["reinterpreted"], expect["reinterpreted"])
    assert torch.equal(held["ids"], expect["ids"])
    assert (held["numpy"] == expect["numpy"]).all() and bytes(held["storage"]) == expect["storage"]
    assert store.buffers.reused > reused  # the pool is exercised: dropped buffers come back


def test_default_helpers_join_a_request_only_on_idle_cpus(tmp_path, monkeypatch):
    """The default reader count: helpers only while CPUs are idle (a busy machine reads faster alone);
    a count given to the store is always used."""
    from kvrag.cache_backends import disk as disk_module

    store = DiskStore(tmp_path, read="copy")
    store.threads = max(2, store.threads)  # a 1-CPU runner too: the gate is the same
    keys = fill(store, 4)
    for idle, helped in ((0, 0), (-3, 0), (1, 1), (None, 1)):
        monkeypatch.setattr(disk_module, "idle_cpus", lambda idle=idle: idle)
        before = store.helped
        assert all(same(g, entry(seed=i)) for i, g in enumerate(store.get_many(keys)))
        assert store.helped - before == helped, idle
    fixed = DiskStore(tmp_path, read="copy", threads=2)
    monkeypatch.setattr(disk_module, "idle_cpus", lambda: 0)
    assert all(same(g, entry(seed=i)) for i, g in enumerate(fixed.get_many(keys))) and fixed.helped == 1


def test_idle_cpus_counts_the_caller_as_running():
    idle = disk_read.idle_cpus()
    if idle is not None:  # Linux: /proc/loadavg
        assert idle <= (os.cpu_count() or 1) - 1
