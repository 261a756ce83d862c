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
