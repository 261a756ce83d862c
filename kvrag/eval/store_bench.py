"""Store benchmark: each tier's read bandwidth beside the machine's own, get latency per store, and
the load share of TTFT.

Tier figures (`tier_bandwidth`) use random entries of SmolLM2-135M's shape (30 layers x 3 KV heads
x 150 tokens x 64 dims, fp32 keys and values: 6.9 MB an entry, 10 entries), so they need no model.
Every disk figure counts bytes that landed in memory the caller owns, as a plain `readinto` does:
- the disk tier's `get_many` (the default read: each entry read once into a staging buffer of the
  caller's, pinned on CUDA, every byte hashed as it lands; cache_backends/disk_read.py), its tensors
  viewing that buffer: by the default readers (the CPU count, at most 4, whose helpers join a request
  only on CPUs idle at its start: the JSON's `disk_default_helped` says how often they did), by as
  many readers always, and by one;
- the CUDA default stack's shape (memory | host | disk: GPU | pinned host | disk on CUDA) serving
  every entry cold from disk, its upper tiers emptied before each round: the read, the promotion
  into the host tier (which keeps the read's buffer) and, on CUDA, the copy to the GPU, synchronised;
- a plain `readinto` of the same files into one reused buffer (the machine's read speed, single
  thread, no check; the `x plain read` column divides by it) and into a buffer per file (what any
  reader that hands back each entry in memory of its own pays before any check), and the one-buffer
  read plus an xxh3 of each file (the serial floor of a verified read; the summary line divides the
  default disk get by it: `ratio_vs_read_and_xxh3` in the JSON).
The mapped read (`read=map`) is shown beside them: its tensors view the page cache's pages, not memory
of the caller's. Memory and host tiers hand back what they hold (a lookup), and on CUDA the
host-to-device copy of the same bytes is timed from pinned and from pageable memory. The rounds of
each are interleaved and medians reported; `disk_vs_plain_read` in the JSON holds the ratios. A busy
machine slows the multi-threaded disk read more than the single-threaded plain one: compare them on
an idle CPU, and in one run.

    python -m kvrag.eval.store_bench OUT --tiers-only     # the tier table alone, no model (kvrag bench store --tiers-only)

`run_store_bench` (the `kvrag bench store` CLI) adds per-store latencies and the TTFT load share,
which need the model; the engine is imported inside those functions only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from kvrag.cache_backends import DiskStore, HostStore, KVEntry, KVStore, MemoryStore, TieredStore, content_key, open_store
from kvrag.cache_backends.host import BufferPool

SMOLLM2_SHAPE = (30, 3, 150, 64)  # layers, KV heads, tokens, head dim


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def random_entries(n: int = 10, shape: tuple[int, ...] = SMOLLM2_SHAPE, dtype: torch.dtype = torch.float32) -> dict[str, KVEntry]:
    """`n` entries of random KV of `shape`, with token ids, keyed like real entries (hex digests)."""
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        k = torch.randn(*shape, generator=g).to(dtype)
        v = torch.randn(*shape, generator=g).to(dtype)
        ids = torch.randint(0, 49152, (shape[2],), generator=g)
        out[content_key("store-bench", str(i), str(shape))] = KVEntry(k, v, meta={"kind": "chunk"}, token_ids=ids)
    return out


def _interleaved(fns: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each function, rounds interleaved (one warm-up call each first), each round in
    a fresh order (seeded): a row's figure depends on what ran just before it (the caches it left),
    and on the 2-core machine the same serial disk read measured 0.80 of a plain read + xxh3 when it
    always ran right after that read and 0.92 when it ran after another disk read."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order, shuffle = list(fns.items()), random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, fn in order:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def plain_read(paths: list[Path]) -> Callable[[], None]:
    """The machine's read: each file into one reused buffer, one thread, no decoding."""
    buf = bytearray(max(p.stat().st_size for p in paths))
    view = memoryview(buf)

    def run() -> None:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(view)

    return run


def plain_read_per_file(paths: list[Path]) -> Callable[[], None]:
    """The machine's read into a buffer per file (each reused across rounds, from the allocator the
    disk tier reads into), one thread, no check: the floor of any reader that hands back every
    entry in memory of its own, as the disk tier's zero-copy views must. The plain read above
    reuses one buffer, which stays in cache; ten distinct ones cannot."""
    pool = BufferPool()
    views = [memoryview(pool.take(p.stat().st_size).numpy()) for p in paths]

    def run() -> None:
        for p, view in zip(paths, views):
            with open(p, "rb", buffering=0) as f:
                f.readinto(view)

    return run


def plain_read_hashed(paths: list[Path]) -> Callable[[], None]:
    """The machine's read plus the xxh3 checksum of each file: the floor of any verified read."""
    import xxhash

    buf = bytearray(max(p.stat().st_size for p in paths))
    view = memoryview(buf)

    def run() -> None:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                xxhash.xxh3_64(view[: f.readinto(view)]).intdigest()

    return run


PLAIN = "plain file read"
PLAIN_PER_FILE = "plain file read, a buffer per file"
PLAIN_HASHED = "plain file read + xxh3"


def _disk_readers(root: Path, cuda: bool) -> tuple[str, dict[str, DiskStore]]:
    """The disk tier's reads to time, by row name, and the default's row name."""
    disk = DiskStore(root, max_bytes=None, pin=cuda)  # the default: copy into staging buffers (pinned on CUDA)
    threads = disk.threads
    if threads > 1:  # helpers join a request only on CPUs idle at its start (disk_read.idle_cpus)
        default = f"disk get_many, up to {threads} threads: helpers on idle CPUs (default)"
    else:
        default = "disk get_many, 1 thread (default)"
    readers = {default: disk}
    if threads > 1:
        readers[f"disk get_many, {threads} threads always"] = DiskStore(root, max_bytes=None, pin=cuda, threads=threads)
        readers["disk get_many, 1 thread"] = DiskStore(root, max_bytes=None, pin=cuda, threads=1)
    readers["disk get_many, map (the page cache's pages, not the caller's memory)"] = DiskStore(root, max_bytes=None, read="map")
    return default, readers


def cold_stack(root: Path, cuda: bool) -> TieredStore:
    """The CUDA default stack's shape over the bench's disk files: GPU | pinned host | disk on CUDA,
    memory | host | disk on the CPU (own instances: its buffers never hold up the other rows')."""
    top = MemoryStore(device="cuda") if cuda else MemoryStore()
    return TieredStore([top, HostStore(pin=cuda), DiskStore(root, max_bytes=None, pin=cuda)], workers=1)


def tier_bandwidth(out_dir: str | Path, entries: dict[str, KVEntry] | None = None, rounds: int = 20) -> dict[str, Any]:
    """GB/s of each tier's get_many of `entries` and of the machine's plain read of the disk files."""
    entries = entries or random_entries()
    keys = list(entries)
    payload = sum(e.nbytes for e in entries.values())
    cuda = torch.cuda.is_available()
    root = Path(out_dir) / "tier-disk"
    default, readers = _disk_readers(root, cuda)
    disk = readers[default]
    stack = cold_stack(root, cuda)
    host, memory = HostStore(pin=cuda), MemoryStore()
    for key, entry in entries.items():
        for store in (disk, host, memory):
            store.put(key, entry)
    paths = [disk._path(k) for k in keys]
    file_bytes = sum(p.stat().st_size for p in paths)

    def cold() -> None:
        for tier in stack.tiers[:-1]:
            tier.clear()  # type: ignore[attr-defined]
        got = stack.get_many(keys)
        if cuda:
            torch.cuda.synchronize()
        assert all(e is not None and e.tier == "disk" for e in got)

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    fns: dict[str, Callable[[], Any]] = {
        "memory get_many": lambda: memory.get_many(keys),
        "host get_many": lambda: host.get_many(keys),
        **{name: (lambda store=store: store.get_many(keys)) for name, store in readers.items()},
        "default stack, cold: disk -> host -> " + ("gpu" if cuda else "memory"): cold,
        PLAIN: plain_read(paths),
        PLAIN_PER_FILE: plain_read_per_file(paths),
        PLAIN_HASHED: plain_read_hashed(paths),
    }
    if cuda:
        pinned = [t.pin_memory() for e in entries.values() for t in (e.keys, e.values)]
        pageable = [t.clone() for e in entries.values() for t in (e.keys, e.values)]

        def h2d(ts: list[torch.Tensor]) -> Callable[[], None]:
            def run() -> None:
                for t in ts:
                    t.to("cuda", non_blocking=True)
                torch.cuda.synchronize()

            return run

        fns["host-to-device, pinned"] = h2d(pinned)
        fns["host-to-device, pageable"] = h2d(pageable)
    helped = disk.helped
    secs = _interleaved(fns, rounds)
    helped = disk.helped - helped  # of rounds + 1 requests (one warm-up)
    rows = []
    for name, s in secs.items():
        nbytes = file_bytes if name.startswith(("disk", "plain", "default stack")) else payload
        rows.append({"path": name, "ms": 1000 * s, "gb_s": nbytes / s / 1e9})
    by = {r["path"]: r["gb_s"] for r in rows}
    for r in rows:
        r["vs_plain_read"] = r["gb_s"] / by[PLAIN]
    for store in (*readers.values(), stack):
        store.close()
    stack_row = next(r["path"] for r in rows if r["path"].startswith("default stack"))
    return {
        "entries": len(keys),
        "entry_shape": list(next(iter(entries.values())).keys.shape),
        "entry_mb": file_bytes / len(keys) / 1e6,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "disk_threads": disk.threads,
        "disk_default_helped": f"{helped} of {rounds + 1}",
        "disk_default_read": disk.read,
        "pinned": disk.buffers.pin,
        "load_avg": load,
        "load_avg_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cuda": torch.cuda.get_device_name(0) if cuda else None,
        "rows": rows,
        "disk_vs_plain_read": {
            "disk": default,
            "plain": PLAIN,
            "ratio": by[default] / by[PLAIN],
            "read_and_xxh3": PLAIN_HASHED,
            "ratio_vs_read_and_xxh3": by[default] / by[PLAIN_HASHED],
            "ratio_vs_read_and_xxh3_1_thread": by.get("disk get_many, 1 thread", by[default]) / by[PLAIN_HASHED],
            "ratio_vs_read_and_xxh3_threads_always": by.get(f"disk get_many, {disk.threads} threads always", by[default]) / by[PLAIN_HASHED],
            "ratio_vs_a_buffer_per_file": by[default] / by[PLAIN_PER_FILE],
            "stack": stack_row,
            "stack_ratio": by[stack_row] / by[PLAIN],
            "note": "bytes landed in memory the caller owns (every byte read and hashed) against a plain readinto of the same "
            "files, one thread, no check, and against that read plus an xxh3 of each file (the serial floor of a verified "
            "read, into one reused buffer); medians of interleaved rounds of one run",
        },
    }


def tiers_markdown(t: dict[str, Any]) -> str:
    load = f"load average {t['load_avg']:.1f}" if t.get("load_avg") is not None else "load average unknown"
    lines = [
        f"tier read bandwidth: {t['entries']} entries of {t['entry_shape']} fp32 K+V ({t['entry_mb']:.1f} MB each), "
        f"{t['cpus']} CPUs, {load}" + (f", {t['cuda']}" if t.get("cuda") else "") + "; disk with a warm page cache",
        "",
        "| path | ms | GB/s | x plain read |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['path']} | {r['ms']:.1f} | {r['gb_s']:.2f} | {r['vs_plain_read']:.2f} |" for r in t["rows"]]
    d = t.get("disk_vs_plain_read")
    if d:
        lines += ["", summary_line(t)]
    lines += ["", "memory and host tiers hand back the tensors they hold (no copy): their figure is lookup cost per byte."]
    return "\n".join(lines) + "\n"


def summary_line(t: dict[str, Any]) -> str:
    """The tier table's one-line verdict: the disk tier's default get against reading and hashing the
    same files (the ratio issue 68 sets at >= 0.85 on an idle CPU), then against the plain read alone."""
    d = t["disk_vs_plain_read"]
    vs_hashed = d.get("ratio_vs_read_and_xxh3")
    helped = f", helpers joined {t['disk_default_helped']} of its requests" if t.get("disk_threads", 1) > 1 and "disk_default_helped" in t else ""
    head = "" if vs_hashed is None else (
        f"**disk tier's default get ÷ plain file read + xxh3 of the same files: {vs_hashed:.2f}** "
        f"({t.get('disk_threads', 1)} threads always: {d.get('ratio_vs_read_and_xxh3_threads_always', vs_hashed):.2f}, "
        f"1 thread: {d.get('ratio_vs_read_and_xxh3_1_thread', vs_hashed):.2f}{helped}); ")
    return (head + f"÷ plain readinto of the same files: {d['ratio']:.2f} ({d['ratio_vs_a_buffer_per_file']:.2f} against "
            f"a buffer per file; the default stack serving them cold: {d['stack_ratio']:.2f}); bytes landed in memory the "
            f"caller owns; {t.get('rounds', '?')} interleaved rounds, medians, load average {t.get('load_avg') or 0:.1f}")


def write_tiers(out_dir: str | Path, t: dict[str, Any]) -> str:
    """tiers.json and tiers.md in `out_dir`; returns the markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = tiers_markdown(t)
    (out / "tiers.json").write_text(json.dumps(t, indent=2))
    (out / "tiers.md").write_text(md)
    return md


def time_store(store: KVStore, entries: dict[str, Any], rounds: int = 20) -> dict[str, Any]:
    for key, entry in entries.items():
        store.put(key, entry)
    keys = list(entries)
    store.get_many(keys)  # warm
    lat, batch = [], []
    total = sum(e.nbytes for e in entries.values())
    for _ in range(rounds):
        t = time.perf_counter()
        store.get_many(keys)
        batch.append(time.perf_counter() - t)
        for key in keys:
            t = time.perf_counter()
            store.get(key)
            lat.append(time.perf_counter() - t)
    return {
        "store": store.url.split("@")[-1],
        "entries": len(keys),
        "entry_mb": total / len(keys) / 1e6,
        "get_p50_ms": 1000 * statistics.median(lat),
        "get_p99_ms": 1000 * _percentile(lat, 0.99),
        "load_mb_s": total / 1e6 / statistics.median(batch),
    }


def sample_chunks(n: int = 10, words: int = 140) -> list:
    from kvrag.ingest.samples import sample_corpus_dir
    from kvrag.ingest.documents import load_documents

    chunks = load_documents([sample_corpus_dir()], max_words=words)
    return chunks[:n]


def ttft_load_share(rag_factory, chunks: list, question: str, rounds: int = 5) -> dict[str, Any]:
    """Load share of TTFT on a tiered store: cold upper tier, prefetch issued at request start, prefetch done."""
    out: dict[str, Any] = {}
    ids = [c.id for c in chunks]
    for mode in ("no prefetch", "prefetch at request", "prefetch done"):
        shares, loads, ttfts = [], [], []
        for _ in range(rounds):
            rag = rag_factory()
            if mode != "no prefetch":
                rag.prefetch(ids)
            if mode == "prefetch done":
                rag.store.wait(timeout=10)  # type: ignore[attr-defined]
            st = rag.prefill(question, ids, method="reuse").stats
            shares.append(st.load_s / st.ttft_s)
            loads.append(st.load_s)
            ttfts.append(st.ttft_s)
        out[mode] = {
            "load_ms": 1000 * statistics.median(loads),
            "ttft_ms": 1000 * statistics.median(ttfts),
            "load_share": statistics.median(shares),
        }
    return out


def run_store_bench(out_dir: str | Path, redis_url: str | None = None, model: str | None = None) -> dict[str, Any]:
    from kvrag.engine import KVRag
    from kvrag.eval.runner import hardware

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiers = tier_bandwidth(out)
    chunks = sample_chunks()
    disk_url = f"disk://{(out / 'disk').resolve()}"
    base = KVRag.from_pretrained(model, store=disk_url)
    base.precompute(chunks, progress=False)
    resolved = base._resolve(chunks)
    entries = dict(zip(resolved.keys, base.store.get_many(resolved.keys)))
    urls = ["memory://", "host://", disk_url, f"disk://{(out / 'disk-int8').resolve()}?quantize=int8"]
    if redis_url:
        urls += [redis_url, redis_url + ("&" if "?" in redis_url else "?") + "quantize=int8"]
    urls += [f"tiered://?tiers=memory|{disk_url}"]
    rows = [time_store(open_store(u), entries) for u in urls]
    lower = redis_url or disk_url

    def factory() -> KVRag:
        rag = KVRag(base.lm, store=open_store(f"tiered://?lower={lower}"))
        rag.register(chunks)
        rag.prefix_kv()
        return rag

    share = ttft_load_share(factory, chunks, "In what year did the Brannoch Line open?")
    result = {
        "hardware": hardware(),
        "tokens_per_entry": [len(t) for t in resolved.token_ids],
        "tiers": tiers,
        "stores": rows,
        "ttft_load_share": {"lower": lower.split("@")[-1], **share},
        "note": "disk figures with a warm page cache",
    }
    (out / "store_bench.json").write_text(json.dumps(result, indent=2))
    (out / "store_bench.md").write_text(store_markdown(result))
    return result


def store_markdown(result: dict[str, Any]) -> str:
    lines = [f"hardware: {json.dumps(result['hardware'])}; tokens per entry: {result['tokens_per_entry']}", ""]
    if result.get("tiers"):
        lines += [tiers_markdown(result["tiers"])]
    lines += [
        "| store | entries | MB/entry | get p50 ms | get p99 ms | load MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["stores"]:
        lines.append(
            f"| {r['store']} | {r['entries']} | {r['entry_mb']:.2f} | {r['get_p50_ms']:.2f} | {r['get_p99_ms']:.2f} | {r['load_mb_s']:.0f} |"
        )
    share = result["ttft_load_share"]
    lines += ["", f"TTFT load share, `reuse`, tiered over {share['lower']}:", "", "| mode | load ms | TTFT ms | load share |", "|---|---|---|---|"]
    for mode in ("no prefetch", "prefetch at request", "prefetch done"):
        s = share[mode]
        lines.append(f"| {mode} | {s['load_ms']:.1f} | {s['ttft_ms']:.0f} | {s['load_share']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the store files and the report")
    ap.add_argument("--tiers-only", action="store_true", help="only the tier bandwidth table (no model)")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args(argv)
    if args.tiers_only:
        print(write_tiers(args.out, tier_bandwidth(args.out, rounds=args.rounds)))
    else:
        print(store_markdown(run_store_bench(args.out)))


if __name__ == "__main__":
    main()
