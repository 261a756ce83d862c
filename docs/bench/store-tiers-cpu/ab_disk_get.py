"""Same-process A/B for the disk-get target: the disk tier's get with disk_read.py from before (ee3aab8~1) and as it is now,
rounds interleaved with the bench's own plain read + xxh3 (kvrag.eval.store_bench's entries and timing).

    mkdir -p /tmp/old68 && git archive ee3aab8~1 cache_backends | tar -x -C /tmp/old68
    nice -n 19 python docs/bench/store-tiers-cpu/ab_disk_get.py 2
"""
import importlib.util
import sys
import tempfile
from pathlib import Path
from kvrag.eval.store_bench import random_entries, plain_read_hashed, plain_read, _interleaved
from kvrag.cache_backends import DiskStore
spec = importlib.util.spec_from_file_location("kvrag.cache_backends.disk_read_old", "/tmp/old68/cache_backends/disk_read.py")
old = importlib.util.module_from_spec(spec); sys.modules[spec.name] = old; spec.loader.exec_module(old)

class OldDisk(DiskStore):
    def _open_entry(self, index, key):
        got = super()._open_entry(index, key)
        if not hasattr(got, "fd"):
            return got
        return old.EntryFile(got.index, got.name, got.fd, got.buf, touch=got.touch, mac_key=got.mac_key, key=got.key)
    def _fetch_many(self, keys):
        helpers = self.threads - 1 if old.PARALLEL else 0
        pool = self._helpers() if helpers and keys else None
        return old.ReadBatch(lambda i: self._open_entry(i, keys[i]), len(keys)).run(pool, helpers)

root = Path(tempfile.mkdtemp(dir="/tmp/p68"))
entries = random_entries(); keys = list(entries)
new2 = DiskStore(root, max_bytes=None)
for k, e in entries.items(): new2.put(k, e)
new1, old2, old1 = DiskStore(root, max_bytes=None, threads=1), OldDisk(root, max_bytes=None), OldDisk(root, max_bytes=None, threads=1)
new2always = DiskStore(root, max_bytes=None, threads=new2.threads)
assert all(e is not None for e in old2.get_many(keys) + old1.get_many(keys))
paths = [new2._path(k) for k in keys]
fns = {"before, 2 threads (default)": lambda: old2.get_many(keys), "after, default (helpers on idle CPUs)": lambda: new2.get_many(keys),
       "after, 2 threads always": lambda: new2always.get_many(keys),
       "before, 1 thread": lambda: old1.get_many(keys), "after, 1 thread": lambda: new1.get_many(keys),
       "plain file read": plain_read(paths), "plain file read + xxh3": plain_read_hashed(paths)}
nb = sum(p.stat().st_size for p in paths)
for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    load = open("/proc/loadavg").read().split()[0]
    s = _interleaved(fns, 20)
    h = s["plain file read + xxh3"]
    print(f"run {rep + 1} (load {load}): " + "; ".join(f"{k} {nb / v / 1e9:.2f} GB/s = {h / v:.2f}" for k, v in s.items()))
