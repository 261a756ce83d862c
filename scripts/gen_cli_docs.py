"""The command-line reference, generated from the `kvrag` argparse parsers (so it cannot drift).

    python scripts/gen_cli_docs.py            # print the Markdown page
    python scripts/gen_cli_docs.py OUT.md     # write it

`mkdocs build` calls `cli_reference()` through scripts/docs_hooks.py and serves the result as
reference/cli.md; nothing generated is committed. Building the parser imports no torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator


def walk(parser: argparse.ArgumentParser, path: list[str], summary: str = "") -> Iterator[tuple[list[str], str, argparse.ArgumentParser]]:
    """Every parser under `parser`, depth first, with its command words and its one-line help."""
    yield path, summary, parser
    for action in parser._actions:  # argparse keeps subcommands here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from walk(sub, path + [name], helps.get(name, ""))


def help_texts() -> list[tuple[str, str, str]]:
    """(`kvrag ...` command, its one-line help, its --help text) for every command, as a terminal 100
    columns wide shows it, and as a user with no `KVRAG_*` variable set sees it: defaults read from the
    environment (`--store`'s `disk://$KVRAG_HOME/kv`, `$KVRAG_INDEX`, ...) never show the machine that
    built the page (its home folder, its store)."""
    from kvrag.cli.app import _parser

    saved = {k: v for k, v in os.environ.items() if k.startswith("KVRAG_") or k == "COLUMNS"}
    for k in saved:
        os.environ.pop(k)
    os.environ["COLUMNS"] = "100"  # argparse wraps to $COLUMNS: a fixed width gives the same page everywhere
    os.environ["KVRAG_HOME"] = "$KVRAG_HOME"  # kvrag_home() as the page names it, not this machine's folder
    try:
        return [(" ".join(path), summary, sub.format_help()) for path, summary, sub in walk(_parser(), ["kvrag"])]
    finally:
        for k in ("COLUMNS", "KVRAG_HOME"):
            os.environ.pop(k, None)
        os.environ.update(saved)


def cli_reference() -> str:
    """The Markdown page: one section per command, its --help in a code block."""
    texts = help_texts()
    lines = [
        "# Command line",
        "",
        "Every `kvrag` command's `--help`, generated from the parsers when the site is built",
        "(`scripts/gen_cli_docs.py`). Answers go to stdout, stats and progress to stderr.",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    for name, summary, _ in texts[1:]:
        anchor = name.replace(" ", "-")
        lines.append(f"| [`{name}`](#{anchor}) | {' '.join(summary.split()).replace('|', '/')} |")
    lines.append("")
    for name, _, text in texts:
        anchor = name.replace(" ", "-")
        lines += [f"## `{name}` {{#{anchor}}}", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    page = cli_reference()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            fh.write(page)
    else:
        sys.stdout.write(page)
