"""The ```python blocks of README.md and of the docs pages run as written, and print right answers.

README.md: every block carries a marker. docs/**/*.md (the site's pages; not the raw reports under
docs/bench): every block that carries a marker runs. A block whose code is the same as an earlier one's
(the docs repeat the README's integration examples) runs once.

Every block runs in a fresh namespace, in order, with $KVRAG_HOME a temporary folder whose retrieval
index holds the bundled sample corpus (what `kvrag ingest` would have put there). Twice:
- fast, with `KVRag.from_pretrained` returning an engine on a tiny random Llama (tests/tiny.py) over a
  memory store: the block runs (a random model's answers are not checked);
- on the bundled SmolLM2 with the shipped defaults, as a newcomer runs it: what the block prints
  holds every fact its marker names, `<!-- test: prints "1893", "Isobel Carrick" -->` on the line
  above the block (every block has one, or `<!-- test: skip (reason) -->`, which skips it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*test:\s*skip\s*(?:\((?P<reason>[^)]*)\))?\s*-->")
_PRINTS = re.compile(r"<!--\s*test:\s*prints\s+(?P<facts>.*?)\s*-->")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of each ```python block."""
    return [(line, code, reason) for line, code, reason, _ in marked_blocks(text)]


def marked_blocks(text: str) -> list[tuple[int, str, str | None, list[str]]]:
    """(line number, code, skip reason or None, facts it must print) of each ```python block."""
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        skip = _SKIP.search(before[-1]) if before else None
        prints = _PRINTS.search(before[-1]) if before else None
        reason = None
        if skip:
            reason = (skip.group("reason") or "").strip()
            if not reason:
                raise AssertionError(f"README.md:{line}: a skipped block needs a reason: <!-- test: skip (why) -->")
        facts = re.findall(r'"([^"]+)"', prints.group("facts")) if prints else []
        out.append((line, m.group(1), reason, facts))
    return out


def docs_pages() -> list[Path]:
    """The site's pages: docs/**/*.md but the raw benchmark reports (docs/bench), which commands write."""
    return sorted(p for p in DOCS.rglob("*.md") if "bench" not in p.relative_to(DOCS).parts[:1])


def docs_marked_blocks() -> list[tuple[str, int, str, str | None, list[str]]]:
    """(where, line, code, skip reason, facts) of every docs block that carries a marker."""
    out = []
    for page in docs_pages():
        where = str(page.relative_to(ROOT))
        text = page.read_text(encoding="utf-8")
        for line, code, reason, facts in marked_blocks(text):
            if reason is not None or facts:
                out.append((where, line, code, reason, facts))
    return out


MARKED = marked_blocks(README.read_text(encoding="utf-8"))
BLOCKS = [(line, code, reason) for line, code, reason, _ in MARKED]
DOCS_MARKED = docs_marked_blocks()


def _every_block() -> list[tuple[str, str, str | None, list[str]]]:
    """(where, code, skip reason, facts) of the README's blocks and the docs' marked ones, each code once."""
    seen: dict[str, int] = {}
    out: list[tuple[str, str, str | None, list[str]]] = []
    for where, line, code, reason, facts in [("README.md", *m) for m in MARKED] + DOCS_MARKED:
        key = code.strip()
        if key in seen:  # the same code: one run, every marker's facts checked
            i = seen[key]
            w, c, r, f = out[i]
            out[i] = (w, c, r if r is not None else reason, sorted(set(f) | set(facts)))
            continue
        seen[key] = len(out)
        out.append((f"{where}:{line}", code, reason, facts))
    return out


EVERY = _every_block()


def test_blocks_are_found_and_skips_are_few():
    assert len(BLOCKS) >= 3, "README's python blocks were not found: has the fence syntax changed?"
    skipped = [b for b in BLOCKS if b[2] is not None]
    assert len(skipped) <= 2, f"keep skipped README blocks few: {[(ln, r) for ln, _, r in skipped]}"


def test_docs_pages_have_run_blocks():
    assert docs_pages(), "no docs pages found"
    runs = [b for b in DOCS_MARKED if b[3] is None]
    assert len(runs) >= 2, "the docs' python examples lost their <!-- test: prints ... --> markers"
    for where, line, _, reason, _ in DOCS_MARKED:
        assert reason is None or reason, f"{where}:{line}: a skipped block needs a reason"


def test_every_block_names_the_facts_it_prints():
    unmarked = [line for line, _, reason, facts in MARKED if reason is None and not facts]
    assert not unmarked, f"README.md blocks {unmarked}: put <!-- test: prints \"FACT\" --> on the line above each"
    block = marked_blocks('<!-- test: prints "1893", "Isobel Carrick" -->\n```python\nprint(1)\n```\n')
    assert block == [(2, "print(1)\n", None, ["1893", "Isobel Carrick"])]


def test_skip_marker_parsing():
    text = "x\n<!-- test: skip (needs a GPU) -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n"
    assert [(r, c) for _, c, r in python_blocks(text)] == [("needs a GPU", "raise SystemExit\n"), (None, "x = 1\n")]
    with pytest.raises(AssertionError, match="needs a reason"):
        python_blocks("<!-- test: skip -->\n```python\nx = 1\n```\n")


@pytest.fixture(scope="module")
def readme_home(tmp_path_factory):
    """A $KVRAG_HOME whose retrieval index holds the sample corpus, as after `kvrag ingest`."""
    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.ingest.samples import sample_corpus_dir

    home = tmp_path_factory.mktemp("readme_home")
    ChunkIndex(home / "chroma").add(load_documents([sample_corpus_dir()]))
    return home


@pytest.fixture
def tiny_engines(monkeypatch, readme_home):
    from tiny import tiny_model, tiny_tokenizer

    from kvrag.engine import KVRag
    from kvrag.model.loading import from_model

    monkeypatch.setenv("KVRAG_HOME", str(readme_home))
    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    made = []

    def from_pretrained(cls, *args, **kwargs):
        rag = cls(lm, store="memory://")
        made.append(rag)
        return rag

    monkeypatch.setattr(KVRag, "from_pretrained", classmethod(from_pretrained))
    return made


@pytest.mark.parametrize("where,code,skip", [b[:3] for b in EVERY], ids=[b[0] for b in EVERY])
def test_readme_python_block_runs(where, code, skip, tiny_engines, capsys):
    if skip is not None:
        pytest.skip(skip)
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    assert tiny_engines, "the block was expected to build an engine (KVRag.from_pretrained)"
    capsys.readouterr()


@pytest.mark.smollm
@pytest.mark.parametrize("where,code,skip,facts", EVERY, ids=[b[0] for b in EVERY])
def test_readme_python_block_prints_right_answers_on_the_bundled_model(where, code, skip, facts, readme_home,
                                                                       monkeypatch, capsys, shipped_defaults):
    """As a newcomer runs it: the bundled model, the default method and short-context policy, and the
    disk store under $KVRAG_HOME; every fact the block's marker names is in what it prints."""
    if skip is not None:
        pytest.skip(skip)
    monkeypatch.setenv("KVRAG_HOME", str(readme_home))
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out
    missing = [f for f in facts if f not in printed]
    assert not missing, f"{where} printed no {missing}:\n{printed}"


def test_chunk_index_defaults_to_kvrag_home_and_expands_home(monkeypatch, tmp_path):
    from kvrag.ingest.retrieval import ChunkIndex

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert Path(ChunkIndex().path) == tmp_path / "home" / "chroma"
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    index = ChunkIndex("~/.kvrag/chroma")
    assert Path(index.path) == tmp_path / "user" / ".kvrag" / "chroma" and index.path.startswith(str(tmp_path / "user"))
    assert not (tmp_path / "~").exists()  # no folder literally named "~"
