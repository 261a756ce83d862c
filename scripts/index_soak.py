"""Index mode of the fault soak (issue #52): the shared retrieval index under faults.

    python scripts/fault_soak.py --mode index --seconds 60 --threads 2 --out soak-out/index

Two replicas (kvrag's app around a tiny engine each, behind uvicorn on loopback ports, in this process)
share one `chroma run` (the index, started here on a free 127.0.0.1 port over OUT/chroma) and one
redis-server (the KV). The sample corpus's sentences are posted through replica A; then `--threads`
threads ask plain OpenAI requests (no kvrag context: the server retrieves) through A and B in turn,
and a writer thread posts and deletes its own chunks, while a schedule kills the index server (-9)
and restarts it on the same folder, and freezes it (SIGSTOP, SIGCONT).

Every answer must be right (the fault-free reference's sources and text) or a 503 index_unavailable;
a 200 with other sources or none (an answer without its context) is wrong. Afterwards nothing may be
lost: every corpus chunk and every write that got a 200 (and was not deleted) is in the index; every
delete that got a 200 is gone. Writes OUT/index_soak.json and OUT/index_soak.md; exit 1 on a wrong
answer, an unexpected error or a loss.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHROMA_CLI = "import sys; from chromadb.cli.cli import app; sys.argv[0] = 'chroma'; sys.exit(app())"
DOWN_S = 3.0  # how long the index server stays killed (or frozen) in each fault
LINGER_S = 2.0  # a 503 this long after a fault's end still counts as the fault's
TOP_K = 3


class ChromaProcess:
    """`chroma run` on loopback over a folder, which the schedule kills, restarts and freezes."""

    def __init__(self, path: Path, port: int) -> None:
        self.path, self.port, self.proc = path, port, None

    @property
    def url(self) -> str:
        return f"chroma://127.0.0.1:{self.port}/soak_chunks"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHROMA_CLI, "run", "--path", str(self.path), "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from soak_faults import wait_for_port

        wait_for_port(self.port, 60, "chroma run")

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)


class Replica:
    """kvrag's app around its own tiny engine, on uvicorn in a thread."""

    def __init__(self, store_url: str, index_url: str) -> None:
        import uvicorn

        from fault_soak import build_engine
        from kvrag.ingest.retrieval import ChunkIndex
        from kvrag.server import ServerSettings, create_app
        from soak_faults import free_port

        settings = ServerSettings(max_new_tokens=8, max_concurrency=4, max_queue=64, top_k=TOP_K)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(build_engine("tiny", store_url), settings, ChunkIndex(url=index_url))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class Answer:
    thread: int
    replica: str
    question: int
    t0: float
    t1: float
    status: int
    code: str | None
    verdict: str = ""  # right / refused / wrong / error
    sources: list[str] | None = None  # kept for a wrong answer: what it read


def judge(sources: list[str] | None, text: str | None, reference: tuple[list[str], str]) -> str:
    """"right" or "wrong" for a 200: it must read the reference's corpus chunks, in order (a writer's
    chunk, w..., may take a place in the top-k: the index changed, and then the text may too), and
    with the reference's sources exactly, give its text. No sources at all (an answer without its
    context) is wrong."""
    ref_sources, ref_text = reference
    if not sources:
        return "wrong"
    corpus = [s for s in sources if not s.startswith("w")]
    if corpus != ref_sources[: len(corpus)]:
        return "wrong"
    if sources == ref_sources and text != ref_text:
        return "wrong"
    return "right"


def _chat(http: Any, url: str, question: str) -> tuple[int, str | None, list[str] | None, str | None]:
    r = http.post(url + "/v1/chat/completions", json={"model": "kvrag", "messages": [{"role": "user", "content": question}],
                                                      "max_tokens": 8, "temperature": 0})
    body = r.json()
    if r.status_code != 200:
        return r.status_code, (body.get("error") or {}).get("code"), None, None
    return 200, None, [s["id"] for s in body.get("kvrag_sources") or []], body["choices"][0]["message"]["content"]


def run_index_soak(seconds: float = 60.0, threads: int = 2, out: str | Path = "soak-out/index", every: float = 12.0) -> dict:
    import httpx

    from fault_soak import QUESTIONS, corpus
    from kvrag.ingest.retrieval import ChunkIndex
    from soak_faults import RedisProcess, free_port

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chroma, redis = ChromaProcess(out / "chroma", free_port()), RedisProcess()
    chroma.start()
    redis.start()
    replicas = {"A": Replica(redis.url, chroma.url), "B": Replica(redis.url, chroma.url)}
    http = httpx.Client(timeout=60, trust_env=False)
    try:
        chunks = corpus(20)
        r = http.post(replicas["A"].url + "/v1/chunks", json={"chunks": [{"id": c.id, "text": c.text, "title": c.title} for c in chunks]})
        assert r.status_code == 200, r.text
        reference = {}
        for name, rep in replicas.items():
            for qi, q in enumerate(QUESTIONS):
                status, _, sources, text = _chat(http, rep.url, q)
                assert status == 200 and sources, f"fault-free reference failed on {name}: {status}"
                reference[(name, qi)] = (sources, text)
        same_across = all(reference[("A", qi)] == reference[("B", qi)] for qi in range(len(QUESTIONS)))

        answers: list[Answer] = []
        writes: list[dict] = []
        faults: list[dict] = []
        stop = threading.Event()
        t_start = time.monotonic()
        lock = threading.Lock()

        def reader(tid: int) -> None:
            client = httpx.Client(timeout=60, trust_env=False)
            n = tid
            while not stop.is_set():
                name, qi = "AB"[n % 2], (n // 2) % len(QUESTIONS)
                t0 = time.monotonic() - t_start
                try:
                    status, code, sources, text = _chat(client, replicas[name].url, QUESTIONS[qi])
                except Exception as exc:  # noqa: BLE001 - recorded, not raised: the soak counts it
                    status, code, sources, text = -1, type(exc).__name__, None, None
                a = Answer(tid, name, qi, t0, time.monotonic() - t_start, status, code)
                if status == 200:
                    a.verdict = judge(sources, text, reference[(name, qi)])
                    a.sources = sources if a.verdict == "wrong" else None
                elif status == 503 and code == "index_unavailable":
                    a.verdict = "refused"
                    stop.wait(0.1)  # a client backing off (the answer says Retry-After), not a spin
                else:
                    a.verdict = "error"
                with lock:
                    answers.append(a)
                n += threads

        def writer() -> None:
            client = httpx.Client(timeout=60, trust_env=False)
            n = 0
            while not stop.is_set():
                name = "AB"[n % 2]
                chunk_id = f"w{n:04d}"
                # digits only: far from every question, so readers' top-k never changes
                text = " ".join(f"{(n * 7919 + i * 104729) % 100000:05d}" for i in range(12))
                t0 = time.monotonic() - t_start
                try:
                    r = client.post(replicas[name].url + "/v1/chunks", json={"chunks": [{"id": chunk_id, "text": text, "title": "ledger"}]})
                    writes.append({"op": "post", "id": chunk_id, "via": name, "t": round(t0, 2), "status": r.status_code})
                    if n % 3 == 2:  # delete an earlier write through the other replica
                        gone = f"w{n - 2:04d}"
                        r = client.delete(replicas["BA"[n % 2]].url + f"/v1/chunks/{gone}")
                        writes.append({"op": "delete", "id": gone, "via": "BA"[n % 2], "t": round(time.monotonic() - t_start, 2),
                                       "status": r.status_code})
                except httpx.HTTPError as exc:  # recorded as a write with no status: counted as an error below
                    writes.append({"op": "post", "id": chunk_id, "via": name, "t": round(t0, 2), "status": -1, "error": repr(exc)})
                n += 1
                time.sleep(0.2)

        def schedule() -> None:
            k = 0
            while not stop.wait(max(0.0, every * (k + 1) - (time.monotonic() - t_start))):
                if time.monotonic() - t_start + DOWN_S + 1 > seconds:
                    return
                kind = ("kill -9, restart on the same folder", "SIGSTOP, then SIGCONT")[k % 2]
                t0 = time.monotonic() - t_start
                if k % 2 == 0:
                    chroma.kill9()
                    time.sleep(DOWN_S)
                    chroma.start()
                else:
                    chroma.signal(signal.SIGSTOP)
                    time.sleep(DOWN_S)
                    chroma.signal(signal.SIGCONT)
                faults.append({"kind": kind, "start": round(t0, 2), "end": round(time.monotonic() - t_start, 2)})
                k += 1

        workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
        workers += [threading.Thread(target=writer), threading.Thread(target=schedule)]
        for w in workers:
            w.start()
        time.sleep(seconds)
        stop.set()
        for w in workers:
            w.join(120)

        # afterwards, fault-free: nothing lost, and the readers' answers are still the reference's
        index = ChunkIndex(url=chroma.url)
        posted = {w["id"] for w in writes if w["op"] == "post" and w["status"] == 200}
        deleted = {w["id"] for w in writes if w["op"] == "delete" and w["status"] == 200}
        present = {c.id for c in index.get([c.id for c in chunks] + sorted(posted | deleted))}
        lost = sorted(({c.id for c in chunks} | (posted - deleted)) - present)
        resurrected = sorted(deleted & present)
        after = all(judge(*_chat(http, rep.url, q)[2:], reference[(name, qi)]) == "right"
                    for name, rep in replicas.items() for qi, q in enumerate(QUESTIONS))
    finally:
        http.close()
        for rep in replicas.values():
            rep.stop()
        chroma.signal(signal.SIGCONT)
        chroma.kill9()
        redis.close()

    def in_fault(a: Answer) -> bool:
        return any(f["start"] <= a.t1 and a.t0 <= f["end"] + LINGER_S for f in faults)

    counts = {v: sum(a.verdict == v for a in answers) for v in ("right", "refused", "wrong", "error")}
    refused_outside = sum(a.verdict == "refused" and not in_fault(a) for a in answers)
    refused_ms = sorted((a.t1 - a.t0) * 1000 for a in answers if a.verdict == "refused")
    summary = {
        "seconds": seconds, "threads": threads, "answers": len(answers), **counts, "refused_outside_faults": refused_outside,
        "refused_p50_ms": round(refused_ms[len(refused_ms) // 2], 1) if refused_ms else None,
        "refused_max_ms": round(refused_ms[-1], 1) if refused_ms else None,
        "writes": sum(w["op"] == "post" for w in writes), "writes_ok": len(posted), "writes_503": sum(w["status"] == 503 for w in writes if w["op"] == "post"),
        "deletes": sum(w["op"] == "delete" for w in writes), "deletes_ok": len(deleted),
        "write_errors": sum(w["status"] not in (200, 404, 409, 503) for w in writes), "lost": lost, "resurrected": resurrected,
        "faults": len(faults), "replicas_agree": same_across, "reference_after": after,
    }
    res = {"summary": summary, "faults": faults, "answers": [asdict(a) for a in answers], "writes": writes}
    (out / "index_soak.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "index_soak.md").write_text(md)
    print(md)
    return res


def markdown(res: dict) -> str:
    s = res["summary"]
    lines = [f"## Index fault soak: {s['seconds']:.0f} s, {s['threads']} reader threads over 2 replicas, 1 writer", "",
             "| answers | right | 503 index_unavailable | wrong | other errors | 503 outside a fault | 503 p50 / max |",
             "|---|---|---|---|---|---|---|",
             f"| {s['answers']} | {s['right']} | {s['refused']} | {s['wrong']} | {s['error']} | {s['refused_outside_faults']} | "
             f"{s['refused_p50_ms']} / {s['refused_max_ms']} ms |", "",
             f"Writes: {s['writes']} posts ({s['writes_ok']} ok, {s['writes_503']} refused with 503), {s['deletes']} deletes "
             f"({s['deletes_ok']} ok), {s['write_errors']} other write errors. After the soak: lost {len(s['lost'])}, deleted but present {len(s['resurrected'])}; "
             f"every reference answer again: {s['reference_after']}.", "", "Faults:"]
    lines += [f"- {f['start']:.1f}-{f['end']:.1f} s: {f['kind']}" for f in res["faults"]]
    return "\n".join(lines) + "\n"


def passed(res: dict) -> bool:
    s = res["summary"]
    return s["wrong"] == 0 and s["error"] == 0 and s["write_errors"] == 0 and not s["lost"] and not s["resurrected"] and s["reference_after"]
