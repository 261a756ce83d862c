"""MkDocs hooks (mkdocs.yml `hooks:`): what the docs site reads from the code at build time.

- `{{ NAME }}` in a page is the value of NAME in kvrag/defaults.py (DEFAULT_METHOD, DEFAULT_RATIO, ...),
  so no page states a default the code does not have; an unknown NAME fails the build.
- reference/cli.md is generated from the `kvrag` argparse parsers (scripts/gen_cli_docs.py).
- changelog.md is the repository's CHANGELOG.md.
- The raw benchmark reports (docs/bench/**/*.md, written by the commands that took them) are listed
  in the navigation under "Benchmarks and results"; an image one of them names but whose file was
  not kept is left out of its page rather than failing the build.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("mkdocs.hooks.kvrag")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Z][A-Z0-9_]*)\s*\}\}")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _gen_cli() -> Any:
    spec = importlib.util.spec_from_file_location("kvrag_gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def defaults() -> dict[str, str]:
    """The public constants of kvrag/defaults.py, as a page shows them."""
    import kvrag.defaults as d

    return {k: str(v) for k, v in vars(d).items() if k.isupper() and isinstance(v, (str, int, float, bool, tuple))}


def substitute(markdown: str, where: str) -> str:
    """`{{ NAME }}` -> kvrag.defaults.NAME; an unknown name is an error naming the page."""
    values = defaults()

    def one(m: re.Match[str]) -> str:
        if m.group(1) not in values:
            raise ValueError(f"{where}: {{{{ {m.group(1)} }}}} is not a constant of kvrag/defaults.py")
        return values[m.group(1)]

    return _PLACEHOLDER.sub(one, markdown)


def bench_reports(files: Files) -> list[str]:
    return sorted(f.src_uri for f in files.documentation_pages() if f.src_uri.startswith("bench/"))


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=_gen_cli().cli_reference()))
    files.append(File.generated(config, "changelog.md", content=(ROOT / "CHANGELOG.md").read_text(encoding="utf-8")))
    reports = bench_reports(files)
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Benchmarks and results" in entry:
            page = entry["Benchmarks and results"]
            entry["Benchmarks and results"] = [{"Results": page}, {"Raw reports": [{r.removeprefix("bench/"): r} for r in reports]}]
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src = page.file.src_uri
    if src.startswith("bench/"):  # machine-written reports: shown as written, minus images not kept
        folder = Path(config["docs_dir"]) / Path(src).parent

        def keep(m: re.Match[str]) -> str:
            if (folder / m.group(1)).exists():
                return m.group(0)
            log.info("%s: image %s was not kept; left out", src, m.group(1))
            return ""

        return _IMAGE.sub(keep, markdown)
    return substitute(markdown, src)
