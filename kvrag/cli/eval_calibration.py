"""`kvrag eval calibration`: the model's calibrated default against Full Attention (kvrag.eval.calibration_eval)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrag.errors import KVRagError


def cmd_eval_calibration(args: argparse.Namespace) -> int:
    from kvrag.cli.bench_run import drop_default_store, run_store
    from kvrag.eval.calibration_eval import collect, judge_calibrated_default, write
    from kvrag.eval.runner import hardware
    from kvrag.eval.suite import SETS

    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise KVRagError(f"unknown sets {unknown}; known: {', '.join(SETS)}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "kvrag " + " ".join(getattr(args, "argv", [])), "hardware": hardware(), "sets": sets, "lengths": lengths,
            "model": args.model or "bundled", "note": f"{args.n} questions a set" if args.n else "each set at its own size"}
    if args.report_only:  # what OUT holds so far: no model, no new answers
        result = collect(out, sets, lengths)
    else:
        from kvrag.engine import KVRag

        rag = KVRag.from_pretrained(args.model, store=args.store or run_store(out, "kvrag eval calibration"), device=args.device,
                                    link_adapter="links")
        print(f"default for this model: {rag.default_setting.note()}", file=sys.stderr)
        result = judge_calibrated_default(rag, sets, lengths, out, Path(args.data_dir), args.n)
        drop_default_store(args, out)
    write(result, out, meta)
    print((out / "README.md").read_text())
    return 0 if result["keeps_up"] else 1
