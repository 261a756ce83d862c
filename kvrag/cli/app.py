"""The `kvrag` command: ingest, ask, quickstart.

Answers go to stdout, stats and progress to stderr, so `kvrag ask ... > answer.txt` keeps only the answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from kvrag.ingest.documents import DEFAULT_MAX_CHUNK_TOKENS
from kvrag.cli.args import link_adapter_arg, positive_int, ratio_or_auto
from kvrag.errors import KVRagError
from kvrag.defaults import (
    DEFAULT_METHOD,
    DEFAULT_MIN_RECOMPUTE,
    DEFAULT_RATIO,
    DEFAULT_SHORT_CONTEXT,
    DEFAULT_STOP_AT,
    LAYERWISE_CHOICES,
    RATIO_FREE,
    STOP_RULES,
    TUNED_METHOD,
)
from kvrag.ingest.samples import sample_corpus_dir, sample_questions
from kvrag.quiet import quiet_libraries

DEFAULT_K = 5


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default=os.environ.get("KVRAG_STORE"), help="KV store URL (default: disk under $KVRAG_HOME/kv)")
    p.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help="HF model id, folder or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cuda or cpu")
    p.add_argument("--collection", default="kvrag_chunks", help="chroma collection under $KVRAG_HOME/chroma")
    p.add_argument("--link-adapter", default="auto", type=link_adapter_arg,
                   help="auto/links: the link embeddings shipped for the model (base weights); tuned: the shipped "
                        "reuse-tuned LoRA on kvlink's fast path (kvlink by default; Full Attention stays the base "
                        "weights); none: no adapter; or an adapter file")


def _server_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", default=os.environ.get("KVRAG_SERVER"),
                   help="URL of a running `kvrag serve` (default: $KVRAG_SERVER): no model is loaded here")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrag", description="Fast RAG on a local LLM by reusing per-chunk KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    ing = sub.add_parser("ingest", help="split files into chunks, index them and precompute their KV")
    _common(ing)
    _server_option(ing)
    ing.add_argument("paths", nargs="+", help=".txt/.md/.jsonl files or folders")
    ing.add_argument("--max-words", type=int, default=120, help="target chunk size in words (default 120)")
    ing.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_CHUNK_TOKENS,
                     help=f"hard cap on a chunk's tokens (default {DEFAULT_MAX_CHUNK_TOKENS})")
    ing.add_argument("--batch-size", type=positive_int, default=8, help="chunks per forward pass (default 8)")
    ing.add_argument("--follow-symlinks", action="store_true",
                     help="in folders, follow symlinks that lead out of the folder (default: skipped and named; "
                          "a file named on the command line is always read)")

    rm = sub.add_parser("remove", help="remove ingested documents: their chunks from the index and their KV from the store",
                        epilog="example: kvrag remove notes.md")
    _common(rm)
    rm.add_argument("paths", nargs="+", help="files given to `kvrag ingest` (as they were given)")

    ask = sub.add_parser("ask", help="answer a question from the ingested chunks")
    _common(ask)
    _server_option(ask)
    ask.add_argument("question")
    ask.add_argument("--method", default=None,
                     help=f"full, reuse, ... (see `kvrag methods`; default: {DEFAULT_METHOD}, or {TUNED_METHOD} with --link-adapter tuned)")
    ask.add_argument("--recompute-ratio", type=ratio_or_auto, default=DEFAULT_RATIO, help=f"share of chunk tokens recomputed, or 'auto' (default {DEFAULT_RATIO})")
    ask.add_argument("--min-recompute", type=int, default=None, metavar="TOKENS",
                     help=f"chunk tokens recomputed at least; chunks holding no more are read with Full Attention (0: off; default {DEFAULT_MIN_RECOMPUTE})")
    ask.add_argument("--short-context", type=int, default=None, metavar="TOKENS",
                     help=f"contexts of at most this many chunk tokens are read with Full Attention by every method (0: off; default {DEFAULT_SHORT_CONTEXT})")
    ask.add_argument("--stop-at", choices=STOP_RULES, default=DEFAULT_STOP_AT, help=f"end the answer after its first sentence or line (default {DEFAULT_STOP_AT})")
    ask.add_argument("-k", "--top-k", type=positive_int, default=DEFAULT_K, help=f"chunks to retrieve (default {DEFAULT_K})")
    ask.add_argument("--max-new-tokens", type=int, default=64)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--json", action="store_true", help="print answer and stats as one JSON object")
    ask.add_argument("--param", action="append", default=[], metavar="K=V", help="a method parameter, e.g. update=fusion")
    ask.add_argument("--evict-budget", type=int, default=None, help="SnapKV: chunk tokens kept per layer/head after the first token")

    qs = sub.add_parser("quickstart", help="ingest the sample corpus and compare Full Attention with KV reuse")
    _common(qs)
    qs.add_argument("--question", default=None)

    sub.add_parser("methods", help="list the available methods")

    bench = sub.add_parser(
        "bench",
        help="quality and speed of methods x recompute ratios on a JSONL dataset (`bench speed`: TTFT vs context length)",
    )
    bench.add_argument("mode", nargs="?", choices=("quality", "speed", "store"), default="quality",
                       help="quality (default): a dataset, every setting; speed: TTFT vs context length only; "
                       "store: each store tier's read bandwidth beside plain file reads and host-to-device copies")
    bench.add_argument("--redis", default=None, help="bench store: also measure this Redis URL")
    bench.add_argument("--data", default=None, help="JSONL shaped like shared/data/*.jsonl (default with --quick: the bundled sample)")
    bench.add_argument("--n", type=int, default=100, help="examples (seeded sample)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--methods", default="cacheblend,epic,a3,fusionrag,samkv")
    bench.add_argument("--ratios", default="0.05,0.15,0.3", help="recompute ratios, or auto (the engine picks per question; the records hold its choice); speed mode: the first one given, default 0.15")
    bench.add_argument("--similarity", action="store_true", help="also run FusionRAG's similarity-guided entries")
    bench.add_argument("--max-new-tokens", type=int, default=24)
    bench.add_argument("--contexts", "--context", dest="contexts", default=None,
                       help="context sizes for the TTFT-vs-length sweep, e.g. 512,1k,2k,4k ('none' skips it in quality mode)")
    bench.add_argument("--chunk-tokens", type=int, default=None, help="speed sweep: tokens per chunk (default 400; 128 with --quick)")
    bench.add_argument("--repeats", type=int, default=3, help="speed sweep: repeats per point (medians)")
    bench.add_argument("--layerwise", choices=LAYERWISE_CHOICES, default="auto",
                       help="speed sweep: layer-wise KV loading behind compute; auto: on for CUDA; both: every cached setting with and without")
    bench.add_argument("--decode-tokens", type=int, default=0, help="speed sweep: also decode this many tokens after each setting's prefill and report tokens/s")
    bench.add_argument("--shape", default=None, help="speed mode: a model shape from kvrag/shapes (llama-3.2-1b, llama-3.1-8b, qwen2.5-7b)")
    bench.add_argument("--random-weights", action="store_true", help="speed mode with --shape: build the shape with random weights")
    bench.add_argument("--quick", action="store_true", help="a few examples and small contexts: the whole harness in a few minutes")
    bench.add_argument("--out", required=True, help="output folder (re-running resumes)")
    bench.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))
    bench.add_argument("--store", default=None, help="KV store URL (default: disk under OUT/kv)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--dtype", default="auto")
    bench.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                       help="no new answers: join the records of runs split across processes into --out and report them")
    bench.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                       help="a model variant with this KVLink adapter, for settings that say model=NAME "
                       "(e.g. --adapter lora5=a.safetensors --methods kvlink:link_tokens=5,model=lora5 --ratios 0)")

    ev = sub.add_parser("eval", help="evaluation suites: `eval suite` decides the default on several kinds of data")
    ev.add_argument("suite", choices=("suite",), help="suite: every set at two answer lengths, the rule applied (README Defaults)")
    ev.add_argument("--out", required=True, help="output folder (re-running resumes): suite.md, suite.json, suite.png")
    ev.add_argument("--data-dir", default="../shared/data", help="folder with nq10_dev.jsonl, musique_dev.jsonl, kv75_dev.jsonl")
    ev.add_argument("--sets", default="sample,facts,facts-one,nq10,facts-long,musique,kv75", help="which sets, comma-separated")
    ev.add_argument("--lengths", default="16,64", help="answer lengths in new tokens, comma-separated")
    ev.add_argument("--n", type=int, default=None, help="questions per set (default: each set's own size)")
    ev.add_argument("--tuned", default="shipped", help="the reuse-tuned adapter to judge: shipped (the packaged one), a file, or none")
    ev.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))
    ev.add_argument("--store", default=None, help="KV store URL (default: disk under OUT/kv)")
    ev.add_argument("--device", default="auto")
    ev.add_argument("--report-only", action="store_true", help="no new answers: the table of what OUT holds so far")

    from kvrag.cli.check import add_check_model_parser

    add_check_model_parser(sub)
    from kvrag.cli.train import add_train_links_parser

    add_train_links_parser(sub)
    demo = sub.add_parser("demo", help="the Streamlit demo: ask, compare with Full Attention, see what was recomputed")
    demo.add_argument("--port", type=int, default=8501)
    demo.add_argument("--address", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    demo.add_argument("--allow-store-host", action="append", default=[], metavar="HOST",
                      help="a non-loopback Redis host the demo's store box may use (repeatable; default: loopback only)")

    dv = sub.add_parser("bench-deviation", help="KV deviation from Full Attention: plain vs similarity-guided entries")
    dv.add_argument("--data", required=True)
    dv.add_argument("--n", type=int, default=10)
    dv.add_argument("--seed", type=int, default=0)
    dv.add_argument("--top-n", type=int, default=2)
    dv.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))

    from kvrag.cli.serve import add_serve_parser

    add_serve_parser(sub)
    sb = sub.add_parser("bench-store", help="store latency/throughput and the load share of TTFT")
    sb.add_argument("--out", required=True)
    sb.add_argument("--redis", default=None, help="also measure this Redis URL (e.g. redis://127.0.0.1:6379/0)")
    sb.add_argument("--model", default=os.environ.get("KVRAG_MODEL"))
    from kvrag.cli.store import add_store_parser

    add_store_parser(sub)
    for name, sub_parser in sub.choices.items():  # every --help shows defaults and one example
        sub_parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
        if not sub_parser.epilog and name in EXAMPLES:
            sub_parser.epilog = f"example: {EXAMPLES[name]}"
    return parser


EXAMPLES = {
    "ingest": "kvrag ingest docs/ notes.md --store redis://127.0.0.1:6379/0",
    "ask": 'kvrag ask "When did the Brannoch Line open?" --method a3 --recompute-ratio auto --json',
    "quickstart": "kvrag quickstart --question \"Who built the Brannoch Line?\"",
    "methods": "kvrag methods",
    "bench": "kvrag bench --data ../shared/data/nq10_dev.jsonl --n 100 --ratios 0.15 --out bench-out/nq10",
    "demo": "kvrag demo --port 8501",
    "bench-deviation": "kvrag bench-deviation --data ../shared/data/nq10_dev.jsonl --n 10",
    "bench-store": "kvrag bench-store --out bench-out/store",
    "check-model": "kvrag check-model /path/to/model --device cuda --dtype bfloat16",
    "train-links": "kvrag train-links --data ../shared/data/nq10_dev.jsonl --mode links --out runs/links",
}


def _open(args: argparse.Namespace):
    from kvrag.engine import KVRag
    from kvrag.ingest.retrieval import ChunkIndex

    home = _home()
    print(f"loading model ({args.model or 'bundled SmolLM2-135M-Instruct'}) ...", file=sys.stderr)
    rag = KVRag.from_pretrained(args.model, store=args.store, device=args.device, link_adapter=args.link_adapter)
    return rag, ChunkIndex(home / "chroma", collection=args.collection)


def _home() -> Path:
    from kvrag.defaults import kvrag_home

    return kvrag_home()


def _index(args: argparse.Namespace):
    from kvrag.ingest.retrieval import ChunkIndex

    return ChunkIndex(_home() / "chroma", collection=args.collection)


def cmd_ingest(args: argparse.Namespace) -> int:
    """Check every file before any model loads, then chunk, store and index in streamed batches (kvrag.cli.ingest)."""
    from kvrag.cli.ingest import run_ingest

    return run_ingest(args, lambda: _open(args), lambda: _index(args))


def _ask_via_server(args: argparse.Namespace, params: dict) -> int:
    from kvrag.client import ask_via_server

    if args.evict_budget is not None:
        raise KVRagError("--evict-budget is not available through --server")
    chunks = _retrieve(_index(args), args.question, args.top_k)
    text, stats = ask_via_server(args.server, args.question, chunks=chunks, method=args.method, recompute_ratio=args.recompute_ratio,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, params=params)
    if args.json:
        print(json.dumps({"answer": text, "chunk_ids": [c.id for c in chunks], "stats": stats.as_dict()}))
    else:
        print(text)
        print(stats.summary(), file=sys.stderr)
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    rag, index = _open(args)
    removed = 0
    for path in args.paths:
        gone = index.remove(source=str(path))
        deleted = rag.forget(gone)
        removed += len(gone)
        print(f"{path}: {len(gone)} chunks removed from the index, {deleted} KV entries deleted", file=sys.stderr)
    return 0 if removed else 1


def _retrieve(index, question: str, k: int):
    chunks = index.query(question, k=k)
    if not chunks:
        raise KVRagError("nothing has been ingested yet: run `kvrag ingest PATH...` first")
    return chunks


def cmd_ask(args: argparse.Namespace) -> int:
    from kvrag.methods.snapkv import SnapKV
    from kvrag.eval.runner import parse_method

    from kvrag.methods import get_method

    _, params = parse_method("m:" + ",".join(args.param))

    def check(method: str) -> None:  # a mistyped method or parameter is a one-line error, not a traceback
        try:
            get_method(method, **dict(params))
        except TypeError as exc:
            raise KVRagError(str(exc)) from None

    if args.method is not None:
        check(args.method)  # before any work
    if args.server:
        return _ask_via_server(args, dict(params))  # no method named: the server's, which checks the parameters
    rag, index = _open(args)
    if args.method is None:
        check(rag.default_method)  # the parameters belong to the engine's default method
    chunks = _retrieve(index, args.question, args.top_k)
    stream = rag.stream(
        args.question,
        chunks=chunks,
        method=args.method,
        recompute_ratio=args.recompute_ratio,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        stop_at=args.stop_at,
        min_recompute=args.min_recompute,
        short_context=args.short_context,
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


def cmd_quickstart(args: argparse.Namespace) -> int:
    from kvrag.ingest.documents import load_documents

    rag, index = _open(args)
    chunks = load_documents([sample_corpus_dir()])
    index.add(chunks)
    rag.precompute(chunks, progress=True)
    question = args.question or sample_questions()[0]["question"]
    retrieved = _retrieve(index, question, DEFAULT_K)
    print(f"\nQ: {question}  ({len(retrieved)} chunks retrieved)")
    for line in compare_with_full(rag, question, retrieved, ("full", "reuse", rag.default_method)):
        print(line)
    print(f"(store: {rag.store.url}; 'agrees' = same answer as Full Attention after normalising; "
          "KL = first-token KL divergence from Full Attention, 0 is identical)")
    return 0


def compare_with_full(rag, question: str, chunks, methods) -> list[str]:
    """One line per method: its answer, TTFT speed-up over Full Attention, and how close the answer is
    to Full Attention's (never a speed-up without the quality beside it)."""
    from kvrag.eval.metrics import agreement, first_token_kl

    full = rag.prefill(question, chunks=chunks, method="full")
    full_text = rag.decode(full).answer().text
    lines = []
    for method in methods:
        pre = full if method == "full" else rag.prefill(question, chunks=chunks, method=method)
        text = full_text if method == "full" else rag.decode(pre).answer().text
        speedup = full.stats.ttft_s / max(pre.stats.ttft_s, 1e-9)
        quality = "reference" if method == "full" else (
            f"{'agrees' if agreement(text, full_text) else 'DIFFERS'}, KL {first_token_kl(full.logits, pre.logits):.3f}"
        )
        label = method if method in RATIO_FREE else f"{method}@{DEFAULT_RATIO:g}"
        lines.append(f"[{label:>15}] {text}\n{'':18}TTFT {pre.stats.ttft_s * 1000:.0f} ms, {speedup:.1f}x vs Full; {quality}")
    return lines


def cmd_methods(args: argparse.Namespace) -> int:
    from kvrag.methods import METHODS

    for name, cls in sorted(METHODS.items()):
        print(f"{name:12s} {(cls.__doc__ or '').strip().splitlines()[0]}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kvrag.cli.bench import cmd_bench as bench

    return bench(args)


def cmd_check_model(args: argparse.Namespace) -> int:
    from kvrag.cli.check import cmd_check_model as check

    return check(args)


def cmd_train_links(args: argparse.Namespace) -> int:
    from kvrag.cli.train import cmd_train_links as train

    return train(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvrag.demo.launch import launch

    print(f"kvrag demo on http://{args.address}:{args.port} (Ctrl-C stops it)", file=sys.stderr)
    return launch(port=args.port, address=args.address, allow_store_hosts=args.allow_store_host or None)


def cmd_bench_store(args: argparse.Namespace) -> int:
    from kvrag.eval.store_bench import run_store_bench, store_markdown

    print(store_markdown(run_store_bench(args.out, redis_url=args.redis, model=args.model)))
    return 0


def cmd_suite(args: argparse.Namespace) -> int:
    from kvrag.cli.bench import cmd_eval_suite

    return cmd_eval_suite(args)


def cmd_bench_deviation(args: argparse.Namespace) -> int:
    from kvrag.cli.bench import cmd_bench_deviation as deviation

    return deviation(args)


COMMANDS = {
    "bench-deviation": cmd_bench_deviation,
    "bench-store": cmd_bench_store,
    "check-model": cmd_check_model,
    "demo": cmd_demo,
    "train-links": cmd_train_links,
    "ingest": cmd_ingest,
    "remove": cmd_remove,
    "ask": cmd_ask,
    "quickstart": cmd_quickstart,
    "methods": cmd_methods,
    "bench": cmd_bench,
    "eval": cmd_suite,
    "serve": lambda args: _serve(args),
    "store": lambda args: _store(args),
}


def _store(args: argparse.Namespace) -> int:
    from kvrag.cli.store import cmd_store

    return cmd_store(args)


def _serve(args: argparse.Namespace) -> int:
    from kvrag.cli.serve import cmd_serve

    return cmd_serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    try:
        return COMMANDS[args.command](args)
    except (KVRagError, ValueError) as exc:
        print(f"kvrag: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
