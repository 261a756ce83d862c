"""The `kvrag` command: ingest, ask, quickstart.

Answers go to stdout, stats and progress to stderr, so `kvrag ask ... > answer.txt` keeps only the answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import resources
from pathlib import Path
from typing import Sequence

from kvrag.errors import KVRagError

DEFAULT_K = 5


def _quiet_libraries() -> None:
    """Model and embedder loads print progress bars and notices that bury our own output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=os.environ.get("KVRAG_STORE"), help="KV store URL (default: disk under $KVRAG_HOME/kv)")
    p.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help="HF model id, folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--collection", default="kvrag_chunks", help="chroma collection under $KVRAG_HOME/chroma")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrag", description="Fast RAG on a local LLM by reusing per-chunk KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    ing = sub.add_parser("ingest", help="split files into chunks, index them and precompute their KV")
    _common(ing)
    ing.add_argument("paths", nargs="+", help=".txt/.md/.jsonl files or folders")
    ing.add_argument("--max-words", type=int, default=120, help="target chunk size in words")
    ing.add_argument("--batch-size", type=int, default=8)

    ask = sub.add_parser("ask", help="answer a question from the ingested chunks")
    _common(ask)
    ask.add_argument("question")
    ask.add_argument("--method", default="reuse", help="full, reuse, ... (see `kvrag methods`)")
    ask.add_argument("--recompute-ratio", type=float, default=0.15)
    ask.add_argument("-k", "--top-k", type=int, default=DEFAULT_K, help="chunks to retrieve")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--json", action="store_true", help="print answer and stats as one JSON object")
    ask.add_argument("--param", action="append", default=[], metavar="K=V", help="a method parameter, e.g. update=fusion")
    ask.add_argument("--evict-budget", type=int, default=None, help="SnapKV: chunk tokens kept per layer/head after the first token")

    qs = sub.add_parser("quickstart", help="ingest the sample corpus and compare Full Attention with KV reuse")
    _common(qs)
    qs.add_argument("--question", default=None)

    sub.add_parser("methods", help="list the available methods")

    bench = sub.add_parser("bench", help="quality and speed of methods x recompute ratios on a JSONL dataset")
    bench.add_argument("--data", required=True, help="JSONL shaped like shared/data/*.jsonl")
    bench.add_argument("--n", type=int, default=100, help="examples (seeded sample)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--methods", default="cacheblend,epic,a3,fusionrag")
    bench.add_argument("--ratios", default="0.05,0.15,0.3")
    bench.add_argument("--similarity", action="store_true", help="also run FusionRAG's similarity-guided entries")
    bench.add_argument("--max-new-tokens", type=int, default=24)
    bench.add_argument("--out", required=True, help="output folder (re-running resumes)")
    bench.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))
    bench.add_argument("--store", default=None, help="KV store URL (default: disk under OUT/kv)")
    bench.add_argument("--device", default="cpu")

    dv = sub.add_parser("bench-deviation", help="KV deviation from Full Attention: plain vs similarity-guided entries")
    dv.add_argument("--data", required=True)
    dv.add_argument("--n", type=int, default=10)
    dv.add_argument("--seed", type=int, default=0)
    dv.add_argument("--top-n", type=int, default=2)
    dv.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))

    sb = sub.add_parser("bench-store", help="store latency/throughput and the load share of TTFT")
    sb.add_argument("--out", required=True)
    sb.add_argument("--redis", default=None, help="also measure this Redis URL (e.g. redis://127.0.0.1:6379/0)")
    sb.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))
    return parser


def _open(args: argparse.Namespace):
    from kvrag.engine import KVRag
    from kvrag.retrieval import ChunkIndex

    home = _home()
    print(f"loading model ({args.model or 'bundled SmolLM2-135M-Instruct'}) ...", file=sys.stderr)
    rag = KVRag.from_pretrained(args.model, store=args.store, device=args.device)
    return rag, ChunkIndex(home / "chroma", collection=args.collection)


def _home() -> Path:
    from kvrag.model import kvrag_home

    return kvrag_home()


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvrag.documents import load_documents

    chunks = load_documents(args.paths, max_words=args.max_words)
    if not chunks:
        print("no text found in the given paths", file=sys.stderr)
        return 1
    rag, index = _open(args)
    index.add(chunks)
    report = rag.precompute(chunks, batch_size=args.batch_size, progress=True)
    print(
        f"ingested {report.chunks} chunks ({report.computed} computed, {report.already_cached} already cached, "
        f"{report.tokens} tokens) in {report.seconds:.1f}s; store {rag.store.url}",
        file=sys.stderr,
    )
    return 0


def _retrieve(index, question: str, k: int):
    chunks = index.query(question, k=k)
    if not chunks:
        raise KVRagError("nothing has been ingested yet: run `kvrag ingest PATH...` first")
    return chunks


def cmd_ask(args: argparse.Namespace) -> int:
    rag, index = _open(args)
    from kvrag.evict import SnapKV
    from kvrag.eval.runner import parse_method

    chunks = _retrieve(index, args.question, args.top_k)
    _, params = parse_method("m:" + ",".join(args.param))
    stream = rag.stream(
        args.question,
        chunks=chunks,
        method=args.method,
        recompute_ratio=args.recompute_ratio,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        evict=SnapKV(budget=args.evict_budget) if args.evict_budget is not None else None,
        **dict(params),
    )
    if args.json:
        ans = stream.answer()
        print(json.dumps({"answer": ans.text, "chunk_ids": ans.chunk_ids, "stats": ans.stats.as_dict()}))
        return 0
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(stream.stats.summary(), file=sys.stderr)
    return 0


def sample_corpus_dir() -> Path:
    return Path(str(resources.files("kvrag") / "sample_corpus"))


def sample_questions() -> list[dict]:
    return json.loads((resources.files("kvrag") / "sample_questions.json").read_text())


def cmd_quickstart(args: argparse.Namespace) -> int:
    from kvrag.documents import load_documents

    rag, index = _open(args)
    chunks = load_documents([sample_corpus_dir()])
    index.add(chunks)
    rag.precompute(chunks, progress=True)
    question = args.question or sample_questions()[0]["question"]
    retrieved = _retrieve(index, question, DEFAULT_K)
    print(f"\nQ: {question}  ({len(retrieved)} chunks retrieved)")
    results = {}
    for method in ("full", "reuse"):
        ans = rag.answer(question, chunks=retrieved, method=method, max_new_tokens=48)
        results[method] = ans
        print(f"[{method:>5}] {ans.text}\n        {ans.stats.summary()}")
    ratio = results["full"].stats.ttft_s / max(results["reuse"].stats.ttft_s, 1e-9)
    print(f"\nTTFT Full Attention / KV reuse: {ratio:.1f}x  (store: {rag.store.url})")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from kvrag.methods import METHODS

    for name, cls in sorted(METHODS.items()):
        print(f"{name:12s} {(cls.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvrag.engine import KVRag
    from kvrag.eval.data import load_examples
    from kvrag.eval.report import markdown_table, summarize, load_records, write_report
    from kvrag.eval.runner import hardware, make_settings, run

    examples = load_examples(args.data, n=args.n, seed=args.seed)
    out = Path(args.out)
    store = args.store or f"disk://{(out / 'kv').resolve()}"
    rag = KVRag.from_pretrained(args.model, store=store, device=args.device)
    methods = [m for m in args.methods.split(",") if m]
    ratios = [float(r) for r in args.ratios.split(",") if r]
    settings = make_settings(methods, ratios, similarity=args.similarity)
    records = run(rag, examples, settings, out, max_new_tokens=args.max_new_tokens)
    meta = {
        "command": "kvrag " + " ".join(sys.argv[1:]),
        "hardware": hardware(),
        "data": args.data,
        "n": len(examples),
        "seed": args.seed,
        "model": rag.lm.source,
    }
    write_report(records, out, meta)
    print(markdown_table(summarize(load_records(records))))
    return 0


def cmd_bench_store(args: argparse.Namespace) -> int:
    from kvrag.eval.store_bench import run_store_bench, store_markdown

    print(store_markdown(run_store_bench(args.out, redis_url=args.redis, model=args.model)))
    return 0


def cmd_bench_deviation(args: argparse.Namespace) -> int:
    from kvrag.engine import KVRag
    from kvrag.eval.data import load_examples
    from kvrag.eval.deviation import deviation_study

    rag = KVRag.from_pretrained(args.model, store="memory://")
    r = deviation_study(rag, load_examples(args.data, n=args.n, seed=args.seed), top_n=args.top_n)
    print(
        f"n={r['n']} top_n={r['top_n']}: layer-1 KV deviation plain {r['layer1_plain']:.3f} -> similarity-guided "
        f"{r['layer1_similarity']:.3f} ({1 - r['layer1_similarity'] / r['layer1_plain']:.0%} lower); all layers "
        f"{r['all_layers_plain']:.2f} -> {r['all_layers_similarity']:.2f} ({1 - r['all_layers_similarity'] / r['all_layers_plain']:.0%} lower)"
    )
    return 0


COMMANDS = {
    "bench-deviation": cmd_bench_deviation,
    "bench-store": cmd_bench_store,
    "ingest": cmd_ingest,
    "ask": cmd_ask,
    "quickstart": cmd_quickstart,
    "methods": cmd_methods,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        return COMMANDS[args.command](args)
    except (KVRagError, ValueError) as exc:
        print(f"kvrag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
