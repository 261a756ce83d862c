"""`kvrag eval steps --run RUN`: agreement with base Full Attention against training steps (kvrag.eval.steps_eval)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvrag.errors import KVRagError


def cmd_eval_steps(args: argparse.Namespace) -> int:
    from kvrag.cli.bench_run import drop_default_store, run_store
    from kvrag.eval.runner import hardware
    from kvrag.eval.steps_eval import collect, columns_of, run_steps, set_examples, snapshots, write
    from kvrag.eval.suite import SETS

    if not args.run:
        raise KVRagError("kvrag eval steps needs --run RUN[,RUN...]: training run folders with snaps/step-N.safetensors")
    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise KVRagError(f"unknown sets {unknown}; known: {', '.join(SETS)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    try:  # --run RUN[,RUN...]: each run's snapshots, side by side
        snaps = [snap for run in args.run.split(",") if run for snap in snapshots(Path(run))]
    except FileNotFoundError as e:
        raise KVRagError(str(e)) from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "kvrag " + " ".join(getattr(args, "argv", [])), "hardware": hardware(), "sets": sets, "lengths": lengths,
            "model": args.model or "bundled", "run": str(args.run)}
    if args.report_only:
        result = collect(out, sets, lengths, columns_of(snaps))
    else:
        from kvrag.engine import KVRag

        rag = KVRag.from_pretrained(args.model, store=args.store or run_store(out, "kvrag eval steps"), device=args.device, link_adapter=None)
        result = run_steps(rag, snaps, set_examples(sets, Path(args.data_dir), args.n), lengths, out)
        drop_default_store(args, out)
    write(result, out, meta)
    print((out / "README.md").read_text())
    return 0
