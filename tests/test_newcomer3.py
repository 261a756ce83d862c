"""Issue 70, item 6: the CLI gaps a newcomer met. `kvrag remove` says what it removed; every command's own
--help opens with what it does; `remove --help` offers only options that apply; `kvrag store ls` names each
entry's chunk id and document; a folder ingest's closing summary says why each skipped file was skipped.
A tiny model and a real Chroma index under a temporary $KVRAG_HOME: no bundled model loads."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from kvrag import Chunk, KVRag, from_model
from kvrag.cli import app as cli
from tiny import tiny_model, tiny_tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matrices are small: one thread is many times faster than contended ones."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVRAG_INDEX", raising=False)
    return tmp_path / "home"


@pytest.fixture
def tiny_engine(home, monkeypatch):
    """`common.open_engine` over a tiny model and the real index under $KVRAG_HOME/chroma."""
    from kvrag.ingest.retrieval import ChunkIndex

    lm = from_model(tiny_model("llama"), tiny_tokenizer())

    def fake_open(args):
        roots = [str(p) for p in getattr(args, "paths", None) or ()]
        return (KVRag(lm, store=args.store, check=False, link_adapter=None),
                ChunkIndex(home / "chroma", collection=args.collection, sources_under=roots))

    monkeypatch.setattr(importlib.import_module("kvrag.cli.common"), "open_engine", fake_open)
    return lm


def _subparsers():
    parser = cli._parser()
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices


@pytest.mark.parametrize("name", ["ingest", "remove", "quickstart", "methods", "demo"])
def test_each_commands_own_help_opens_with_what_it_does(name):
    sub = _subparsers()[name]
    assert sub.description and len(sub.description.split()) >= 4, name
    text = sub.format_help()
    first_paragraph = text.split("\n\n")[1]
    assert first_paragraph.strip().startswith(sub.description.split()[0]), text


def test_remove_help_offers_only_the_options_that_apply(capsys):
    text = _subparsers()["remove"].format_help()
    assert "--decode-weights" not in text and "--link-adapter" not in text
    for kept in ("--store", "--model", "--device", "--collection", "--index"):
        assert kept in text
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["remove", "notes.md", "--link-adapter", "none"])
    args = cli._parser().parse_args(["remove", "notes.md"])
    assert args.link_adapter == "auto" and args.decode_weights is None  # what the engine it opens is given


def test_remove_prints_what_it_removed(tmp_path, tiny_engine, capsys):
    doc = tmp_path / "notes.md"
    doc.write_text("Owls hunt at night. They see well in the dark.", encoding="utf-8")
    store = ["--store", f"disk://{tmp_path / 'kv'}", "--collection", "newcomer_rm"]
    assert cli.main(["ingest", str(doc), *store]) == 0
    capsys.readouterr()
    assert cli.main(["remove", *store, str(doc)]) == 0
    out, err = capsys.readouterr()
    assert re.search(rf"removed {re.escape(str(doc))}: 1 chunks removed from the index \(\S+\), 1 KV entries deleted", out), out
    assert cli.main(["remove", *store, str(doc)]) == 1  # nothing left: said so, on stderr
    out, err = capsys.readouterr()
    assert not out and "not in the index, nothing removed" in err


def test_a_folder_ingest_ends_saying_why_each_file_was_skipped(tmp_path, tiny_engine, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "good.md").write_text("The good document survives.", encoding="utf-8")
    (docs / "notes.txt").write_bytes(b"\x00\x01\x02binary" * 20)
    (docs / "empty.md").write_text("   \n", encoding="utf-8")
    store = ["--store", f"disk://{tmp_path / 'kv'}", "--collection", "newcomer_skip"]
    assert cli.main(["ingest", str(docs), *store]) == 3  # EXIT_SKIPPED
    err = capsys.readouterr().err
    closing = err[err.index("2 file(s) skipped"):]  # the summary after the progress bars, not the early warnings
    assert re.search(r"skipped \S*notes\.txt: not a text file \(it contains NUL bytes\)", closing), closing
    assert re.search(r"skipped \S*empty\.md: it holds no text", closing), closing


def test_store_ls_names_each_entrys_chunk_id_and_document(tmp_path, home, capsys):
    from kvrag.ingest.retrieval import ChunkIndex

    lm = from_model(tiny_model("llama"), tiny_tokenizer())
    chunks = [Chunk("owl-1", "Owls hunt at night.", metadata={"source": "birds/owls.md"}),
              Chunk("mole-1", "Moles dig tunnels.", metadata={"source": "mammals.md"})]
    ChunkIndex().add(chunks)
    url = f"disk://{tmp_path / 'kv'}"
    rag = KVRag(lm, store=url, check=False, link_adapter=None)
    rag.precompute(chunks + [Chunk("api-only", "Added through the API.")], progress=False)
    keys = dict(zip(["owl-1", "mole-1", "api-only"], rag._resolve(chunks + [Chunk("api-only", "Added through the API.")]).keys))

    assert cli.main(["store", "ls", "--store", url, "--kind", "chunk"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "chunk id" in lines[0] and "document" in lines[0]
    by_key = {line.split()[0]: line for line in lines[1:]}
    assert by_key[keys["owl-1"][:16]].split()[-2:] == ["owl-1", "birds/owls.md"]
    assert by_key[keys["mole-1"][:16]].split()[-2:] == ["mole-1", "mammals.md"]
    assert by_key[keys["api-only"][:16]].split()[-2:] == ["-", "-"]  # not in the index: nothing to name

    assert cli.main(["store", "ls", "--store", url, "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows[keys["owl-1"]]["id"], rows[keys["owl-1"]]["document"]) == ("owl-1", "birds/owls.md")
    assert rows[keys["api-only"]]["id"] is None


# -- issue 70, item 3 (in part): `kvrag ask --compare` words its speed honestly --------------------------
def _row(label: str, ttft_s: float, full_ttft_s: float, agrees, read_whole: bool = False):
    from kvrag.cli.ask import Comparison

    return Comparison(label=label, text="1893", ttft_s=ttft_s, full_ttft_s=full_ttft_s, agrees=agrees, kl=0.001,
                      reading="read whole" if read_whole else "recomputed 15%", read_whole=read_whole, context_tokens=412)


def _compared(monkeypatch, capsys, mine, json_out: bool = False) -> str:
    import argparse

    from kvrag.cli import ask

    full = _row("full", mine.full_ttft_s, mine.full_ttft_s, None)
    monkeypatch.setattr(ask, "compare_runs", lambda *a, **k: [mine, full])

    class Rag:
        default_method = "fusionrag"

    args = argparse.Namespace(temperature=0.0, method="fusionrag", json=json_out, sources=False, question="When?")
    assert ask._ask_compared(args, Rag(), [], {"recompute_ratio": 0.15}) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("ttft, full, says", [(0.100, 0.090, "1.1x slower to the first token (100 ms vs 90 ms)"),
                                              (0.050, 0.200, "4.0x sooner to the first token (50 ms vs 200 ms)"),
                                              (0.100, 0.102, "about as soon as Full Attention")])
def test_compare_calls_a_slower_answer_slower(monkeypatch, capsys, ttft, full, says):
    out = _compared(monkeypatch, capsys, _row("fusionrag@0.15", ttft, full, True))
    line = out.splitlines()[-1]
    assert says in line and line.endswith("the same answer as Full Attention (first-token KL 0.001)"), line
    if ttft > full:
        assert "sooner" not in line


def test_compare_says_read_whole_the_same_as_full_instead_of_a_ratio(monkeypatch, capsys):
    mine = _row("fusionrag@0.15", 0.077, 0.100, True, read_whole=True)  # the same work: 1.3x would be noise
    line = _compared(monkeypatch, capsys, mine).splitlines()[-1]
    assert "read whole: the same as Full" in line and not re.search(r"\d\.\dx", line), line
    rows = json.loads(_compared(monkeypatch, capsys, mine, json_out=True))["compare"]
    assert rows[0]["speedup"] is None and rows[0]["same_as_full"] is True and rows[1]["same_as_full"] is True
