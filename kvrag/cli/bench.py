"""`kvrag bench`, `kvrag eval suite`, `kvrag bench-deviation`, `kvrag bench-store`: the parsers; the work is
in kvrag.cli.bench_run, imported only when a command runs."""

from __future__ import annotations

import argparse
import os

from kvrag.defaults import LAYERWISE_CHOICES
from kvrag.eval.draft_speed import DRAFT_SETS

MODEL_HELP = "HF model id, folder or .gguf (default: $KVRAG_MODEL, else the bundled SmolLM2-135M-Instruct)"
DEVICE_HELP = "auto (CUDA when present), cuda or cpu"
DTYPE_HELP = "auto (bfloat16 on CUDA, float16 where the GPU lacks bf16; float32 elsewhere), float32, bfloat16 or float16"


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="quality and speed of methods x recompute ratios on a JSONL dataset (`bench speed`: TTFT vs context length)",
    )
    bench.add_argument("mode", nargs="?", choices=("quality", "speed", "store", "chat"), default="quality",
                       help="quality (default): a dataset, every setting; speed: TTFT vs context length only; "
                       "store: each store tier's read bandwidth beside plain file reads and host-to-device copies; "
                       "chat: two-turn conversations, turn two with and without the exact prefix cache against Full Attention")
    bench.add_argument("--redis", default=None, help="bench store: also measure this Redis URL")
    bench.add_argument("--tiers-only", action="store_true",
                       help="bench store: only the tier read table, no model (OUT/tiers.md, OUT/tiers.json with the disk ÷ plain read ratio)")
    bench.add_argument("--data", default=None, help="JSONL shaped like shared/data/*.jsonl (default with --quick: the bundled sample)")
    bench.add_argument("--n", type=int, default=100, help="examples (seeded sample)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the sample of examples")
    bench.add_argument("--methods", default=None, help="methods, comma-separated (default: cacheblend,epic,a3,fusionrag,samkv; "
                       "chat: full and the default method)")
    bench.add_argument("--data-dir", default="../shared/data", help="chat: a folder with nq10_dev.jsonl, whose passages "
                       "surround each conversation's document (without it: the set's own documents)")
    bench.add_argument("--no-retrieval", dest="retrieval", action="store_false", help="chat: skip the retrieval section")
    bench.add_argument("--ratios", default="0.05,0.15,0.3", help="recompute ratios, or auto (the engine picks per question; the records hold its choice); speed mode: the first one given, default 0.15")
    bench.add_argument("--similarity", action="store_true", help="also run FusionRAG's similarity-guided entries")
    bench.add_argument("--max-new-tokens", type=int, default=24, help="the most tokens each answer may have")
    bench.add_argument("--contexts", "--context", dest="contexts", default=None,
                       help="context sizes for the TTFT-vs-length sweep, e.g. 512,1k,2k,4k ('none' skips it in quality mode)")
    bench.add_argument("--chunk-tokens", type=int, default=None, help="speed sweep: tokens per chunk (default 400; 128 with --quick)")
    bench.add_argument("--repeats", type=int, default=3, help="speed sweep: repeats per point (medians)")
    bench.add_argument("--layerwise", choices=LAYERWISE_CHOICES, default="auto",
                       help="speed sweep: layer-wise KV loading behind compute; auto: on for CUDA; both: every cached setting with and without")
    bench.add_argument("--tiers", default="auto",
                       help="speed sweep: time each cached setting with its KV from these store tiers: hot (GPU / memory), warm "
                       "(pinned host / host), cold (disk, warm page cache), device (disk, cached pages dropped); auto (default): "
                       "all four on the CUDA default stack's shape under OUT/kv, none when --store is given; none: as it comes")
    bench.add_argument("--decode-tokens", type=int, default=0, help="speed sweep: also decode this many tokens after each setting's prefill and report tokens/s")
    bench.add_argument("--shape", default=None, help="speed mode: a model shape from kvrag/shapes (llama-3.2-1b, llama-3.1-8b, qwen2.5-7b)")
    bench.add_argument("--random-weights", action="store_true", help="speed mode with --shape: build the shape with random weights")
    bench.add_argument("--quick", action="store_true", help="a few examples and small contexts: the whole harness in a few minutes")
    bench.add_argument("--out", required=True, help="output folder (re-running resumes)")
    bench.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help=MODEL_HELP)
    bench.add_argument("--store", default=None, help="KV store URL (default: disk under OUT/kv, removed when the run completes)")
    bench.add_argument("--keep-store", action="store_true", help="keep the default store under OUT/kv after a completed run")
    bench.add_argument("--device", default="auto", help=DEVICE_HELP)
    bench.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    bench.add_argument("--merge", default=None, metavar="DIR,DIR,...",
                       help="no new answers: join the records of runs split across processes into --out and report them")
    bench.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                       help="a model variant with this KVLink adapter, for settings that say model=NAME "
                       "(e.g. --adapter lora5=a.safetensors --methods kvlink:link_tokens=5,model=lora5 --ratios 0)")

    ev = sub.add_parser("eval", help="evaluation suites: `eval suite` decides the default on several kinds of data")
    ev.add_argument("suite", choices=("suite", "storage", "layout", "calibration", "steps"),
                    help="suite: every set at two answer lengths, the rule applied (docs: Methods, how the default is chosen); "
                         "storage: each set answered from float32, bf16 and int8 stores, against float32 storage's answers "
                         "(the first --lengths value); layout: every candidate prompt layout over the sets and two-turn "
                         "conversations, the default layout chosen by the rule (docs/bench/layout); calibration: the model's "
                         "calibrated default against Full Attention on every set and length (README.md and calibration.json); "
                         "steps: a training run's adapter snapshots (--run) against base Full and plain reuse, agreement per step")
    ev.add_argument("--out", required=True, help="output folder (re-running resumes): suite.md/json/png, or storage.md/json/png for eval storage")
    ev.add_argument("--data-dir", default="../shared/data", help="folder with nq10_dev.jsonl, musique_dev.jsonl, kv75_dev.jsonl")
    ev.add_argument("--sets", default=None, help="which sets, comma-separated (default: sample,facts,facts-one,nq10,facts-long,musique,kv75; "
                                                  "eval layout: conversations, conversations-index and those)")
    ev.add_argument("--lengths", default=None, help="answer lengths in new tokens, comma-separated (default 16,64; eval layout: 32)")
    ev.add_argument("--layouts", default=None, help="eval layout: the candidate layouts to answer with (default: every one; v1 always)")
    ev.add_argument("--conversations", type=int, default=None, help="eval layout: the first N two-turn conversations (default: all)")
    ev.add_argument("--n", type=int, default=None, help="questions per set (default: each set's own size)")
    ev.add_argument("--skip", default="", help="eval suite: methods to leave out, comma-separated (e.g. cacheblend,a3,samkv; never full)")
    ev.add_argument("--tuned", default="shipped", help="the reuse-tuned adapter to judge: shipped (the packaged one), a file, or none")
    ev.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help=MODEL_HELP)
    ev.add_argument("--store", default=None, help="KV store URL (default: disk under OUT/kv, removed when the run completes)")
    ev.add_argument("--keep-store", action="store_true", help="keep the default store under OUT/kv after a completed run")
    ev.add_argument("--device", default="auto", help=DEVICE_HELP)
    ev.add_argument("--run", default=None, help="eval steps: training run folders, comma-separated, whose snaps/step-N.safetensors are judged side by side")
    ev.add_argument("--report-only", action="store_true", help="no new answers: the table of what OUT holds so far")
    dv = sub.add_parser("bench-deviation", help="KV deviation from Full Attention: plain vs similarity-guided entries")
    dv.add_argument("--data", required=True, help="a JSONL shaped like shared/data/*.jsonl (PATH@START:END for rows)")
    dv.add_argument("--n", type=int, default=10, help="questions sampled from it")
    dv.add_argument("--seed", type=int, default=0, help="the sample's seed")
    dv.add_argument("--top-n", type=int, default=2, help="similar chunks each similarity-guided entry is computed after")
    dv.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help="HF id, folder or .gguf (default: the bundled model)")
    sb = sub.add_parser("bench-store", help="store latency/throughput and the load share of TTFT")
    sb.add_argument("--out", required=True, help="output folder: store.json, store.md and the plot")
    sb.add_argument("--redis", default=None, help="also measure this Redis URL (e.g. redis://127.0.0.1:6379/0)")
    sb.add_argument("--tiers-only", action="store_true", help="only the tier read table, no model (OUT/tiers.md, OUT/tiers.json)")
    sb.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help=MODEL_HELP)
    dc = sub.add_parser("bench-decode", help="single-stream decode tokens/s: the engine, stock generate, the weights-read bound")
    dc.add_argument("--out", required=True, help="folder for decode.json and decode.md")
    dc.add_argument("--contexts", default="1024,4096", help="context lengths in tokens, comma-separated (default 1024,4096)")
    dc.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    dc.add_argument("--repeats", type=int, default=3, help="interleaved runs per path; medians are reported (default 3)")
    dc.add_argument("--int8", action="store_true",
                    help="also the int8 decode weights (CPU, opt-in): tokens/s, its bound, and its answers against the model's own")
    dc.add_argument("--draft-sets", default=",".join(DRAFT_SETS),
                    help="eval-suite sets whose questions measure the drafts' speed-up and agreement; '' for none (default %(default)s)")
    dc.add_argument("--draft-n", type=int, default=8, help="questions per draft set (default 8)")
    dc.add_argument("--data-dir", default="../shared/data", help="folder with nq10_dev.jsonl, musique_dev.jsonl, kv75_dev.jsonl")
    dc.add_argument("--model", default=os.environ.get("KVRAG_MODEL"), help=MODEL_HELP)
    dc.add_argument("--device", default=None, help="auto (CUDA when present), cuda or cpu")
    dc.set_defaults(func=_run("cmd_bench_decode"))
    bench.set_defaults(func=_run("cmd_bench"))
    ev.set_defaults(func=_eval_command)
    dv.set_defaults(func=_run("cmd_bench_deviation"))
    sb.set_defaults(func=_run("cmd_bench_store"))


def _eval_command(args: argparse.Namespace) -> int:
    if args.suite == "layout":
        from kvrag.cli.eval_layout import cmd_eval_layout

        return cmd_eval_layout(args)
    args.sets = args.sets or "sample,facts,facts-one,nq10,facts-long,musique,kv75"
    args.lengths = args.lengths or "16,64"
    if args.suite == "storage":
        from kvrag.cli.eval_storage import cmd_eval_storage

        return cmd_eval_storage(args)
    if args.suite == "calibration":
        from kvrag.cli.eval_calibration import cmd_eval_calibration

        return cmd_eval_calibration(args)
    if args.suite == "steps":
        from kvrag.cli.eval_steps import cmd_eval_steps

        return cmd_eval_steps(args)
    return _run("cmd_eval_suite")(args)


def _run(name: str):
    def run(args: argparse.Namespace) -> int:
        from kvrag.cli import bench_run

        return getattr(bench_run, name)(args)

    return run
