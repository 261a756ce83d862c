"""`kvrag serve` vs one `kvrag ask` process per question, and the server under 1/2/4/8/16 concurrent clients.

    python scripts/server_bench.py --out runs/server-bench            # 20 questions, 20 `kvrag ask` calls
    python scripts/server_bench.py --out runs/server-bench --quick    # a handful of each: the harness end to end

Everything lives under OUT (its own $KVRAG_HOME: chroma index, disk KV store). The bundled sample
corpus is indexed and ingested through the server, so both paths read the same cached KV; a
server question includes its retrieval (same chroma index, top-k) so the comparison is per question,
end to end. Server TTFT is measured at the client: request sent -> first content piece (SSE),
queueing included. Concurrent answers decode together (kvrag.decode.batch: one forward a step for
every running request), up to --max-concurrency at once. In the same run, single-stream decode
tokens/s of the engine beside stock `generate` (kvrag.eval.decode_speed). Writes OUT/server_bench.json,
OUT/server_bench.md and OUT/server_bench.png (throughput and p50 latency against clients).

The JSON and markdown are rewritten (atomically) after every finished measurement, so a run killed
part-way leaves valid tables of what it finished: `"complete": false` in the JSON and a line
"partial: N of M client counts" in the markdown until the run's end. --tables DIR puts them elsewhere
(a lent GPU's output folder: a step cut at its time limit still returns them).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (also the $KVRAG_HOME of this run)")
    p.add_argument("--quick", action="store_true", help="4 server questions per level, 2 `kvrag ask` calls, 8 new tokens")
    p.add_argument("--n", type=int, default=20, help="questions through the server (per concurrency level)")
    p.add_argument("--cli-n", type=int, default=None, help="`kvrag ask` subprocess calls (default: --n)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="concurrent clients, comma-separated")
    p.add_argument("--max-concurrency", type=int, default=None, help="the server's max_concurrency (default: its own)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--stop-at", default=None, choices=["none", "line", "sentence"], help="the answers' stop rule (default: the server's)")
    p.add_argument("--method", default="reuse")
    p.add_argument("--decode-weights", default=None, choices=["model", "int8"], help="the server's decode weights (default: the model's)")
    p.add_argument("--model", default=None, help="HF id, folder or .gguf (default: bundled SmolLM2); with --shape: the tokenizer's")
    p.add_argument("--shape", default=None, help="serve a model of this shape with random weights (kvrag/shapes/: timing only, "
                   "e.g. llama-3.1-8b on a GPU); answers are then noise, so pass --stop-at none")
    p.add_argument("--dtype", default="auto", help="with --shape: the weights' dtype (default: bfloat16 on CUDA)")
    p.add_argument("--no-decode", action="store_true", help="skip the single-stream decode table (engine vs stock generate)")
    p.add_argument("--no-index", action="store_true", help="pick each question's top-k chunks by shared words instead of the "
                   "chroma index (a machine without chromadb, e.g. a lent GPU; timing only)")
    p.add_argument("--device", default="auto")
    p.add_argument("--server", default=None, help="benchmark this running server instead of starting one (same model and store!)")
    p.add_argument("--tables", default=None, help="folder of server_bench.json and .md, rewritten after each measurement (default: --out)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.max_new_tokens = min(args.n, 4), min(args.max_new_tokens, 8)
        args.cli_n = 2 if args.cli_n is None else args.cli_n
    args.cli_n = args.n if args.cli_n is None else args.cli_n
    if args.shape and (args.cli_n or args.server):
        p.error("--shape serves random weights in this process: pass --cli-n 0 and no --server")
    return args


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (p99 of 20 values is the largest: honest for small samples)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def start_server(args: argparse.Namespace) -> tuple[str, Any]:
    """An in-process `kvrag serve` (uvicorn in a thread) on a free loopback port."""
    import socket

    import uvicorn

    from kvrag.engine import KVRag
    from kvrag.server import ServerSettings, create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = {} if args.max_concurrency is None else {"max_concurrency": args.max_concurrency}
    settings = ServerSettings(port=port, model=args.model, device=args.device, max_queue=64, max_new_tokens=args.max_new_tokens, **extra)
    if args.shape:  # timing only: random weights of a large shape, the tokenizer of --model
        from kvrag.model.loading import load_tokenizer
        from kvrag.model.shapes import random_model

        lm = random_model(args.shape, load_tokenizer(args.model), device=args.device, dtype=args.dtype)
        rag = KVRag(lm, decode_weights=args.decode_weights)
        args.model_label = f"{args.shape} (random weights, {lm.dtype}, {lm.device})"
    else:
        rag = KVRag.from_pretrained(args.model, device=args.device, decode_weights=args.decode_weights)
    args.engine, args.max_concurrency = rag, settings.max_concurrency
    server = uvicorn.Server(uvicorn.Config(create_app(rag, settings), host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    return f"http://127.0.0.1:{port}", server


def serve_while(server: Any, drive: Any) -> None:
    """Serve as `kvrag serve` does while `drive()` runs in another thread, then stop: HTTP in a thread and
    every model call on this thread, which loaded the model (kvrag.server.runner.run_beside_home; a
    server whose worker threads ran the model themselves decoded ~1.6x slower, kvrag.model.home_thread)."""
    from kvrag.server.runner import run_beside_home

    failed: list[BaseException] = []

    def run() -> None:
        try:
            while not server.started:
                time.sleep(0.05)
            drive()
        except BaseException as exc:  # reported by the main thread once the server has stopped
            failed.append(exc)
        finally:
            server.should_exit = True

    driver = threading.Thread(target=run, name="server-bench", daemon=True)
    driver.start()
    run_beside_home(server)
    driver.join()
    if failed:
        raise failed[0]


def stream_question(url: str, question: str, chunk_ids: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One streamed chat completion; client-side TTFT and total time, the engine's stats."""
    body = {"model": "kvrag", "stream": True, "max_tokens": args.max_new_tokens, "messages": [{"role": "user", "content": question}],
            "kvrag": {"chunk_ids": chunk_ids, "method": args.method, **({"stop_at": args.stop_at} if args.stop_at else {})}}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, stats = None, "", {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            piece = event["choices"][0]["delta"].get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
            stats = event.get("kvrag_stats", stats)
    total = time.perf_counter() - t0
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "engine_ttft_s": stats.get("ttft_s"), "text": text,
            "prompt_tokens": stats.get("prompt_tokens"), "generated_tokens": stats.get("generated_tokens")}


class OnHome:
    """An object whose every method runs on the model's home thread (kvrag.model.home_thread), as the
    server runs its own retrieval: a second thread running torch would slow the server's decoding."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        from kvrag.model.home_thread import on_home

        method = getattr(self._obj, name)
        return lambda *args, **kwargs: on_home(method, *args, **kwargs)


class WordOverlap:
    """Top-k chunks by the words they share with the question: retrieval without chromadb, for timing runs."""

    def __init__(self, chunks: list[Any]) -> None:
        self.chunks = chunks
        self.words = [set(re.findall(r"\w+", (c.title + " " + c.text).lower())) for c in chunks]

    def query(self, question: str, k: int) -> list[Any]:
        asked = set(re.findall(r"\w+", question.lower()))
        order = sorted(range(len(self.chunks)), key=lambda i: (-len(asked & self.words[i]), i))
        return [self.chunks[i] for i in order[:k]]


def server_sequential(url: str, index: Any, questions: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per question, end to end as a client sees it: retrieve top-k ids, then ask the server."""
    rows = []
    for q in questions:
        t0 = time.perf_counter()
        ids = [c.id for c in index.query(q, k=args.top_k)]
        r = stream_question(url, q, ids, args)
        rows.append({**r, "wall_s": time.perf_counter() - t0})
    return rows


def cli_calls(questions: list[str], args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    """One `kvrag ask` process per question (model load + retrieval + answer, every time)."""
    rows = []
    for q in questions:
        cmd = [sys.executable, "-m", "kvrag.cli.app", "ask", q, "--method", args.method, "-k", str(args.top_k),
               "--max-new-tokens", str(args.max_new_tokens), "--json", "--device", args.device]
        if args.model:
            cmd += ["--model", args.model]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"kvrag ask failed: {out.stderr[-2000:]}")
        rows.append({"wall_s": wall, "engine_ttft_s": json.loads(out.stdout.strip().splitlines()[-1])["stats"]["ttft_s"]})
    return rows


def concurrent_level(url: str, work: list[tuple[str, list[str]]], clients: int, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        rows = list(pool.map(lambda qi: stream_question(url, qi[0], qi[1], args), work))
    wall = time.perf_counter() - t0
    ttfts = [r["ttft_s"] for r in rows]
    totals = [r["total_s"] for r in rows]
    return {"clients": clients, "requests": len(rows), "wall_s": wall, "throughput_rps": len(rows) / wall,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "latency_p50_s": pct(totals, 50), "latency_p99_s": pct(totals, 99),
            "engine_ttft_p50_s": pct([r["engine_ttft_s"] or 0.0 for r in rows], 50),
            "prompt_tokens_p50": pct([r["prompt_tokens"] or 0 for r in rows], 50),
            "generated_tokens_mean": statistics.fmean([r["generated_tokens"] or 0 for r in rows])}


def measure_levels(url: str, work: list[tuple[str, list[str]]], counts: list[int], args: argparse.Namespace,
                   result: dict[str, Any], save: Callable[[dict[str, Any]], Any]) -> None:
    """Each client count in turn into result["concurrency"], saved after each: a run cut part-way keeps
    the counts it finished."""
    for c in counts:
        batch = [work[i % len(work)] for i in range(max(len(work), 3 * c))]  # every client busy most of the level
        result["concurrency"].append(concurrent_level(url, batch, c, args))
        save(result)


def write_atomic(path: Path, text: str) -> None:
    """Write beside `path`, then rename over it: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_tables(where: Path, result: dict[str, Any]) -> str:
    """server_bench.json and server_bench.md of the result so far; returns the markdown."""
    where.mkdir(parents=True, exist_ok=True)
    write_atomic(where / "server_bench.json", json.dumps(result, indent=2))
    md = markdown(result)
    write_atomic(where / "server_bench.md", md)
    return md


def ceilings(levels: list[dict[str, Any]], step_ms: dict[int, float]) -> dict[str, Any] | None:
    """What batching can give at most on this machine, from this run's own figures: at 1 client an
    answer is its prefill (the engine's TTFT) and its decoding; the server runs one forward at a time
    (and on a CPU a prefill is compute-bound), so N clients' prefills run one after another and N
    clients reach at most latency / prefill x the 1-client
    throughput, however cheap their decoding; and a step for 8 sequences decodes at most
    8 x (1-sequence step) / (8-sequence step) x one sequence's rate."""
    one = next((lv for lv in levels if lv["clients"] == 1), None)
    if one is None or not one["engine_ttft_p50_s"]:
        return None
    out: dict[str, Any] = {"latency_1_s": one["latency_p50_s"], "prefill_1_s": one["engine_ttft_p50_s"],
                           "prefill_bound_x": round(one["latency_p50_s"] / one["engine_ttft_p50_s"], 2),
                           "context_tokens": one["prompt_tokens_p50"], "step_ms": {str(b): ms for b, ms in step_ms.items()}}
    if 1 in step_ms and 8 in step_ms:
        out["decode_bound_8_x"] = round(8 * step_ms[1] / step_ms[8], 2)
    return out


def markdown(result: dict[str, Any]) -> str:
    s, c = result["sequential"], result["concurrency"]
    lines = [
        f"# kvrag serve benchmark ({result['meta']['model']}, method {result['meta']['method']}, "
        f"{result['meta']['max_new_tokens']} new tokens, stop_at {result['meta'].get('stop_at') or 'the server default'}, "
        f"top-{result['meta']['top_k']}, decode weights {result['meta'].get('decode_weights', 'model')})",
        "",
        *partial_line(result),
        "| path | questions | wall per question p50 (s) | mean (s) | engine TTFT p50 (s) |",
        "|---|---|---|---|---|",
    ]
    for name, rows in (("server (retrieve + HTTP)", s["server"]), ("`kvrag ask` subprocess", s["cli"])):
        walls = [r["wall_s"] for r in rows]
        eng = [r["engine_ttft_s"] or 0.0 for r in rows]
        lines.append(f"| {name} | {len(rows)} | {pct(walls, 50):.3f} | {statistics.fmean(walls) if walls else float('nan'):.3f} | {pct(eng, 50):.3f} |")
    base = c[0]["throughput_rps"] if c else float("nan")
    lines += ["", f"Server max_concurrency {result['meta'].get('max_concurrency')}: up to that many answers decode together, "
              "one forward a step (kvrag.decode.batch); more wait in the queue.", "",
              "| concurrent clients | requests | throughput (req/s) | × 1 client | TTFT p50 (s) | TTFT p99 (s) | latency p50 (s) | latency p99 (s) | engine TTFT p50 (s) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for lv in c:
        lines.append(f"| {lv['clients']} | {lv['requests']} | {lv['throughput_rps']:.2f} | {lv['throughput_rps'] / base:.1f}× | "
                     f"{lv['ttft_p50_s']:.3f} | {lv['ttft_p99_s']:.3f} | {lv.get('latency_p50_s', float('nan')):.3f} | "
                     f"{lv.get('latency_p99_s', float('nan')):.3f} | {lv['engine_ttft_p50_s']:.3f} |")
    lines += ["", "TTFT and latency at the client include queueing and retrieval is not counted in them (ids are retrieved before)."]
    cl = result.get("ceilings")
    if cl:
        lines += ["", f"Where the ratio stops on this machine (this run's figures): at 1 client an answer takes {cl['latency_1_s']:.2f} s "
                  f"(p50), {cl['prefill_1_s']:.2f} s of it the engine's prefill (TTFT, {cl['context_tokens']:.0f} prompt tokens). "
                  "The server runs one forward at a time, so concurrent requests' prefills run one after another (on a CPU a "
                  f"prefill keeps every core busy anyway): however cheap their decoding, N clients reach at most "
                  f"{cl['prefill_bound_x']:.1f}x the 1-client throughput."]
        if "decode_bound_8_x" in cl:
            sm = cl["step_ms"]
            lines[-1] += (f" A decode step for 8 sequences (the slot pool's step, kvrag.decode.graphs: replayed from a CUDA graph on a GPU; that context each) took {sm['8']:.1f} ms against "
                          f"{sm['1']:.1f} ms for one: 8 answers decode together at most {cl['decode_bound_8_x']:.1f}x one answer's "
                          "rate without drafts (a lone answer also feeds prompt-lookup drafts, kvrag.decode.draft).")
    d = result.get("decode")
    if d:
        for r in d["rows"]:
            lines += ["", f"Single-stream decode in the same run ({r['context_tokens']} context tokens, {r['new_tokens']} new): "
                      f"the engine {r['engine_tok_s']:.1f} tok/s, stock `generate` {r['generate_tok_s']:.1f} tok/s "
                      f"(weights-read bound {d['bound_tok_s']} tok/s); same tokens: {r['generate_same_tokens']}."]
    return "\n".join(lines) + "\n"


def partial_line(result: dict[str, Any]) -> list[str]:
    """The markdown's mark of an unfinished run (killed, or still running): how many client counts it holds."""
    if result.get("complete", True):
        return []
    planned = len(result.get("planned_client_counts", []))
    return [f"partial: {len(result['concurrency'])} of {planned} client counts "
            "(the run had not finished when these tables were written)", ""]


def plot(result: dict[str, Any], path: Path) -> None:
    """Throughput and p50 latency against concurrent clients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["concurrency"]
    x = [lv["clients"] for lv in c]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(x, [lv["throughput_rps"] for lv in c], "o-", color="tab:blue", label="throughput (req/s)")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("requests/s", color="tab:blue")
    ax.set_xscale("log", base=2)
    ax2 = ax.twinx()
    ax2.plot(x, [lv.get("latency_p50_s", float("nan")) for lv in c], "s--", color="tab:red", label="latency p50 (s)")
    ax2.set_ylabel("latency p50 (s)", color="tab:red")
    ax.set_title(f"kvrag serve, max_concurrency {result['meta'].get('max_concurrency')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["KVRAG_HOME"] = str(out / "home")  # before kvrag reads it: index, KV store and gate verdicts live here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    url, server = (args.server.rstrip("/"), None) if args.server else start_server(args)
    if server is None:
        drive(args, out, url)
    else:
        serve_while(server, lambda: drive(args, out, url))
    return 0


def new_result(args: argparse.Namespace, url: str, model: str, counts: list[int]) -> dict[str, Any]:
    """The run's result before any measurement: its settings and the client counts it plans."""
    return {
        "meta": {"model": model, "method": args.method, "retrieval": "word overlap" if args.no_index else "chroma",
                 "decode_weights": args.decode_weights or "model", "max_new_tokens": args.max_new_tokens, "stop_at": args.stop_at,
                 "top_k": args.top_k, "n": args.n, "cli_n": args.cli_n, "quick": args.quick, "server": url, "cpu_count": os.cpu_count(),
                 "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])},
        "complete": False,
        "planned_client_counts": counts,
        "sequential": {"server": [], "cli": []},
        "concurrency": [],
        "decode": None,
        "ceilings": None,
    }


def finish(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The measurements after the client counts: the batched step's ceilings and (unless --no-decode)
    single-stream decode against stock generate, in this run with the server idle now: the in-process
    engine, or (--server) one loaded here."""
    from kvrag.engine import KVRag
    from kvrag.eval.decode_speed import batched_step_ms, run_decode_bench
    from kvrag.model.home_thread import on_home

    levels = result["concurrency"]
    engine = getattr(args, "engine", None)
    one = next((lv for lv in levels if lv["clients"] == 1), None)
    step_ms: dict[int, float] = {}
    if engine is not None and one is not None:  # in-process server, idle now: its model's batched step
        step_ms = on_home(batched_step_ms, engine.lm.model, int(one["prompt_tokens_p50"]) or 512)
    if not args.no_decode:
        engine = engine or KVRag.from_pretrained(args.model, store="memory://", device=args.device)
        result["decode"] = on_home(run_decode_bench, engine, [1024], new_tokens=64, repeats=2)
    result["ceilings"] = ceilings(levels, step_ms)


def drive(args: argparse.Namespace, out: Path, url: str) -> None:
    """The benchmark against the server at `url`; model work of this process on the model's home thread."""
    from kvrag.ingest.samples import sample_corpus_dir, sample_questions
    from kvrag.ingest.documents import load_documents
    from kvrag.client import ingest_via_server
    from kvrag.model.home_thread import on_home

    chunks = load_documents([sample_corpus_dir()])
    if args.no_index:
        index: Any = WordOverlap(chunks)
    else:
        from kvrag.ingest.retrieval import ChunkIndex

        index = OnHome(on_home(ChunkIndex, out / "home" / "chroma"))  # its embedder is a torch model too
        index.add(chunks)
    report = ingest_via_server(url, chunks)
    print(f"server {url}: ingested {report['chunks']} chunks ({report['computed']} computed)", file=sys.stderr)
    pool = [q["question"] for q in sample_questions()]
    questions = [pool[i % len(pool)] for i in range(args.n)]
    stream_question(url, questions[0], [c.id for c in index.query(questions[0], k=args.top_k)], args)  # warm-up

    model = getattr(args, "model_label", None) or args.model or "bundled SmolLM2-135M-Instruct"
    result = new_result(args, url, model, [int(x) for x in args.concurrency.split(",") if x])
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:  # what the server says it runs with
        result["meta"]["max_concurrency"] = json.loads(resp.read())["queue"]["max_concurrency"]
    tables = Path(args.tables).resolve() if args.tables else out
    save = functools.partial(save_tables, tables)
    result["sequential"]["server"] = server_sequential(url, index, questions, args)
    save(result)
    env = {**os.environ, "KVRAG_HOME": str(out / "home")}
    result["sequential"]["cli"] = cli_calls(questions[: args.cli_n], args, env)
    save(result)
    work = [(q, [c.id for c in index.query(q, k=args.top_k)]) for q in questions]
    measure_levels(url, work, result["planned_client_counts"], args, result, save)
    finish(args, result)
    result["complete"] = True
    md = save_tables(tables, result)
    plot(result, out / "server_bench.png")
    print(md)


if __name__ == "__main__":
    sys.exit(main())
