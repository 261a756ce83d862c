"""`kvrag check-model`: verify on a model that KV reuse is exact, and keep the verdict for the engine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_check_model_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `kvrag check-model MODEL [--device D] [--dtype T]` (sets `func=cmd_check_model`)."""
    p = subparsers.add_parser(
        "check-model",
        help="verify on your model that KV reuse is exact (re-rotated keys, reuse and recompute vs Full Attention)",
    )
    p.add_argument("model", nargs="?", default="bundled", help='HF id or folder, a .gguf file, or "bundled" (default)')
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 or auto (default: CUDA if present)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--shape", default=None,
                   help="check a public model's shapes with random weights instead (kvrag/shapes: llama-3.2-1b, llama-3.1-8b, "
                        "qwen2.5-7b): the gate at 1B-8B depth and width, nothing downloaded")
    p.add_argument("--calibrate", action="store_true",
                   help="also calibrate afresh the setting requests that name no method get on this model: every method and "
                        "ratio beside Full Attention on the shipped calibration set (kept for the engine; docs: Methods)")
    p.set_defaults(func=cmd_check_model)
    return p


def cmd_check_model(args: argparse.Namespace) -> int:
    """Run the checks afresh, print the table, keep the verdict for the engine; 0 if it passed, 1 if not.

    A model that cannot be loaded raises ModelLoadError (the CLI prints it and exits 2).
    """
    from kvrag.check.checks import _refused, run_checks  # torch: only once it runs
    from kvrag.check.gate import _write_verdict, verdict_path
    from kvrag.errors import UnsupportedModelError
    from kvrag.model.loading import load_model, load_tokenizer, resolve_device, resolve_dtype

    source = args.model if args.model not in (None, "", "bundled") else None
    device, dtype = getattr(args, "device", "auto") or "auto", getattr(args, "dtype", "auto") or "auto"
    shape = getattr(args, "shape", None)
    if shape:
        from kvrag.model.shapes import random_model, shape_config

        shape_config(shape)  # an unknown name fails before anything loads
    print(f"loading model ({source or 'bundled SmolLM2-135M-Instruct'}) ...", file=sys.stderr)
    try:
        if shape:
            tokenizer = load_tokenizer(source)  # any tokenizer: its ids fit every shape's vocabulary
            print(f"building {shape} with random weights (the gate's numerics only) ...", file=sys.stderr)
            lm = random_model(shape, tokenizer, device=device, dtype=dtype)
        else:
            lm = load_model(source, device=device, dtype=dtype)
    except UnsupportedModelError as exc:
        dev = resolve_device(device).type
        report = _refused(str(source or "bundled"), exc, dev, str(resolve_dtype(dtype, dev)))
    else:
        report = run_checks(lm)
        _write_verdict(verdict_path(lm.fingerprint), report, lm)
    calibration = None
    if getattr(args, "calibrate", False) and report.passed:
        from kvrag.check.default import calibrate_model
        from kvrag.engine import shipped_calibration_adapter

        print("calibrating the default setting (every method and ratio beside Full Attention) ...", file=sys.stderr)
        _, calibration = calibrate_model(lm, progress=lambda line: print("  " + line, file=sys.stderr),
                                         adapter=shipped_calibration_adapter(lm))
    if getattr(args, "json", False):
        print(json.dumps({"passed": report.passed, **report.to_dict(), **({"calibration": calibration} if calibration else {})}, indent=1))
    else:
        print(report.table())
        if calibration:
            from kvrag.check.calibration_report import calibration_table

            print(calibration_table(calibration))
    if not report.passed:
        print(f"kvrag: error: {report.error_message()}", file=sys.stderr)
        return 1
    return 0
