"""Issue #37: what a careless or hostile writer of the store folder can do to a reader.

Each case runs in a child process: a reader that faults (SIGBUS) must show as a failed exit code,
not take pytest down with it."""

import subprocess
import sys
import textwrap


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_an_entry_truncated_in_place_after_promotion_is_not_read_from_its_dead_mapping(tmp_path):
    """The memory tier once kept views of the disk file's mapped pages: after `: > file` the next
    answer served from memory ended the process with a bus error (exit 135). It keeps copies now."""
    child = run_child(f"""
        import glob, torch
        from kvrag.cache_backends import KVEntry, open_store
        keys = torch.randn(4, 2, 4096, 16)
        open_store("disk://{tmp_path}").put("a" * 64, KVEntry(keys, keys * 2, {{"k": "v"}}, torch.arange(4096)))
        store = open_store("tiered://?tiers=memory://|disk://{tmp_path}?read=map")  # another process wrote it
        assert store.get("a" * 64).tier == "disk"  # mapped, and promoted into memory
        assert store.get("a" * 64).tier == "memory"
        for path in glob.glob("{tmp_path}/**/*.kv", recursive=True):
            open(path, "r+b").truncate(0)        # what `: > file` does
        entry = store.get("a" * 64)              # served from memory
        print(float(entry.keys.sum() + entry.values.sum()), int(entry.token_ids.sum()))
    """)
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    assert child.stdout.strip()


def _entry(n: int = 64):
    import torch

    from kvrag.cache_backends import KVEntry

    keys = torch.randn(2, 1, n, 8)
    return KVEntry(keys, keys + 1, {"k": "v"}, torch.arange(n))


def test_a_fifo_or_symlink_at_an_entry_path_is_a_miss_not_a_hang(tmp_path):
    """A FIFO planted at an entry's path once blocked the store's read for good (the engine hung)."""
    child = run_child(f"""
        import os
        from kvrag.cache_backends import open_store
        from kvrag.cache_backends.disk import DiskStore
        store = DiskStore("{tmp_path}", read="copy")
        key, other = "b" * 64, "c" * 64
        path = store._file(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path)
        assert store.get(key) is None
        mapped = DiskStore("{tmp_path}", read="map")
        assert mapped.get(key) is None
        outside = "{tmp_path}/outside.kv"
        open(outside, "wb").write(b"x" * 100)
        link = store._file(other)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(outside, link)
        assert store.get(other) is None and mapped.get(other) is None
        print("ok")
    """)
    assert child.returncode == 0 and child.stdout.strip() == "ok", (child.returncode, child.stderr[-2000:])


def test_cleaning_and_eviction_never_follow_a_symlinked_shard_out_of_the_folder(tmp_path):
    """Opening the store once deleted an outside `.tmp-*` file, and eviction outside `*.kv` files."""
    import os
    import time

    from kvrag.cache_backends.disk import DiskStore

    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    victims = [outside / "ab" / (".tmp-" + "1" * 8), outside / "ab" / ("a" * 64 + ".kv"), outside / "notes.kv"]
    for v in victims:
        v.write_bytes(b"precious" * 1000)
        os.utime(v, (time.time() - 10 * 86400, time.time() - 10 * 86400))  # old: first to go, if it could
    root = tmp_path / "store"
    store = DiskStore(str(root), max_bytes=1 << 20)
    os.symlink(outside, root / "entries" / "zz")  # not a shard name
    os.symlink(outside, root / "entries" / "ab")  # a shard name, but a link
    (root / "entries" / "cd").mkdir(exist_ok=True)
    os.symlink(outside / "ab", root / "entries" / "cd" / "ef")
    (root / "entries" / "cd" / "ee").mkdir()
    (root / "entries" / "cd" / "ee" / "not-a-key.kv").write_bytes(b"mine? no")
    store.clean_temp(older_than=0)
    for i in range(40):  # past the cap: eviction runs
        store.put(f"{i:064x}", _entry(1024))
    assert store.evict(target=0.1) > 0
    DiskStore(str(root), max_bytes=1 << 20)  # opening cleans stale temp files
    assert all(v.exists() for v in victims)
    assert (root / "entries" / "cd" / "ee" / "not-a-key.kv").exists()
