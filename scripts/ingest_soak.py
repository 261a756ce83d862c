"""Issue #37 item 2: a 20 MB text file through `kvrag ingest`, memory sampled, interrupted half-way.

The probe that found item 2 saw 48 minutes without a progress line, 3.65 GB held after 2,288 chunks
and nothing stored. This script runs the real CLI as a user would (`python -m kvrag.cli ingest FILE`,
the bundled model, a disk store), and measures:
  - when the first progress line appears on stderr, and when the first chunk's KV is stored;
  - the resident memory of the process every half second (peak, and the peak after the first
    minute against the peak of the last minute: flat means bounded in the file's size);
  - Ctrl-C (SIGINT) after --interrupt-after seconds: the exit status, what it says it kept, and a
    check that every chunk in the vector index has its KV in the store (no index entry without KV);
  - a rerun of the same command for --rerun-for seconds, interrupted again: it must pass over what
    the first run stored without computing it again, and keep going.

    python scripts/ingest_soak.py [--mb 20] [--interrupt-after 240] [--rerun-for 120] [--home DIR] [--out DIR]

--home is the KVRAG_HOME (default a folder under /tmp that keeps the converted model between runs:
its kv/ and chroma/ are emptied first). --out writes ingest_soak.json and ingest_soak.md.
Run it on an idle machine: it times the ingest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

NAMES = ["Arden", "Brisk", "Calloway", "Dunmore", "Ellery", "Fenwick", "Galloway", "Harrow", "Iverson", "Jessup",
         "Kestrel", "Lathrop", "Merrow", "Norwood", "Oakhurst", "Pembry", "Quill", "Rowan", "Selwyn", "Thorne"]
THINGS = ["bridge", "library", "observatory", "canal", "lighthouse", "market hall", "railway station", "museum", "dam", "school"]
VERBS = ["opened", "was completed", "was rebuilt", "closed for repairs", "was first surveyed", "changed hands"]


def make_text(path: Path, megabytes: float, seed: int = 0) -> int:
    """Paragraphs of plain fictional facts, `megabytes` MiB in all (deterministic in `seed`)."""
    rng = random.Random(seed)
    target = int(megabytes * (1 << 20))
    written = 0
    with path.open("w", encoding="utf-8") as f:
        while written < target:
            sentences = []
            for _ in range(rng.randint(4, 9)):
                town = rng.choice(NAMES) + rng.choice(["ford", "ton", "by", " Cross", "wick", " Vale"])
                sentences.append(f"The {rng.choice(THINGS)} of {town} {rng.choice(VERBS)} in {rng.randint(1700, 2020)}, "
                                 f"when {rng.randint(2, 900)} people from {rng.choice(NAMES)} Street came to see it.")
            para = " ".join(sentences) + "\n\n"
            f.write(para)
            written += len(para.encode())
    return written


class Sampler(threading.Thread):
    """RSS of a process and its children every `every` seconds."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.proc, self.every, self.samples = psutil.Process(pid), every, []
        self.t0, self.stop = time.perf_counter(), threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                rss = self.proc.memory_info().rss + sum(c.memory_info().rss for c in self.proc.children(recursive=True))
            except psutil.Error:
                break
            self.samples.append((time.perf_counter() - self.t0, rss))
            self.stop.wait(self.every)


def run_ingest(cmd: list[str], env: dict[str, str], seconds: float, log: Path) -> dict[str, Any]:
    """Run `cmd`, SIGINT after `seconds` (unless it ended), and report its stderr milestones and memory."""
    t0 = time.perf_counter()
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        sampler = Sampler(proc.pid)
        sampler.start()
        first_progress = first_stored = None
        stored_seen = 0
        buf = b""
        killer = threading.Timer(seconds, lambda: proc.poll() is None and proc.send_signal(signal.SIGINT))
        killer.start()
        assert proc.stderr is not None
        while True:
            data = proc.stderr.read1(4096) if hasattr(proc.stderr, "read1") else proc.stderr.read(4096)
            if not data:
                break
            err.write(data)
            buf = (buf + data)[-4096:]
            now = time.perf_counter() - t0
            text = data.decode(errors="replace")
            if first_progress is None and "chunks read" in text:
                first_progress = now
            for m in re.finditer(r"KV stored:\s+\S*\s*\|?[^|]*\|?\s*(\d+)/", text):
                stored_seen = max(stored_seen, int(m.group(1)))
                if first_stored is None and stored_seen > 0:
                    first_stored = now
        code = proc.wait()
        killer.cancel()
        sampler.stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    tail = log.read_bytes().decode(errors="replace").replace("\r", "\n")
    said = [line for line in tail.splitlines() if line.startswith("kvrag:") or line.startswith("ingested")]
    rss = [r for _, r in sampler.samples]
    after_minute = [r for t, r in sampler.samples if t >= 60]
    last_minute = [r for t, r in sampler.samples if t >= wall - 60]
    return {
        "command": " ".join(cmd), "exit": code, "wall_s": round(wall, 1),
        "first_progress_s": None if first_progress is None else round(first_progress, 1),
        "first_kv_stored_s": None if first_stored is None else round(first_stored, 1),
        "kv_stored_bar": stored_seen,
        "peak_rss_mb": round(max(rss) / 2**20) if rss else None,
        "peak_rss_after_first_minute_mb": round(max(after_minute) / 2**20) if after_minute else None,
        "peak_rss_last_minute_mb": round(max(last_minute) / 2**20) if last_minute else None,
        "rss_samples": [(round(t, 1), round(r / 2**20)) for t, r in sampler.samples[::4]],
        "said": said[-3:],
    }


def check_store_and_index(home: Path, store_url: str) -> dict[str, Any]:
    """Every id in the vector index resolves to a KV entry in the store (no index entry without KV)."""
    import chromadb

    from kvrag.cache_backends.admin import open_admin
    from kvrag.cache_backends.admin.base import namespace_of

    admin = open_admin(store_url)
    infos = list(admin.entries())
    chunks = [e for e in infos if e.meta.get("kind") == "chunk"]
    namespaces = sorted({namespace_of(e.meta["model"], e.meta["layout"]) for e in chunks})
    client = chromadb.PersistentClient(path=str(home / "chroma"), settings=chromadb.Settings(anonymized_telemetry=False))
    try:
        ids = client.get_collection("kvrag_chunks").get(include=[])["ids"]
    except Exception:  # noqa: BLE001 - no collection yet: nothing indexed
        ids = []
    store = admin.store
    without_kv = 0
    for start in range(0, len(ids), 512):
        batch = ids[start:start + 512]
        for ns in namespaces or ["?"]:
            keys = store.resolve([f"{ns}/{i}" for i in batch])
            without_kv += sum(1 for k in keys if k is None or not store.contains(k))
    return {"chunk_entries": len(chunks), "store_bytes": sum(e.nbytes for e in infos), "indexed": len(ids),
            "indexed_without_kv": without_kv, "namespaces": len(namespaces)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=20.0)
    ap.add_argument("--interrupt-after", type=float, default=240.0)
    ap.add_argument("--rerun-for", type=float, default=120.0)
    ap.add_argument("--home", type=Path, default=Path("/tmp/kvrag-ingest-soak"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    home = args.home
    for sub in ("kv", "chroma"):
        shutil.rmtree(home / sub, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    text = home / "big.txt"
    nbytes = make_text(text, args.mb)
    store_url = f"disk://{home / 'kv'}?max_bytes=none"
    env = {**os.environ, "KVRAG_HOME": str(home), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "kvrag.cli", "ingest", str(text), "--store", store_url]

    first = run_ingest(cmd, env, args.interrupt_after, home / "first.log")
    after_first = check_store_and_index(home, store_url)
    second = run_ingest(cmd, env, args.rerun_for, home / "rerun.log")
    after_second = check_store_and_index(home, store_url)
    result = {
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {round(psutil.virtual_memory().total / 2**30)} GiB",
        "file_bytes": nbytes, "first_run": first, "after_first_run": after_first,
        "rerun": second, "after_rerun": after_second,
        "ok": (first["exit"] == 130 and after_first["indexed_without_kv"] == 0 and after_second["indexed_without_kv"] == 0
               and after_first["indexed"] > 0 and after_second["indexed"] > after_first["indexed"]),
    }
    md = render(result)
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ingest_soak.json").write_text(json.dumps(result, indent=1))
        (args.out / "ingest_soak.md").write_text(md)
    return 0 if result["ok"] else 1


def render(r: dict[str, Any]) -> str:
    f, s, a, b = r["first_run"], r["rerun"], r["after_first_run"], r["after_rerun"]
    rows = [
        ("file", f"{r['file_bytes'] / 2**20:.1f} MiB of text"),
        ("first progress line on stderr", f"{f['first_progress_s']} s"),
        ("first chunk's KV stored", f"{f['first_kv_stored_s']} s"),
        ("peak memory (whole run / after the first minute / last minute)",
         f"{f['peak_rss_mb']} / {f['peak_rss_after_first_minute_mb']} / {f['peak_rss_last_minute_mb']} MB"),
        ("interrupted (SIGINT) after", f"{f['wall_s']} s, exit {f['exit']}"),
        ("it said", "<br>".join(f["said"]) or "-"),
        ("kept: chunk entries in the store / chunks indexed / indexed without KV",
         f"{a['chunk_entries']} / {a['indexed']} / {a['indexed_without_kv']} ({a['store_bytes'] / 2**30:.2f} GiB)"),
        ("rerun, interrupted after", f"{s['wall_s']} s, exit {s['exit']}; peak {s['peak_rss_mb']} MB"),
        ("rerun said", "<br>".join(s["said"]) or "-"),
        ("after the rerun: entries / indexed / indexed without KV", f"{b['chunk_entries']} / {b['indexed']} / {b['indexed_without_kv']}"),
    ]
    out = ["# `kvrag ingest` of a large file, interrupted and resumed", "",
           f"`python scripts/ingest_soak.py` — {r['hardware']}; bundled model, disk store, the CLI as a user runs it.", "",
           "| what | measured |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in rows]
    out += ["", f"**{'OK' if r['ok'] else 'FAILED'}**: the interrupt kept what was stored, no index entry lacks its KV, the rerun went on."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
