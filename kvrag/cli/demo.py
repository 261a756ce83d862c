"""`kvrag demo`: the Streamlit demo, bound to this machine unless told otherwise."""

from __future__ import annotations

import argparse
import sys

from kvrag.cli.common import add_index_option


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="the Streamlit demo: ask, compare with Full Attention, see what was recomputed")
    demo.add_argument("--port", type=int, default=8501, help="the port the page is served on")
    demo.add_argument("--address", default="127.0.0.1", help="bind address (127.0.0.1: this machine only)")
    demo.add_argument("--allow-store-host", action="append", default=[], metavar="HOST",
                      help="a non-loopback Redis host the demo's store box may use (repeatable; default: loopback only)")
    add_index_option(demo)
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvrag.demo.launch import launch

    print(f"kvrag demo on http://{args.address}:{args.port} (Ctrl-C stops it)", file=sys.stderr)
    return launch(port=args.port, address=args.address, allow_store_hosts=args.allow_store_host or (), index=args.index)
