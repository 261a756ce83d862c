"""The `kvrag bench` and `kvrag bench-deviation` commands: quality runs, --merge, the TTFT sweeps.

kvrag's CLI (`kvrag.cli.app`) parses the arguments and hands them here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvrag.cache_backends.disk_cleanup import MARKER, mark_created, remove_created

from kvrag.engine import KVRag
from kvrag.errors import AdapterMismatchError, KVRagError
from kvrag.eval.data import load_examples, sample_examples
from kvrag.eval.deviation import deviation_study
from kvrag.eval.report import load_records, markdown_table, merge_records, summarize, write_report
from kvrag.eval.runner import Setting, hardware, make_settings, parse_method, run, split_methods
from kvrag.eval.store_bench import run_store_bench, store_markdown, tier_bandwidth, write_tiers
from kvrag.eval.speed import RANDOM_WEIGHTS_NOTE, SweepOptions, parse_sizes, random_model, speed_markdown, speed_sweep, write_speed
from kvrag.eval.speed_tiers import parse_tiers, plan_tiers, tier_stack_url
from kvrag.model.loading import load_tokenizer, resolve_device

QUICK = {"n": 4, "ratios": "0.15,0.3", "max_new_tokens": 8, "contexts": "256,512,1k", "chunk_tokens": 128, "repeats": 1}


# Benchmarks measure the base weights (with the shipped link embeddings for `kvlink` rows), as every
# published table did; a tuned model is a named variant: --adapter tuned=PATH, --methods "full:model=tuned,...".
BASE_WEIGHTS = "links"

def _bench_defaults(args: argparse.Namespace) -> None:
    """--quick shrinks every knob the user did not set (the harness end to end in a few minutes)."""
    if not args.quick:
        args.contexts = args.contexts or "1k,2k,4k"
        args.chunk_tokens = args.chunk_tokens or 400
        return
    given = {a.split("=", 1)[0] for a in args.argv}
    for key, value in QUICK.items():
        if f"--{key.replace('_', '-')}" not in given:
            setattr(args, key, value)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.mode == "store":  # each tier's read bandwidth beside plain file reads and host-to-device copies
        return cmd_bench_store(args)
    if args.mode == "chat":
        return _bench_chat(args)
    _bench_defaults(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = split_methods(args.methods or "cacheblend,epic,a3,fusionrag,samkv")
    ratios: list[float | str] = [r if r == "auto" else float(r) for r in args.ratios.split(",") if r]
    meta = {"command": "kvrag " + " ".join(args.argv), "hardware": hardware(), "max_new_tokens": args.max_new_tokens}
    if args.merge:
        return _bench_merge(args, out, meta)
    if args.mode != "speed" and args.data is None and not args.quick:
        raise KVRagError("kvrag bench needs --data PATH (a JSONL shaped like shared/data/*.jsonl), or --quick")
    store = args.store or run_store(out, "kvrag bench")
    if args.mode == "speed":  # one ratio: the one given first, else 0.15 (the reference point)
        given = any(a.split("=", 1)[0] == "--ratios" for a in args.argv)
        return _bench_speed(args, methods, ratios[0] if given and ratios else 0.15, store, meta)
    examples = load_examples(args.data, n=args.n, seed=args.seed) if args.data else sample_examples(args.n, args.seed)
    settings = make_settings(methods, ratios, similarity=args.similarity)
    adapters = _named_adapters(args.adapter)
    unknown = sorted({st.model for st in settings if st.model} - set(adapters))
    if unknown:
        raise KVRagError(f"--methods names model variants with no --adapter NAME=PATH: {', '.join(unknown)}")
    rag = KVRag.from_pretrained(args.model, store=store, device=args.device, dtype=args.dtype, link_adapter=BASE_WEIGHTS)
    variants = {
        name: KVRag.from_pretrained(args.model, store=store, device=args.device, dtype=args.dtype, link_adapter=path)
        for name, path in adapters.items()
    }
    records = run(rag, examples, settings, out, max_new_tokens=args.max_new_tokens, variants=variants)
    meta.update(data=args.data or "bundled sample questions", n=len(examples), seed=args.seed, model=rag.lm.source,
                adapters={k: str(v) for k, v in adapters.items()})
    write_report(records, out, meta)
    print(markdown_table(summarize(load_records(records))))
    if args.contexts != "none":
        _speed_sweep(args, rag, methods, 0.15, meta, store)
    drop_default_store(args, out)
    print(f"results in {out}/ (summary.md, summary.json, records.jsonl, PNG plots)", file=sys.stderr)
    return 0


def run_store(out: Path, by: str) -> str:
    """The URL of the run's own KV store, OUT/kv, marked as made by this run when it creates the folder
    (cache_backends.disk_cleanup): only a store so marked is removed when the run completes."""
    kv = out / "kv"
    if not mark_created(kv, by):
        what = "a symlink" if kv.is_symlink() else "a folder this run did not create"
        print(f"kvrag: note: {kv} is {what}: the run uses it as its store and leaves it in place afterwards", file=sys.stderr)
    return f"disk://{kv.resolve()}"


def drop_default_store(args: argparse.Namespace, out: Path) -> None:
    """Remove the run's own KV store (OUT/kv, the default) once the run has completed: it is a cache
    of the chunks' KV, 1-2 GB for a few hundred questions, and a stopped run keeps it to resume from.
    A store the user named (--store), or --keep-store, is left as it is; so is an OUT/kv no run made
    (no marker; a symlink is never followed). Only the store's own files go, through its walk: what
    else is there stays, and is named."""
    kv = out / "kv"
    if args.store or args.keep_store or not (kv.is_dir() or kv.is_symlink()):
        return
    res = remove_created(kv)
    if res.refused:
        print(f"kvrag: left {kv} in place: {res.refused}", file=sys.stderr)
        return
    done = "removed" if not res.left else "removed the store files of"
    print(f"{done} this run's KV store {kv} ({res.removed_files} files, {res.removed_bytes / 1e9:.2f} GB; --keep-store keeps it)",
          file=sys.stderr)
    if res.left:
        shown = ", ".join(res.left[:5]) + (f" and {len(res.left) - 5} more" if len(res.left) > 5 else "")
        print(f"kvrag: could not remove {len(res.left)} path(s) under {kv} that are not the store's (kept, with {MARKER}): {shown}",
              file=sys.stderr)


def _bench_merge(args: argparse.Namespace, out: Path, meta: dict) -> int:
    parts = [Path(d) for d in args.merge.split(",") if d]
    for d in parts:
        if not (d / "records.jsonl").is_file():
            raise KVRagError(f"--merge: no records.jsonl in {d}")
    metas = [json.loads((d / "summary.json").read_text())["meta"] for d in parts if (d / "summary.json").is_file()]
    records, dropped = merge_records([d / "records.jsonl" for d in parts], out / "records.jsonl")
    if dropped:
        print(f"--merge: {dropped} examples not answered under every setting were left out", file=sys.stderr)
    first = metas[0] if metas else {}
    # a part stopped before its report has no summary.json: this machine's facts and the given --data stand in
    own = {"hardware": meta["hardware"], "max_new_tokens": meta["max_new_tokens"], "data": args.data, "seed": args.seed}
    meta = {**own, **first, "command": meta["command"], "parts": [m.get("command", "") for m in metas], "left_out_incomplete": dropped}
    meta["n"] = len({r["example"] for r in load_records(records)})
    write_report(records, out, meta)
    print(markdown_table(summarize(load_records(records))))
    return 0


def _named_adapters(specs: list[str]) -> dict[str, Path]:
    """`--adapter NAME=PATH` options as a mapping; a missing file is an error before any model loads."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise KVRagError(f"--adapter takes NAME=PATH, got {spec!r}")
        if not Path(path).expanduser().is_file():
            raise KVRagError(f"--adapter {name}: no adapter file at {path}")
        out[name.strip()] = Path(path).expanduser()
    return out


def _speed_sweep(args: argparse.Namespace, rag, methods: list[str], ratio: float, meta: dict, store: str, random_weights: bool = False,
                 tiers: tuple[str, ...] = ()) -> None:
    parsed = [parse_method(m) for m in methods]
    reuse = next((p for m, p in parsed if m == "reuse"), ())  # e.g. reuse:short_context=0 (a short prompt is read whole otherwise)
    settings = [Setting("full"), Setting("reuse", params=reuse)] + [Setting(m, ratio, params=p) for m, p in parsed if m not in ("full", "reuse")]
    opts = SweepOptions(chunk_tokens=args.chunk_tokens, repeats=args.repeats, decode_tokens=args.decode_tokens, layerwise=args.layerwise,
                        tiers=tiers)
    rows = speed_sweep(rag, parse_sizes(args.contexts), settings, opts)
    plan = plan_tiers(rag.store, tiers)
    meta = {**meta, "model": rag.lm.source, "device": str(rag.lm.device), "dtype": str(rag.lm.dtype).replace("torch.", ""),
            "chunk_tokens": args.chunk_tokens, "repeats": args.repeats, "store": store, "random_weights": random_weights,
            "layerwise": args.layerwise, "decode_tokens": args.decode_tokens, "tiers": plan.names, "tier_notes": plan.notes}
    write_speed(rows, args.out, meta)
    print(speed_markdown(rows))


def _bench_speed(args: argparse.Namespace, methods: list[str], ratio: float, store: str, meta: dict) -> int:
    if args.shape and not args.random_weights:
        raise KVRagError("--shape builds a model with random weights (nothing is downloaded): add --random-weights")
    if args.random_weights and not args.shape:
        raise KVRagError("--random-weights needs --shape NAME (see kvrag/shapes/)")
    try:
        tiers = parse_tiers(args.tiers, store_given=bool(args.store))
    except ValueError as exc:
        raise KVRagError(f"--tiers: {exc}") from None
    if tiers and not args.store:  # the CUDA default stack's shape over the run's own folder (removed with it)
        store = tier_stack_url(Path(args.out) / "kv", resolve_device(args.device))
    if args.shape:
        tokenizer = load_tokenizer(args.model)  # any tokenizer will do for timing; ids fit every shape's vocab
        rag = KVRag(random_model(args.shape, tokenizer, device=args.device, dtype=args.dtype), store=store)
        print(f"{args.shape}: {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
    else:
        rag = KVRag.from_pretrained(args.model, store=store, device=args.device, dtype=args.dtype, link_adapter=BASE_WEIGHTS)
    _speed_sweep(args, rag, methods, ratio, meta, store, random_weights=bool(args.shape), tiers=tiers)
    drop_default_store(args, Path(args.out))
    print(f"results in {args.out}/ (speed.md, speed.json, ttft_vs_context.png)", file=sys.stderr)
    return 0


def _bench_chat(args: argparse.Namespace) -> int:
    """`kvrag bench chat`: the bundled conversations (kvrag.eval.chat_bench), full and the default method unless named."""
    from kvrag.eval.chat_bench import run_chat_bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = args.store or run_store(out, "kvrag bench chat")
    rag = KVRag.from_pretrained(args.model, store=store, device=args.device, dtype=args.dtype)
    methods = split_methods(args.methods) if args.methods else ["full", rag.default_method]
    data_dir = Path(args.data_dir) if args.data_dir and Path(args.data_dir).is_dir() else None
    result = run_chat_bench(rag, out, methods, data_dir=data_dir, n=3 if args.quick else args.n, max_new_tokens=args.max_new_tokens,
                            retrieval=args.retrieval)
    print((out / "chat.md").read_text(encoding="utf-8"))
    drop_default_store(args, out)
    return 0 if result["summary"] else 1


def cmd_bench_deviation(args: argparse.Namespace) -> int:
    rag = KVRag.from_pretrained(args.model, store="memory://", link_adapter=BASE_WEIGHTS)
    r = deviation_study(rag, load_examples(args.data, n=args.n, seed=args.seed), top_n=args.top_n)
    print(
        f"n={r['n']} top_n={r['top_n']}: layer-1 KV deviation plain {r['layer1_plain']:.3f} -> similarity-guided "
        f"{r['layer1_similarity']:.3f} ({1 - r['layer1_similarity'] / r['layer1_plain']:.0%} lower); all layers "
        f"{r['all_layers_plain']:.2f} -> {r['all_layers_similarity']:.2f} ({1 - r['all_layers_similarity'] / r['all_layers_plain']:.0%} lower)"
    )
    return 0


def cmd_eval_suite(args: argparse.Namespace) -> int:
    """`kvrag eval suite`: every set at every length over the base weights (and the tuned adapter's
    kvlink), the rule applied; see kvrag.eval.suite."""
    from kvrag.eval.suite import SETS, TUNED, collect, default_setting, run_suite, suite_settings, write_suite
    from kvrag.link_adapter import SHIPPED_ADAPTERS, SHIPPED_DIR

    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise KVRagError(f"unknown sets {unknown}; known: {', '.join(SETS)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    skip = [m for m in (args.skip or "").split(",") if m]
    methods = {s.method for s in suite_settings(with_tuned=True)} - {"full"}
    if set(skip) - methods:
        raise KVRagError(f"--skip: unknown methods {sorted(set(skip) - methods)}; the suite's: {', '.join(sorted(methods))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "kvrag " + " ".join(args.argv), "hardware": hardware(), "sets": sets, "lengths": lengths, "skip": skip}
    if args.report_only:  # what is answered so far: no model, no new answers
        results = collect(out, sets, lengths)
        complete = all(results.get(f"{s}/{n}", {}).get("n", 0) >= (args.n or SETS[s].n) for s in sets for n in lengths)
        earlier = _earlier_meta(out)  # the model and adapter the answering runs recorded
        meta.update(partial=not complete, model=args.model or earlier.get("model", ""), tuned=earlier.get("tuned", args.tuned),
                    default_name=earlier.get("default_name", ""), default_column=earlier.get("default_column", ""))
        verdict = write_suite(results, out, meta)
        print((out / "suite.md").read_text())
        return 0
    store = args.store or run_store(out, "kvrag eval suite")
    rag = KVRag.from_pretrained(args.model, store=store, device=args.device, link_adapter=BASE_WEIGHTS)
    variants = {}
    tuned = args.tuned
    if tuned == "shipped":
        name = SHIPPED_ADAPTERS.get(rag.lm.source, {}).get("tuned")
        tuned = str(SHIPPED_DIR / name) if name else "none"
    if tuned != "none":
        try:
            variants[TUNED] = KVRag(rag.lm, store=rag.store, layout=rag.layout, check=False, link_adapter=tuned)
        except AdapterMismatchError as exc:
            if args.tuned != "shipped":
                raise
            print(f"not judging the shipped tuned adapter: {exc}", file=sys.stderr)  # trained for another layout
            tuned = "none"
    sizes = {s: args.n for s in sets} if args.n else None
    known = rag.peek_default()  # the model's calibrated default, where it is known (never a calibration here)
    marked = default_setting(known) if known is not None and known.source == "calibrated" else None
    column = marked.name if marked is not None else ""
    results = run_suite(rag, variants, sets, lengths, out, Path(args.data_dir), sizes, skip=skip, default=marked)
    meta.update(model=rag.lm.source, tuned=tuned, default_name=known.name if column else "", default_column=column)
    verdict = write_suite(results, out, meta)
    drop_default_store(args, out)
    print((out / "suite.md").read_text())
    print(f"default by the rule: {verdict['default']}; results in {out}/ (suite.md, suite.json, suite.png)", file=sys.stderr)
    return 0


def _earlier_meta(out: Path) -> dict:
    """The meta of the suite.json under `out`, if any (a report keeps what the answering runs recorded)."""
    try:
        return json.loads((out / "suite.json").read_text()).get("meta", {})
    except (OSError, ValueError, AttributeError):
        return {}


def cmd_bench_decode(args: argparse.Namespace) -> int:
    """`kvrag bench-decode`: see kvrag.eval.decode_speed."""
    from kvrag.eval.decode_speed import decode_markdown, run_decode_bench
    from kvrag.eval.suite import SETS

    contexts = [int(x) for x in args.contexts.split(",") if x]
    rag = KVRag.from_pretrained(args.model, store="memory://", device=args.device, link_adapter=BASE_WEIGHTS)
    sets = [x for x in args.draft_sets.split(",") if x]
    unknown = sorted(set(sets) - set(SETS))
    if unknown:
        raise KVRagError(f"--draft-sets: unknown set(s) {unknown}; known: {sorted(SETS)}")
    result = run_decode_bench(rag, contexts, new_tokens=args.new_tokens, repeats=args.repeats, int8=args.int8,
                              data=Path(args.data_dir), draft_sets=sets, draft_n=args.draft_n)
    hw = hardware()
    meta = {"command": "kvrag " + " ".join(args.argv), "hardware": hw, "model": rag.lm.source,
            "hardware_line": f"{hw.get('cpu') or hw.get('machine')}, {hw.get('cores', '?')} cores; {hw['threads']} torch threads, torch {hw['torch']}"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"meta": meta, **result}, indent=1))
    md = decode_markdown(result, meta)
    (out / "decode.md").write_text(md)
    print(md)
    return 0


def cmd_bench_store(args: argparse.Namespace) -> int:
    if args.tiers_only:
        print(write_tiers(args.out, tier_bandwidth(args.out)))
    else:
        print(store_markdown(run_store_bench(args.out, redis_url=args.redis, model=args.model)))
    return 0
