"""`kvrag eval layout`: every candidate prompt layout over the suite's sets and two-turn conversations, the rule
applied (kvrag.eval.layout_eval, kvrag.eval.layout_report)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrag.errors import KVRagError

DEFAULT_SETS = "conversations,conversations-index,sample,facts,facts-one,facts-long,nq10,musique,kv75"


def cmd_eval_layout(args: argparse.Namespace) -> int:
    from kvrag.eval.layout_eval import CANDIDATES, CONVERSATION_SETS, DEFAULT_N, DEFAULT_NEW_TOKENS, run_layout
    from kvrag.eval.layout_report import write
    from kvrag.eval.report import load_records
    from kvrag.eval.runner import hardware
    from kvrag.eval.suite import SETS
    from kvrag.options import DEFAULT_METHOD, DEFAULT_RATIO

    sets = [s for s in (args.sets or DEFAULT_SETS).split(",") if s]
    unknown = [s for s in sets if s not in SETS and s not in CONVERSATION_SETS]
    if unknown:
        raise KVRagError(f"unknown sets {unknown}; known: {', '.join(CONVERSATION_SETS)}, {', '.join(SETS)}")
    layouts = [s for s in (args.layouts or ",".join(CANDIDATES)).split(",") if s]
    if "v1" not in layouts or any(name not in CANDIDATES for name in layouts):
        raise KVRagError(f"--layouts must name v1 (today's, the rule's reference) and only known candidates: {', '.join(CANDIDATES)}")
    new_tokens = int(args.lengths.split(",")[0]) if args.lengths else DEFAULT_NEW_TOKENS
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "kvrag " + " ".join(getattr(args, "argv", [])), "hardware": hardware(), "max_new_tokens": new_tokens,
            "default_method": f"{DEFAULT_METHOD}@{DEFAULT_RATIO}", "model": args.model or "bundled SmolLM2-135M-Instruct",
            "size": f"up to {args.n or DEFAULT_N} rows a set (the suite's own size where smaller), "
                    f"{args.conversations or 'every'} conversation(s); each set split in two halves by a hash of its row ids"}
    if not args.report_only:
        from kvrag.model.loading import load_model

        run_layout(load_model(args.model, device=args.device), out, Path(args.data_dir), sets, args.n, layouts, new_tokens,
                   args.conversations)
    records = out / "records.jsonl"
    if not records.is_file():
        raise KVRagError(f"nothing answered under {out} yet")
    result = write(load_records(records), out, meta)
    print((out / "layout.md").read_text())
    print(f"chosen by the rule: {result['choice']['chosen']}; results in {out}/ (layout.md, layout.json, layout.png)", file=sys.stderr)
    return 0
