"""The README's ```python blocks run as written.

Every block runs in a fresh namespace, in order, with two substitutions so the suite stays fast and
offline: `KVRag.from_pretrained` returns an engine on a tiny random Llama (tests/tiny.py) over a
memory store instead of loading the bundled SmolLM2, and $KVRAG_HOME is a temporary folder whose
retrieval index holds the bundled sample corpus (what `kvrag ingest` would have put there). What a
block prints is not checked (a random model's answers), only that it runs. A block preceded by
`<!-- test: skip (reason) -->` is skipped with that reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"<!--\s*test:\s*skip\s*(?:\((?P<reason>[^)]*)\))?\s*-->")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(line number, code, skip reason or None) of each ```python block."""
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        skip = _SKIP.search(before[-1]) if before else None
        reason = None
        if skip:
            reason = (skip.group("reason") or "").strip()
            if not reason:
                raise AssertionError(f"README.md:{line}: a skipped block needs a reason: <!-- test: skip (why) -->")
        out.append((line, m.group(1), reason))
    return out


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def test_blocks_are_found_and_skips_are_few():
    assert len(BLOCKS) >= 3, "README's python blocks were not found: has the fence syntax changed?"
    skipped = [b for b in BLOCKS if b[2] is not None]
    assert len(skipped) <= 2, f"keep skipped README blocks few: {[(ln, r) for ln, _, r in skipped]}"


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


@pytest.mark.parametrize("line,code,skip", BLOCKS, ids=[f"README.md:{b[0]}" for b in BLOCKS])
def test_readme_python_block_runs(line, code, skip, tiny_engines, capsys):
    if skip is not None:
        pytest.skip(skip)
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    assert tiny_engines, "the block was expected to build an engine (KVRag.from_pretrained)"
    capsys.readouterr()


def test_chunk_index_defaults_to_kvrag_home_and_expands_home(monkeypatch, tmp_path):
    from kvrag.ingest.retrieval import ChunkIndex

    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    assert Path(ChunkIndex().path) == tmp_path / "home" / "chroma"
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    index = ChunkIndex("~/.kvrag/chroma")
    assert Path(index.path) == tmp_path / "user" / ".kvrag" / "chroma" and index.path.startswith(str(tmp_path / "user"))
    assert not (tmp_path / "~").exists()  # no folder literally named "~"
