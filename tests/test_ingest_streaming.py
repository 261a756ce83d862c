"""Issue #37 items 2 and 11: ingest streams (KV stored batch by batch, indexed only once stored, memory
flat in the number of chunks, an interrupted ingest keeps what it stored and a rerun completes it), and
a folder walk neither follows symlinks out of the folder nor lets one bad file abort the rest."""

from __future__ import annotations

import builtins
import gc
import importlib
import json
import random
import re
import tracemalloc
import weakref
from pathlib import Path

import pytest

from kvrag.defaults import DEFAULT_DISK_PRECISION
from kvrag import Chunk, KVRag, from_model
from kvrag.cli import app as cli
from kvrag.ingest import documents
from kvrag.ingest.documents import load_documents, split_text
from tiny import tiny_model, tiny_tokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's matrices are small: one thread is many times faster than contended ones."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rag(store: str = "memory://") -> KVRag:
    return KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store=store, check=False, link_adapter=None)


def _chunks(n: int, tag: str = "c", words: int = 12) -> list[Chunk]:
    rng = random.Random(f"{tag}{n}")
    return [Chunk(f"{tag}{i}", f"{tag} {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))) for i in range(n)]


class _Computes:
    """Counts the model's forward batches of chunk KV; `fail_after`: the next one raises."""

    def __init__(self, rag: KVRag, fail_after: int | None = None) -> None:
        self.calls = 0
        self.fail_after = fail_after
        self._real = rag.computer._chunk_batch
        rag.computer._chunk_batch = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("killed mid-ingest")
        self.calls += 1
        return self._real(*args, **kwargs)


# --- the library's precompute streams -------------------------------------------------------


def test_precompute_writes_each_batch_to_the_store_before_computing_the_next():
    rag = _rag()
    computes = _Computes(rag)
    seen_at_put: list[int] = []
    real_put = rag.store.put

    def put(key, entry):
        seen_at_put.append(computes.calls)
        return real_put(key, entry)

    rag.store.put = put  # type: ignore[method-assign]
    chunks = _chunks(40)
    report = rag.precompute(chunks, batch_size=4, progress=False)
    assert computes.calls == 10
    assert report.chunks == 40 and report.computed == 40 and report.already_cached == 0 and not report.not_stored
    assert report.tokens == sum(len(rag.layout.chunk_ids(c)) for c in chunks)
    chunk_puts = seen_at_put[1:]  # the first put is the system prefix's
    assert len(chunk_puts) == 40
    # every batch's 4 entries are in the store before the next batch is computed
    assert chunk_puts == [1 + i // 4 for i in range(40)], chunk_puts
    # and a generator works: it is read as it goes
    again = rag.precompute((c for c in chunks), progress=False)
    assert again.chunks == 40 and again.already_cached == 40 and again.computed == 0


def test_interrupted_precompute_keeps_what_it_stored_and_a_rerun_completes(tmp_path):
    store = f"disk://{tmp_path / 'kv'}"
    rag = _rag(store)
    _Computes(rag, fail_after=3)
    chunks = _chunks(30)
    with pytest.raises(RuntimeError, match="killed"):
        rag.precompute(chunks, batch_size=4, progress=False)
    fresh = _rag(store)  # another process: only what reached the store counts
    keys = fresh.repo.resolve(chunks).keys
    assert sum(fresh.repo.guarded.contains(k) for k in keys) == 12  # 3 batches of 4
    links = fresh.repo.guarded.resolve([f"{fresh.repo.namespace}/{c.id}" for c in chunks])
    assert all(fresh.repo.guarded.contains(k) for k in links if k)  # no id linked to KV that was never stored
    computes = _Computes(fresh)
    report = fresh.precompute(chunks, batch_size=4, progress=False)
    assert report.already_cached == 12 and report.computed == 18 and computes.calls == 5
    assert all(fresh.repo.guarded.contains(k) for k in keys)


def _precompute_peaks(n: int, tmp_path: Path) -> tuple[int, int]:
    """(tracemalloc peak in bytes, most chunk KV stacks alive when a forward batch starts) for `n` chunks."""
    rag = _rag(f"disk://{tmp_path / f'kv{n}'}")  # a disk store keeps no tensors in memory
    rag.prefix_kv()
    real = rag.computer._chunk_batch
    alive: list[weakref.ref] = []
    most = [0]

    def counting(*args, **kwargs):  # KV has no reference cycles: what is let go is freed at once
        most[0] = max(most[0], sum(r() is not None for r in alive))
        out = real(*args, **kwargs)
        alive.extend(weakref.ref(k) for k, _ in out)
        return out

    rag.computer._chunk_batch = counting  # type: ignore[method-assign]
    chunks = _chunks(n, tag=f"m{n}", words=20)
    gc.collect()
    tracemalloc.start()
    try:
        report = rag.precompute(chunks, batch_size=8, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.computed == n
    return peak, most[0]


def test_precompute_memory_does_not_grow_with_the_number_of_chunks(tmp_path):
    peak_100, alive_100 = _precompute_peaks(100, tmp_path)
    peak_400, alive_400 = _precompute_peaks(400, tmp_path)
    # no chunk's KV outlives its batch: it is stored and dropped before the next batch is computed
    assert alive_100 == 0 and alive_400 == 0, (alive_100, alive_400)
    # a chunk's KV here is ~90 KB, so 300 more chunks' KV held would add ~27 MB; the registries' few hundred
    # bytes a chunk of ids and text (kept by design) and one-off allocations of earlier tests are allowed
    assert peak_400 <= 1.5 * peak_100 + (1 << 20), (peak_100, peak_400)


# --- documents are read as they stream ---------------------------------------------------------


def test_a_file_is_chunked_as_it_is_read(tmp_path):
    f = tmp_path / "big.txt"
    paragraph = " ".join(WORDS * 3) + "."
    f.write_text("\n\n".join(f"{i} {paragraph}" for i in range(2000)), encoding="utf-8")
    read = [0]

    def on_bytes(n: int) -> None:
        read[0] += n

    chunks = documents.iter_file_chunks(f, max_words=60, check=False, on_bytes=on_bytes)
    first = next(chunks)
    assert first.text.startswith("0 alpha") and read[0] < f.stat().st_size // 100
    rest = list(chunks)
    assert read[0] == f.stat().st_size
    assert [first.text] + [c.text for c in rest] == split_text(f.read_text(encoding="utf-8"), max_words=60)


def _old_split_words(text: str, max_words: int) -> list[str]:
    """The splitter before streaming (kvrag 37c): chunk ids must not change."""
    units: list[tuple[int, list[str]]] = []
    for p, paragraph in enumerate(re.split(r"\n[ \t\r\f\v]*\n", text)):
        words = paragraph.split()
        if not words:
            continue
        if len(words) <= max_words:
            units.append((p, words))
            continue
        sentences, current = [], []
        for word in words:
            current.append(word)
            if re.search(r"[.!?][\"'\u201d\u2019)\]]*$", word):
                sentences.append(current)
                current = []
        if current:
            sentences.append(current)
        for sentence in sentences:
            for start in range(0, len(sentence), max_words):
                units.append((p, sentence[start : start + max_words]))
    chunks, current, size = [], [], 0

    def flush():
        parts, last = [], None
        for p, words in current:
            parts.append(" ".join(words) if last is None else (" " if p == last else "\n\n") + " ".join(words))
            last = p
        chunks.append("".join(parts))

    for p, words in units:
        if current and size + len(words) > max_words:
            flush()
            current, size = [], 0
        current.append((p, words))
        size += len(words)
    if current:
        flush()
    return chunks


def _old_markdown(text: str, stem: str, max_words: int) -> list[tuple[str, str]]:
    out, title, body, fence = [], stem, [], False

    def section():
        out.extend((title, c) for c in split_text("\n".join(body), max_words, None))

    for line in text.splitlines():
        if re.match(r"^ {0,3}(```|~~~)", line):
            fence = not fence
        elif not fence:
            m = re.match(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", line)
            if m:
                section()
                title, body = (m.group(2).strip() or stem), []
                continue
        body.append(line)
    section()
    return out


PIECES = ["a", "b.", "end!", "why?", '"q."', "word", "café", " ", "  ", "\t", "\n", "\n\n", "\n \t\n", "\r\n", "\r\n\r\n",
          "\r", "\u2028", "\x85", "\xa0", "\ufeff", "# Head\n", "\n## Sub ##\n", "```\n", "\n# \n", "   # not\n"]


@pytest.mark.parametrize("seed", range(3))
def test_streamed_chunks_are_the_chunks_of_the_whole_text(tmp_path, seed):
    rng = random.Random(seed)
    for trial in range(150):
        text = "".join(rng.choice(PIECES) + (" " if rng.random() < 0.6 else "") for _ in range(rng.randint(0, 120)))
        max_words = rng.choice([1, 2, 3, 5, 8, 40])
        assert split_text(text, max_words, None) == _old_split_words(text, max_words)
        txt, md = tmp_path / f"t{trial}.txt", tmp_path / f"t{trial}.md"
        txt.write_bytes(text.encode("utf-8"))
        md.write_bytes(text.encode("utf-8"))
        whole = text.removeprefix("\ufeff")
        assert [c.text for c in documents.iter_file_chunks(txt, max_words, None, check=False)] == _old_split_words(whole, max_words)
        assert [(c.title, c.text) for c in documents.iter_file_chunks(md, max_words, None, check=False)] == _old_markdown(whole, md.stem, max_words)


# --- the CLI: streamed, interrupted, rerun -------------------------------------------------------


@pytest.fixture()
def cli_engine(monkeypatch, tmp_path):
    """`kvrag ingest` over a tiny model and a real Chroma index; `opened` lists each engine made."""
    from kvrag.ingest.retrieval import ChunkIndex

    opened: list[dict] = []

    def fake_open(args):
        rag = _rag(args.store)
        index = ChunkIndex(tmp_path / "chroma", collection=args.collection)
        opened.append({"rag": rag, "index": index, "store": args.store})
        if hook[0] is not None:
            hook[0](rag, index)
        return rag, index

    hook: list = [None]
    monkeypatch.setattr(importlib.import_module("kvrag.cli.common"), "open_engine", fake_open)
    monkeypatch.setattr(importlib.import_module("kvrag.cli.ingest"), "INGEST_BATCH", 16)
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    return opened, hook


def _doc(tmp_path: Path, n: int = 60) -> Path:
    f = tmp_path / "docs" / "long.txt"
    f.parent.mkdir(exist_ok=True)
    rng = random.Random(n)
    f.write_text("\n\n".join(f"Paragraph {i}: " + " ".join(rng.choice(WORDS) for _ in range(6)) + "." for i in range(n)), encoding="utf-8")
    return f


def test_an_interrupted_ingest_indexes_only_stored_chunks_and_a_rerun_completes(tmp_path, cli_engine, capsys):
    opened, hook = cli_engine
    doc = _doc(tmp_path)
    expected = load_documents([doc], max_words=8, tokenizer=tiny_tokenizer())
    assert len(expected) == 60
    store = f"disk://{tmp_path / 'kv'}"
    args = ["ingest", str(doc), "--store", store, "--collection", "streamed", "--max-words", "8", "--batch-size", "4"]
    hook[0] = lambda rag, index: _Computes(rag, fail_after=6)  # 24 chunks computed, then killed
    with pytest.raises(RuntimeError, match="killed"):
        cli.main(args)
    err = capsys.readouterr().err
    assert "16 chunks were stored and indexed before the error" in err
    rag, index = opened[-1]["rag"], opened[-1]["index"]
    keys = dict(zip([c.id for c in expected], rag.repo.resolve(expected).keys))
    stored = {i for i, k in keys.items() if rag.repo.guarded.contains(k)}
    assert len(stored) == 24  # every forward batch it computed is kept
    in_index = {c.id for c in index.get(list(keys))}
    assert len(in_index) == 16 and in_index <= stored  # only chunks whose KV is stored, a whole group of 16

    hook[0] = None
    upserted: list[str] = []
    real_add = type(index).add

    def spy_add(self, chunks, batch_size=256, skip_unchanged=False):
        real = self._collection.upsert

        def upsert(ids, **kw):
            upserted.extend(ids)
            return real(ids=ids, **kw)

        self._collection.upsert = upsert
        try:
            return real_add(self, chunks, batch_size, skip_unchanged)
        finally:
            del self._collection.upsert

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(index), "add", spy_add)
        assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert "ingested 60 chunks (36 computed, 24 already cached" in err
    for stage in ("chunks read", "KV stored", "indexed"):
        assert stage in err  # one progress bar per stage
    rag, index = opened[-1]["rag"], opened[-1]["index"]
    assert len(index) == 60 and {c.id for c in index.get(list(keys))} == set(keys)
    assert all(rag.repo.guarded.contains(k) for k in keys.values())
    assert not set(upserted) & in_index and len(upserted) == 44  # what was indexed is not embedded again
    assert cli.main(args) == 0 and len(opened[-1]["index"]) == 60  # a third run: nothing to do, no duplicates
    assert "60 already cached" in capsys.readouterr().err


def test_ingest_writes_to_the_disk_store_only_by_default(tmp_path, cli_engine, capsys):
    opened, _ = cli_engine
    doc = _doc(tmp_path, 5)
    assert cli.main(["ingest", str(doc), "--collection", "defaults"]) == 0
    # no memory tier filling up in front; the default disk store's precision (what the engine's default reads)
    assert opened[-1]["store"] == f"disk://{tmp_path / 'home' / 'kv'}?quantize={DEFAULT_DISK_PRECISION}"


# --- item 11: symlinks and bad files ----------------------------------------------------------


def _tree(tmp_path: Path) -> Path:
    """docs/ with a file, a subfolder, links inside it, and links leading out of it."""
    outside = tmp_path / "outside"
    (outside / "private").mkdir(parents=True)
    (outside / "secret.txt").write_text("root:x:0:0:secret password line", encoding="utf-8")
    (outside / "private" / "notes.md").write_text("private notes far away", encoding="utf-8")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "guide.txt").write_text("the guide text", encoding="utf-8")
    (docs / "sub" / "inner.md").write_text("inner text", encoding="utf-8")
    (docs / "passwd.txt").symlink_to(outside / "secret.txt")
    (docs / "elsewhere").symlink_to(outside / "private")
    (docs / "alias.md").symlink_to(docs / "sub" / "inner.md")  # stays inside: read
    (docs / "sub" / "up").symlink_to(docs)  # a loop, inside
    return docs


def test_a_folder_walk_does_not_follow_symlinks_out_of_it(tmp_path):
    docs = _tree(tmp_path)
    texts = sorted((c.title, c.text) for c in load_documents([docs]))
    assert texts == [("alias", "inner text"), ("guide", "the guide text"), ("inner", "inner text")]
    skipped: list = []
    files = documents.document_files([docs], skipped=skipped)
    assert docs / "passwd.txt" not in files and docs / "alias.md" in files
    assert {s.path.name for s in skipped} == {"passwd.txt", "elsewhere"} and all(s.symlink for s in skipped)
    followed = sorted({c.text for c in load_documents([docs], follow_symlinks=True)})
    assert followed == ["inner text", "private notes far away", "root:x:0:0:secret password line", "the guide text"]
    # a file named explicitly is read as given, link or not
    assert [c.text for c in load_documents([docs / "passwd.txt"])] == ["root:x:0:0:secret password line"]


def test_cli_ingest_of_a_folder_skips_links_out_of_it_unless_asked(tmp_path, cli_engine, capsys):
    opened, _ = cli_engine
    docs = _tree(tmp_path)
    store = ["--store", f"disk://{tmp_path / 'kv'}", "--collection", "links"]
    assert cli.main(["ingest", str(docs), *store]) == 0
    err = capsys.readouterr().err
    assert "not following" in err and "passwd.txt" in err and "--follow-symlinks" in err
    index = opened[-1]["index"]
    assert {c.text for c in index.query("secret password", k=10)} == {"inner text", "the guide text"}  # no link out
    assert cli.main(["ingest", str(docs), *store, "--follow-symlinks"]) == 0
    assert "root:x:0:0:secret password line" in {c.text for c in opened[-1]["index"].query("secret password", k=10)}


def _bad_folder(tmp_path: Path, monkeypatch) -> Path:
    docs = tmp_path / "mixed"
    docs.mkdir()
    (docs / "good.md").write_text("# Good\n\nThe good document survives.", encoding="utf-8")
    (docs / "program.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    (docs / "latin.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (docs / "rows.jsonl").write_text(json.dumps({"text": "fine row"}) + "\n[1, 2]\n", encoding="utf-8")
    (docs / "locked.txt").write_text("cannot be read", encoding="utf-8")
    real_open = builtins.open

    def guarded_open(file, *args, **kwargs):  # tests run as root here: chmod 000 would not stop a read
        if Path(file).name == "locked.txt":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(documents, "open", guarded_open, raising=False)
    return docs


def test_a_bad_file_in_a_folder_is_reported_and_skipped_before_the_model_loads(tmp_path, cli_engine, capsys, monkeypatch):
    opened, _ = cli_engine
    docs = _bad_folder(tmp_path, monkeypatch)
    store = ["--store", f"disk://{tmp_path / 'kv'}", "--collection", "mixed"]
    assert cli.main(["ingest", str(docs), *store]) == 3 == importlib.import_module("kvrag.cli.ingest").EXIT_SKIPPED
    err = capsys.readouterr().err
    for name, why in (("program.txt", "not a text file"), ("latin.txt", "not valid UTF-8"), ("rows.jsonl:2", "must be a JSON object"),
                      ("locked.txt", "Permission denied")):
        assert re.search(rf"skipping .*{re.escape(name)}.*{re.escape(why)}", err), (name, err)
    assert "4 file(s) skipped" in err
    assert [c.text for c in opened[-1]["index"].query("document", k=5)] == ["The good document survives."]
    # the files are read through before any model loads: a folder of bad files loads none
    for name in ("good.md",):
        (docs / name).unlink()
    before = len(opened)
    assert cli.main(["ingest", str(docs), *store]) == 1
    assert len(opened) == before and "no text found" in capsys.readouterr().err


def test_a_bad_file_named_explicitly_is_an_error_before_the_model_loads(tmp_path, cli_engine, capsys, monkeypatch):
    opened, _ = cli_engine
    docs = _bad_folder(tmp_path, monkeypatch)
    for name in ("program.txt", "rows.jsonl", "locked.txt"):
        assert cli.main(["ingest", str(docs / "good.md"), str(docs / name), "--store", f"disk://{tmp_path / 'kv'}"]) == 2
        assert name in capsys.readouterr().err
    assert opened == []


def test_ingest_through_a_server_indexes_only_what_the_server_kept(tmp_path, monkeypatch, capsys):
    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag import client
    from kvrag.client import ServerError

    index = ChunkIndex(tmp_path / "chroma", collection="served")
    monkeypatch.setattr(importlib.import_module("kvrag.cli.common"), "open_index", lambda args: index)
    monkeypatch.setattr(importlib.import_module("kvrag.cli.ingest"), "INGEST_BATCH", 16)
    sent: list[list[str]] = []

    def fake_ingest(url, chunks, **kw):
        chunks = list(chunks)
        if len(sent) == 2:
            raise ServerError("503 kv_not_stored")
        sent.append([c.id for c in chunks])
        return {"chunks": len(chunks), "computed": len(chunks), "already_cached": 0, "tokens": 1, "seconds": 0.1}

    monkeypatch.setattr(client, "ingest_via_server", fake_ingest)
    doc = _doc(tmp_path)
    assert cli.main(["ingest", str(doc), "--server", "http://127.0.0.1:1", "--max-words", "8"]) == 2
    assert "kv_not_stored" in capsys.readouterr().err
    assert [len(b) for b in sent] == [16, 16]
    assert {c.id for c in index.get([i for b in sent for i in b])} == {i for b in sent for i in b} and len(index) == 32


def test_ctrl_c_keeps_what_was_stored_and_a_store_that_keeps_nothing_stops_the_ingest(tmp_path, cli_engine, capsys):
    import socket

    opened, hook = cli_engine
    doc = _doc(tmp_path)
    args = ["ingest", str(doc), "--collection", "ctrl_c", "--max-words", "8", "--batch-size", "4"]

    def interrupt_later(rag, index):
        computes = _Computes(rag)
        real = computes._real

        def compute(*a, **kw):
            if computes.calls == 5:
                raise KeyboardInterrupt
            computes.calls += 1
            return real(*a, **kw)

        rag.computer._chunk_batch = compute

    hook[0] = interrupt_later
    try:
        code = cli.main([*args, "--store", f"disk://{tmp_path / 'kv'}"])
    except KeyboardInterrupt:  # a traceback, not a summary and an exit code
        code = None
    assert code == 130
    assert "interrupted: 16 chunks are stored and indexed (kept)" in capsys.readouterr().err
    assert len(opened[-1]["index"]) == 16

    hook[0] = None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = f"redis://127.0.0.1:{port}/0?connect_timeout=0.2&socket_timeout=0.2"
    assert cli.main([*args, "--store", down, "--collection", "down"]) == 1
    err = capsys.readouterr().err
    assert "was not stored" in err and "so the ingest stopped" in err and "They are not indexed" in err
    assert "\ningested " not in "\n" + err and "stored and indexed 0 of" in err  # the failure, never a success line first
    assert len(opened[-1]["index"]) == 0
