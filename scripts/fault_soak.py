"""Fault soak for the Redis KV store (issue #18): threads answer while the server is killed, frozen,
squeezed to a tiny maxmemory and flushed; every answer must equal the fault-free one, none may raise.

    python scripts/fault_soak.py --seconds 120 --threads 4 --out soak-out [--model tiny|bundled]
    python scripts/fault_soak.py --mode index --seconds 60 --threads 2 --out soak-out/index

`--mode index` soaks the shared retrieval index instead (a `chroma run` killed and frozen under two
replicas: scripts/index_soak.py). The default, `--mode redis`, soaks the Redis KV store:

Loopback only: it starts its own redis-server (`--save '' --appendonly no`) on a free 127.0.0.1 port
and kills it at the end. Steps:

1. Precompute ~20 chunks (sentences of kvrag/sample_corpus) into the store and register them.
2. Fault-free reference: every work item (question x method reuse/a3 x addressing by text/by id),
   greedy, max_new_tokens 8, answered once from the warm store. Then FLUSHALL and a second pass in
   which each chunk is a miss once, recomputed inside the request that needs it (not in the
   precompute batch): it must give the same texts (a miss recomputes exactly the same KV).
3. The soak: `--threads` threads loop over the items for `--seconds` while a schedule runs faults
   (kill -9 then restart empty; SIGSTOP then SIGCONT; maxmemory tiny with noeviction; maxmemory
   tiny with allkeys-lru; FLUSHALL), each logged with its start and end.

Writes OUT/soak.json (every answer, every exception, the fault log) and OUT/soak.md (the table),
and prints the markdown. Exit status 1 when an answer raised or differed from the reference.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "scripts"):  # kvrag from the checkout; soak_faults beside this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from soak_faults import FAULT_KINDS, Fault, FaultDriver, FaultPlan, RedisProcess  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger("fault_soak")

METHODS = ("reuse", "a3")
ADDRESSING = ("chunks", "ids")  # chunks=[Chunk(text)] (a lost store is recomputed) / chunk_ids registered in the engine
MAX_NEW_TOKENS = 8
HANG_S = 120.0  # an answer still running this long after the soak's end is reported as a hang
LINGER_S = 1.0  # an answer that ends within this long after a fault's end still counts as "during the fault"
QUESTIONS = [
    "When did the Brannoch Line open to passengers?",
    "How do bees turn nectar into honey?",
    "What makes sourdough bread rise?",
    "How does a solar panel make electricity?",
    "What happens during the Lantern Tide festival?",
    "Who built the lighthouse at Port Averly?",
    "What instruments does Quillfeather make?",
    "Where does rain come from?",
    "Why does the railway close in winter?",
    "What do the sentences have in common?",
]


# -- corpus, questions, engine --------------------------------------------------------------------
def corpus(n: int = 20) -> list[Any]:
    """n sentences of the bundled sample corpus, round-robin over its files, as chunks c00.. ."""
    from kvrag import Chunk

    files = sorted((ROOT / "kvrag" / "sample_corpus").glob("*.md"))
    per_file = []
    for f in files:
        text = " ".join(line.strip() for line in f.read_text().splitlines() if line.strip() and not line.startswith("#"))
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 60 <= len(s.strip()) <= 220]
        per_file.append((f.stem, sentences))
    out: list[Any] = []
    row = 0
    while len(out) < n:
        added = False
        for stem, sentences in per_file:
            if row < len(sentences) and len(out) < n:
                out.append(Chunk(f"c{len(out):02d}", sentences[row], title=stem.replace("-", " ")))
                added = True
        if not added:
            break
        row += 1
    return out


@dataclass(frozen=True)
class Item:
    idx: int
    question: str
    chunk_ids: tuple[str, ...]
    method: str
    addressing: str


def work_items(chunks: list[Any], n_questions: int = len(QUESTIONS), seed: int = 0) -> list[Item]:
    rng = random.Random(seed)
    ids = [c.id for c in chunks]
    items = []
    for q in QUESTIONS[:n_questions]:
        picked = tuple(rng.sample(ids, rng.randint(3, 5)))
        for method in METHODS:
            for addressing in ADDRESSING:
                items.append(Item(len(items), q, picked, method, addressing))
    return items


def build_engine(model: str, store_url: str) -> Any:
    from kvrag import KVRag

    if model == "bundled":
        return KVRag.from_pretrained(store=store_url, device="cpu")
    if model != "tiny":
        raise ValueError(f"--model must be tiny or bundled, got {model!r}")
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny import tiny_model, tiny_tokenizer  # tests/tiny.py: a 3-layer random llama, byte-level tokenizer

    from kvrag import from_model

    # check=False: the correctness gate is the model's business (tests cover it on these models), not the store's
    return KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=store_url, check=False)


def ask(rag: Any, item: Item, by_id: dict[str, Any]) -> Any:
    opts = dict(method=item.method, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    if item.addressing == "chunks":
        return rag.answer(item.question, chunks=[by_id[i] for i in item.chunk_ids], **opts)
    return rag.answer(item.question, list(item.chunk_ids), **opts)


# -- running and recording ------------------------------------------------------------------------
@dataclass
class Record:
    thread: int
    item: int
    text: str
    identical: bool
    ttft_s: float
    answer_s: float
    hits: int
    misses: int
    start: float
    end: float
    in_fault: bool = False
    faults: list[str] = field(default_factory=list)


class WarningCounter(logging.Handler):
    """Counts the store's warnings (what the engine logs instead of failing) by their first words."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}
        self.lock_ = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        key = f"{record.name}: " + re.sub(r"redis://\S+", "<url>", msg)[:48]
        with self.lock_:
            self.counts[key] = self.counts.get(key, 0) + 1


def reference_pass(rag: Any, items: list[Item], by_id: dict[str, Any]) -> list[tuple[str, int, int]]:
    out = []
    for it in items:
        a = ask(rag, it, by_id)
        out.append((a.text, a.stats.cache_hits, a.stats.cache_misses))
    return out


def soak_threads(rag: Any, items: list[Item], by_id: dict[str, Any], reference: list[str], threads: int,
                 seconds: float, t0: float, stop: threading.Event) -> tuple[list[Record], list[dict]]:  # fmt: skip
    records: list[Record] = []
    errors: list[dict] = []
    lock = threading.Lock()

    def worker(tid: int) -> None:
        order = items[tid * len(items) // threads :] + items[: tid * len(items) // threads]
        n = 0
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            it = order[n % len(order)]
            n += 1
            start = time.monotonic() - t0
            try:
                a = ask(rag, it, by_id)
            except Exception as exc:  # must never happen: a store fault is a miss
                with lock:
                    errors.append({"thread": tid, "item": it.idx, "at": round(start, 3), "type": type(exc).__name__,
                                   "message": str(exc)[:500], "traceback": traceback.format_exc()[-2000:]})  # fmt: skip
                continue
            end = time.monotonic() - t0
            rec = Record(tid, it.idx, a.text, a.text == reference[it.idx], a.stats.ttft_s, end - start,
                         a.stats.cache_hits, a.stats.cache_misses, round(start, 4), round(end, 4))  # fmt: skip
            with lock:
                records.append(rec)

    pool = [threading.Thread(target=worker, args=(i,), name=f"answer-{i}", daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:  # an answer that never returns is a finding (a hang), not a soak that never ends
        t.join(timeout=max(0.0, t0 + seconds + HANG_S - time.monotonic()))
        if t.is_alive():
            errors.append({"thread": pool.index(t), "item": -1, "at": round(time.monotonic() - t0, 3), "type": "Hang",
                           "message": f"an answer was still running {HANG_S:g} s after the soak's end", "traceback": ""})
    return records, errors


def classify(records: list[Record], faults: list[Fault]) -> None:
    for r in records:
        hit = [f.kind for f in faults if r.start <= (f.end or f.start) + LINGER_S and r.end >= f.start]
        r.in_fault, r.faults = bool(hit), hit


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v), max(1, math.ceil(q / 100 * len(v)))) - 1]  # nearest rank


def hardware() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        rv = subprocess.run([shutil.which("redis-server") or "redis-server", "--version"], capture_output=True, text=True).stdout
        rv = re.search(r"v=(\S+)", rv).group(1)  # type: ignore[union-attr]
    except Exception:
        rv = "?"
    return (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"Python {platform.python_version()}, redis-server {rv}, {platform.system()} {platform.release()}")  # fmt: skip


def run_soak(seconds: float = 120.0, threads: int = 4, out: str | Path = "soak-out", model: str = "tiny",
             plan: FaultPlan | None = None, socket_timeout: float = 0.25, connect_timeout: float = 0.5,
             part_bytes: int | None = 16384, n_chunks: int = 20, n_questions: int = len(QUESTIONS),
             quiet: bool = False) -> dict:  # fmt: skip
    """The whole soak; returns the summary written to OUT/soak.json (`summary` key holds the counts)."""
    plan = plan or FaultPlan()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counter = WarningCounter()
    logging.getLogger().addHandler(counter)
    server = RedisProcess()
    server.start()
    stop = threading.Event()
    driver: FaultDriver | None = None
    try:
        store_url = f"{server.url}?socket_timeout={socket_timeout:g}&connect_timeout={connect_timeout:g}"
        if part_bytes:
            store_url += f"&part_bytes={part_bytes}"
        t_setup = time.monotonic()
        rag = build_engine(model, store_url)
        chunks = corpus(n_chunks)
        by_id = {c.id: c for c in chunks}
        items = work_items(chunks, n_questions)
        rag.precompute(chunks, progress=False)
        setup_s = time.monotonic() - t_setup

        t = time.monotonic()
        warm = reference_pass(rag, items, by_id)
        warm_s = time.monotonic() - t
        reference = [w[0] for w in warm]
        server.admin().flushall()
        cold = reference_pass(rag, items, by_id)  # each chunk a miss once: recomputed by the first request that needs it
        miss_diffs = [{"item": asdict(it), "reference": w[0], "after_flush": c[0]}
                      for it, w, c in zip(items, warm, cold) if w[0] != c[0]]  # fmt: skip

        if not quiet:
            print(f"set-up {setup_s:.1f} s; reference pass: {len(items)} answers in {warm_s:.1f} s; "
                  f"after FLUSHALL: {sum(c[2] for c in cold)} misses, {len(miss_diffs)} differences; soak {seconds:g} s...",
                  flush=True)  # fmt: skip
        t0 = time.monotonic()
        driver = FaultDriver(server, plan, seconds, t0, stop)
        driver.start()
        records, errors = soak_threads(rag, items, by_id, reference, threads, seconds, t0, stop)
        stop.set()
        driver.join(timeout=plan.squeeze_s + plan.down_s + 15)
        faults = list(driver.faults)
        classify(records, faults)
        store_stats = asdict(rag.store.stats())
    finally:
        stop.set()
        if driver is not None and driver.is_alive():
            driver.join(timeout=30)
        server.close()
        logging.getLogger().removeHandler(counter)

    diffs = [{"item": asdict(items[r.item]), "reference": reference[r.item], "got": r.text, "thread": r.thread,
              "at": r.start, "faults": r.faults} for r in records if not r.identical]  # fmt: skip
    inside = [r for r in records if r.in_fault]
    outside = [r for r in records if not r.in_fault]

    def group(rs: list[Record]) -> dict:
        tt = [r.ttft_s for r in rs]
        return {"answers": len(rs), "identical": sum(r.identical for r in rs), "hits": sum(r.hits for r in rs),
                "misses": sum(r.misses for r in rs), "ttft_p50_s": pct(tt, 50), "ttft_p99_s": pct(tt, 99),
                "ttft_max_s": max(tt) if tt else None}  # fmt: skip

    summary = {
        "answers": len(records),
        "identical": sum(r.identical for r in records),
        "different": len(diffs),
        "exceptions": len(errors),
        "fault_driver_errors": sum(bool(f.error) for f in faults),
        "miss_path_differences": len(miss_diffs),
        "in_faults": group(inside),
        "outside_faults": group(outside),
        "all": group(records),
        "by_fault": {k: group([r for r in records if k in r.faults]) for k in FAULT_KINDS if any(k in r.faults for r in records)},
    }
    result = {
        "command": f"python scripts/fault_soak.py --seconds {seconds:g} --threads {threads} --out {out} --model {model}",
        "model": model,
        "store_url": store_url,
        "seconds": seconds,
        "threads": threads,
        "items": [asdict(i) for i in items],
        "plan": asdict(plan),
        "linger_s": LINGER_S,
        "hardware": hardware(),
        "setup_s": round(setup_s, 2),
        "summary": summary,
        "reference": {"texts": reference, "ttft_note": "warm pass, one thread, healthy server"},
        "miss_path_differences": miss_diffs,
        "faults": [asdict(f) for f in faults],
        "exceptions": errors,
        "differences": diffs,
        "store_stats": store_stats,
        "warnings": counter.counts,
        "records": [asdict(r) for r in records],
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "soak.md").write_text(md)
    if not quiet:
        print(md)
    return result


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v * 1000:.1f}"


def markdown(res: dict) -> str:
    s = res["summary"]
    rows = [("during faults", s["in_faults"]), ("without faults", s["outside_faults"]), ("all", s["all"])]
    rows += [(f"… during {kind}", g) for kind, g in s.get("by_fault", {}).items()]
    lines = [
        f"# Fault soak: {res['seconds']:g} s, {res['threads']} threads, model {res['model']}",
        "",
        f"`{res['command']}`",
        "",
        f"Store `{res['store_url']}` (loopback, own redis-server, `--save '' --appendonly no`); "
        f"{len(res['items'])} work items ({len(res['items']) // 4} questions x reuse/a3 x chunks=text/chunk_ids), greedy, "
        f"max_new_tokens {MAX_NEW_TOKENS}. An answer is *during a fault* when it overlaps a fault window "
        f"(or ends within {res['linger_s']:g} s after it).",
        "",
        f"**{s['answers']} answers, {s['identical']} identical to the fault-free run, {s['different']} different, "
        f"{s['exceptions']} exceptions.** Miss path before the soak (FLUSHALL, then each chunk recomputed by the first request needing it): "
        f"{s['miss_path_differences']} differences from the warm reference.",
        "",
        "| | answers | identical | exceptions | cache hits | misses | TTFT p50 (ms) | TTFT p99 (ms) | TTFT max (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, g in rows:
        exc = s["exceptions"] if name == "all" else "–"
        lines.append(f"| {name} | {g['answers']} | {g['identical']} | {exc} | {g['hits']} | {g['misses']} | "
                     f"{_ms(g['ttft_p50_s'])} | {_ms(g['ttft_p99_s'])} | {_ms(g['ttft_max_s'])} |")  # fmt: skip
    lines += ["", "Fault log (seconds since the soak started):", "", "| fault | start | end | detail |", "|---|---:|---:|---|"]
    for f in res["faults"]:
        detail = f["detail"] + (f" **driver error: {f['error']}**" if f["error"] else "")
        lines.append(f"| {f['kind']} | {f['start']:.2f} | {f['end']:.2f} | {detail} |")
    if res["warnings"]:
        lines += ["", "Warnings logged (what the engine did instead of failing):", ""]
        lines += [f"- {n} x `{k}`" for k, n in sorted(res["warnings"].items(), key=lambda kv: -kv[1])]
    st = res["store_stats"]
    lines += ["", f"Store counters: {st.get('hits')} hits, {st.get('misses')} misses, {st.get('puts')} puts, "
              f"{st.get('errors')} errors.", ""]  # fmt: skip
    for e in res["exceptions"][:10]:
        lines.append(f"- exception in thread {e['thread']} at {e['at']} s, item {e['item']}: {e['type']}: {e['message']}")
    for d in res["differences"][:10]:
        lines.append(f"- different answer, item {d['item']['idx']} ({d['item']['method']}, {d['item']['addressing']}) "
                     f"at {d['at']} s during {d['faults'] or 'no fault'}: {d['reference']!r} vs {d['got']!r}")  # fmt: skip
    for d in res["miss_path_differences"][:10]:
        lines.append(f"- miss-path difference, item {d['item']['idx']}: {d['reference']!r} vs {d['after_flush']!r}")
    lines += ["", f"Hardware: {res['hardware']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["redis", "index"], default="redis",
                   help="redis: the KV store under faults; index: the shared chroma index under faults (index_soak.py)")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--out", default="soak-out")
    p.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    p.add_argument("--every", type=float, default=15.0, help="seconds between two fault starts")
    p.add_argument("--maxmemory", default="2mb")
    p.add_argument("--part-bytes", type=int, default=16384, help="split entries larger than this (0: the store's default)")
    a = p.parse_args(argv)
    if a.seconds <= 0 or a.threads <= 0:
        p.error("--seconds and --threads must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "sentence_transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if a.mode == "index":
        from index_soak import passed, run_index_soak

        return 0 if passed(run_index_soak(a.seconds, a.threads, a.out, a.every)) else 1
    res = run_soak(a.seconds, a.threads, a.out, a.model, FaultPlan(every=a.every, maxmemory=a.maxmemory),
                   part_bytes=a.part_bytes or None)  # fmt: skip
    s = res["summary"]
    return 0 if s["exceptions"] == 0 and s["different"] == 0 and s["miss_path_differences"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
