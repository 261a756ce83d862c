"""The documentation a user reads: the README and the MkDocs site under docs/.

- `mkdocs build --strict` passes (no broken link or anchor, no page left out of the navigation);
- no development history in README.md or the site's pages (CHANGELOG.md is the place for it);
- no page, README line or `kvrag ... --help` text names a default method other than DEFAULT_METHOD;
- the command-line reference is generated from the parsers and covers every command;
- the README stays short and keeps the set-up lines .ci/run reads.
The site's code blocks run in tests/test_readme.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
METHODS = ("full", "reuse", "cacheblend", "epic", "a3", "fusionrag", "kvlink", "samkv")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def site_pages() -> list[Path]:
    """The pages people write (docs/bench holds reports the benchmark commands wrote)."""
    return sorted(p for p in DOCS.rglob("*.md") if p.relative_to(DOCS).parts[0] != "bench")


def user_texts() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in [README, *site_pages()]]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    site = tmp_path / "site"
    for page in ("index.html", "reference/cli/index.html", "reference/api/index.html", "changelog/index.html"):
        assert (site / page).is_file(), page
    cli = (site / "reference/cli/index.html").read_text(encoding="utf-8")
    assert "kvrag serve" in cli and "--max-concurrency" in cli
    from kvrag.defaults import DEFAULT_METHOD

    methods_page = (site / "methods/index.html").read_text(encoding="utf-8")
    assert f"<code>{DEFAULT_METHOD}</code>" in methods_page and "{{" not in methods_page  # filled from kvrag.defaults


# -- no development diary -----------------------------------------------------------------------
HISTORY = re.compile(r"\bsessions? \d|\bissue #?\d|\b(?:since|until|before) (?:session|issue)\b|\bthe default until\b"
                     r"|\bthis session\b", re.I)


@pytest.mark.parametrize("where,text", user_texts(), ids=[w for w, _ in user_texts()])
def test_no_development_history(where, text):
    hits = [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in HISTORY.finditer(text)]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)


def test_history_pattern():
    for bad in ("since session 17", "Session 18", "(issue #34)", "the default until issue #34", "issue 17's table"):
        assert HISTORY.search(bad), bad
    for fine in ("a session cookie", "the conversation's second turn", "an issue with Redis"):
        assert not HISTORY.search(fine), fine


# -- one source for the default method -----------------------------------------------------------
def default_claims(text: str, default: str) -> list[str]:
    """Phrases naming a method other than `default` as the default: "default: cacheblend", "else
    cacheblend", "the default method is cacheblend", "cacheblend@0.15 (the default)"."""
    others = "|".join(m for m in METHODS if m != default and m != "full")
    patterns = [
        rf"\bdefault(?:s| method)?(?: is| =| to|:)?\s*[`'\"]?(?:{others})\b(?![,\w])",  # not a list: "default: a,b"
        rf"\belse\s+[`'\"]?(?:{others})\b(?![,\w])",
        rf"\b(?:{others})(?:@[\d.]+)?[`'\"]?(?:,? [\w% ]{{0,25}})?\s*\((?:the |is the )?default\)",
    ]
    return [m.group(0) for p in patterns for m in re.finditer(p, text, re.I)]


def test_default_claims_pattern():
    assert default_claims("default: cacheblend", "fusionrag") and default_claims("(default: cacheblend@0.15)", "fusionrag")
    assert default_claims("the engine's, else cacheblend)", "fusionrag")
    assert default_claims("| cacheblend, 15% recomputed (the default) |", "fusionrag")
    assert not default_claims("| fusionrag, 15% recomputed (the default) |", "fusionrag")
    assert not default_claims("default: fusionrag, or kvlink with --link-adapter tuned", "fusionrag")
    assert not default_claims("pass `method=\"cacheblend\"` where that matters", "fusionrag")
    assert not default_claims("methods (default: cacheblend,epic,a3,fusionrag,samkv)", "fusionrag")  # a list run by default
    assert not default_claims("tuned: the LoRA on kvlink's fast path; none; or a file (default: auto)", "fusionrag")
    assert default_claims("| 10 passages | cacheblend@0.15 (default) |", "fusionrag")


@pytest.mark.parametrize("where,text", user_texts(), ids=[w for w, _ in user_texts()])
def test_docs_name_no_other_default_method(where, text):
    from kvrag.defaults import DEFAULT_METHOD

    claims = default_claims(text, DEFAULT_METHOD)
    assert not claims, f"{where} says the default is not {DEFAULT_METHOD!r} (kvrag/defaults.py): {claims}"


def cli_helps() -> list[tuple[str, str, str]]:
    return _load(ROOT / "scripts" / "gen_cli_docs.py", "gen_cli_docs").help_texts()


def test_help_texts_name_no_other_default_method():
    from kvrag.defaults import DEFAULT_METHOD

    wrong = {name: claims for name, _, text in cli_helps() if (claims := default_claims(text, DEFAULT_METHOD))}
    assert not wrong, f"`--help` texts that contradict DEFAULT_METHOD={DEFAULT_METHOD!r}: {wrong}"


def test_integration_field_descriptions_name_no_other_default_method():
    from kvrag.defaults import DEFAULT_METHOD

    wrong = {}
    for path in sorted((ROOT / "integrations").rglob("*.py")):
        for m in re.finditer(r'description\s*=\s*(?:f?"[^"]*"\s*)+', path.read_text(encoding="utf-8")):
            if claims := default_claims(m.group(0), DEFAULT_METHOD):
                wrong[str(path.relative_to(ROOT))] = claims
    assert not wrong, f"field descriptions that contradict DEFAULT_METHOD={DEFAULT_METHOD!r}: {wrong}"


# -- the CLI reference ----------------------------------------------------------------------------
def test_cli_reference_covers_every_command():
    gen = _load(ROOT / "scripts" / "gen_cli_docs.py", "gen_cli_docs")
    page = gen.cli_reference()
    names = [name for name, _, _ in gen.help_texts()]
    assert {"kvrag", "kvrag ask", "kvrag serve", "kvrag store gc"} <= set(names)
    for name in names:
        assert f"## `{name}`" in page, name
    assert "usage: kvrag serve" in page


def test_placeholders_read_kvrag_defaults():
    hooks = _load(ROOT / "scripts" / "docs_hooks.py", "docs_hooks")
    from kvrag.defaults import DEFAULT_METHOD, DEFAULT_RATIO

    assert hooks.substitute("{{ DEFAULT_METHOD }} at {{DEFAULT_RATIO}}", "x.md") == f"{DEFAULT_METHOD} at {DEFAULT_RATIO}"
    with pytest.raises(ValueError, match="NO_SUCH"):
        hooks.substitute("{{ NO_SUCH }}", "x.md")


# -- the README -----------------------------------------------------------------------------------
def test_readme_is_short_and_keeps_the_set_up_lines():
    text = README.read_text(encoding="utf-8")
    assert text.count("\n") <= 250, f"README.md has {text.count(chr(10))} lines; the rest belongs in docs/"
    lines = text.splitlines()
    assert any(re.search(r"#\s*tests\s*$", ln) and "pytest" in ln for ln in lines), "the '# tests' line .ci/run reads"
    assert any(ln.rstrip().endswith("# main job") and "kvrag quickstart" in ln for ln in lines)


def test_readme_links_resolve():
    text = README.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(((?!https?:)[^)#\s]+)(?:#[^)]*)?\)", text):
        assert (ROOT / target).exists(), f"README.md links to a missing {target}"


# -- examples a newcomer copies ---------------------------------------------------------------------
_PY_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("where,text", user_texts(), ids=[w for w, _ in user_texts()])
def test_examples_never_ingest_the_projects_own_docs(where, text):
    """`kvrag ingest docs/` typed in a clone ingests this project's docs folder: examples name a folder of the user's."""
    hits = [ln for ln in text.splitlines() if re.search(r"\bkvrag ingest\s+(?:\./)?docs/?(?:\s|$)", ln)]
    assert not hits, f"{where}: {hits}"


def _unterminated_streams(code: str) -> list[str]:
    """Lines printing a streamed piece with end="" whose loop is not followed by a print() (the shell prompt
    would then start on the answer's line)."""
    lines = code.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if 'end="")' not in line and "end='')" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        after = next((ln for ln in lines[i + 1:] if ln.strip() and len(ln) - len(ln.lstrip()) < indent), "")
        if after.strip() != "print()":
            bad.append(line.strip())
    return bad


def test_unterminated_stream_pattern():
    assert _unterminated_streams('for p in s:\n    print(p, end="")\nprint(1)\n')
    assert _unterminated_streams('for p in s:\n    print(p, end="")\n')
    assert not _unterminated_streams('for p in s:\n    print(p, end="")\nprint()\nprint(1)\n')


@pytest.mark.parametrize("where,text", user_texts(), ids=[w for w, _ in user_texts()])
def test_streamed_examples_end_with_a_newline(where, text):
    bad = [b for m in _PY_BLOCK.finditer(text) for b in _unterminated_streams(m.group(1))]
    assert not bad, f"{where}: add a print() after the loop of {bad}"


def test_cli_reference_names_no_machine_path():
    page = _load(ROOT / "scripts" / "gen_cli_docs.py", "gen_cli_docs").cli_reference()
    assert str(Path.home()) not in page and "disk://$KVRAG_HOME/kv" in page
