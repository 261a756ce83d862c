"""The `kvrag` command: one module per command family, parsing only here (no library parses argv).

`main` imports the parser only when called, so importing this package costs nothing.
"""

from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `kvrag` command line (`argv` defaults to sys.argv[1:])."""
    from kvrag.cli.app import main as run

    return run(argv)
