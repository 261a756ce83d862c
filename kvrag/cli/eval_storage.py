"""`kvrag eval storage`: answers from float32, bf16 and int8 stores side by side (kvrag.eval.storage_eval)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrag.errors import KVRagError


def cmd_eval_storage(args: argparse.Namespace) -> int:
    from kvrag.engine import KVRag
    from kvrag.eval.storage_eval import report, run_storage, store_url, write
    from kvrag.eval.suite import SETS

    sets = [s for s in args.sets.split(",") if s]
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise KVRagError(f"unknown sets {unknown}; known: {', '.join(SETS)}")
    if args.store:
        raise KVRagError("eval storage makes its own stores (OUT/kv-none, kv-bf16, kv-int8): --store does not apply")
    length = int(args.lengths.split(",")[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # what OUT holds so far: no model, no new answers
        from kvrag.model.loading import load_config, resolve_dtype

        result = report(out, sets, length, load_config(args.model), resolve_dtype("auto", args.device), args.model or "bundled")
    else:
        rag = KVRag.from_pretrained(args.model, store=store_url(out, "none"), device=args.device, link_adapter="links")
        result = run_storage(rag, sets, length, out, Path(args.data_dir), args.n)
    result["command"] = "kvrag " + " ".join(getattr(args, "argv", []))
    write(result, out)
    print((out / "storage.md").read_text())
    print(f"chosen by the rule: {result['chosen']}; results in {out}/ (storage.md, storage.json, storage.png); "
          f"the stores under {out}/kv-* are kept (remove them when done)", file=sys.stderr)
    return 0
