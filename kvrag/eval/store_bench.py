"""Store benchmark: get latency and load throughput per store, and the load share of TTFT.

Entries are real SmolLM2 chunk KV (10 chunks of ~150 tokens from the sample corpus), so sizes and
dtypes are what the engine stores. Disk figures are with a warm page cache (a serving store's
steady state); the note says so.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvrag.cache_backends import KVStore, open_store
from kvrag.engine import KVRag
from kvrag.eval.runner import hardware
from kvrag.types import Chunk


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def sample_chunks(n: int = 10, words: int = 140) -> list[Chunk]:
    from kvrag.cli import sample_corpus_dir
    from kvrag.documents import load_documents

    chunks = load_documents([sample_corpus_dir()], max_words=words)
    return chunks[:n]


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


def ttft_load_share(rag_factory, chunks: list[Chunk], question: str, rounds: int = 5) -> dict[str, Any]:
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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chunks = sample_chunks()
    disk_url = f"disk://{(out / 'disk').resolve()}"
    base = KVRag.from_pretrained(model, store=disk_url)
    base.precompute(chunks, progress=False)
    resolved = base._resolve(chunks)
    entries = dict(zip(resolved.keys, base.store.get_many(resolved.keys)))
    urls = ["memory://", disk_url, f"disk://{(out / 'disk-int8').resolve()}?quantize=int8"]
    if redis_url:
        urls += [redis_url, redis_url + ("&" if "?" in redis_url else "?") + "quantize=int8"]
    urls += [f"tiered://?lower={disk_url}"]
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
        "stores": rows,
        "ttft_load_share": {"lower": lower.split("@")[-1], **share},
        "note": "disk figures with a warm page cache",
    }
    (out / "store_bench.json").write_text(json.dumps(result, indent=2))
    (out / "store_bench.md").write_text(store_markdown(result))
    return result


def store_markdown(result: dict[str, Any]) -> str:
    lines = [
        f"hardware: {json.dumps(result['hardware'])}; tokens per entry: {result['tokens_per_entry']}",
        "",
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
