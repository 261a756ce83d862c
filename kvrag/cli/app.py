"""The `kvrag` command: the parser, assembled from one module per command family, and the dispatch.

Answers go to stdout, stats and progress to stderr, so `kvrag ask ... > answer.txt` keeps only the answer.
Every command module registers its parsers (`register(sub)`, setting `func`) and imports the engine only
when its command runs, so `kvrag --help` starts without torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import import_module
from typing import Sequence

from kvrag.cli.args import HelpFormatter
from kvrag.errors import KVRagError
from kvrag.quiet import quiet_libraries

# in the order `kvrag --help` lists them
COMMAND_MODULES = ("ingest", "ask", "bench", "check", "train", "demo", "serve", "store")
_REGISTER = {"check": "add_check_model_parser", "train": "add_train_links_parser", "serve": "add_serve_parser", "store": "add_store_parser"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrag", description="Fast RAG on a local LLM by reusing per-chunk KV caches.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does (INFO) on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        module = import_module(f"kvrag.cli.{name}")
        getattr(module, _REGISTER.get(name, "register"))(sub)
    summaries = {a.dest: a.help for a in sub._choices_actions}  # the one-liners `kvrag --help` lists
    for name, sub_parser in sub.choices.items():  # every --help shows defaults and one example
        sub_parser.formatter_class = HelpFormatter
        if not sub_parser.description and summaries.get(name):  # `kvrag NAME --help` opens with what NAME does
            sub_parser.description = _sentence(summaries[name])
        if not sub_parser.epilog and name in EXAMPLES:
            sub_parser.epilog = f"example: {EXAMPLES[name]}"
    return parser


def _sentence(summary: str) -> str:
    """A one-line summary as the opening sentence of a command's own --help."""
    return summary[:1].upper() + summary[1:] + ("" if summary.endswith(".") else ".")


EXAMPLES = {
    "ingest": "kvrag ingest ~/papers/ notes.md --store redis://127.0.0.1:6379/0",
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    try:
        return args.func(args)
    except (KVRagError, ValueError) as exc:
        print(f"kvrag: error: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # a script reading stdout gets the error as JSON, not nothing
            import json

            print(json.dumps({"error": {"message": str(exc), "type": type(exc).__name__, "exit_code": 2}}))
        return 2


if __name__ == "__main__":
    sys.exit(main())
