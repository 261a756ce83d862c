"""Tests for kvrag.ingest.documents: splitting, ids, file discovery and the jsonl shapes."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from kvrag.ingest.documents import chunk_id, load_documents, split_text

NQ_DEV = Path(__file__).resolve().parents[2] / "shared" / "data" / "nq10_dev.jsonl"


def _words(texts: list[str]) -> list[str]:
    return [w for t in texts for w in t.split()]


def _sha16(title: str, text: str) -> str:
    return hashlib.sha256((title + "\n" + text).encode("utf-8")).hexdigest()[:16]


# --- split_text -----------------------------------------------------------------------------


def test_split_packs_short_paragraphs_together() -> None:
    text = "one two three.\n\nfour five.\n\n\n   \nsix seven eight nine."
    assert split_text(text, max_words=100) == ["one two three.\n\nfour five.\n\nsix seven eight nine."]


def test_split_starts_new_chunk_when_next_paragraph_does_not_fit() -> None:
    text = "a b c\n\nd e f\n\ng h"
    assert split_text(text, max_words=6) == ["a b c\n\nd e f", "g h"]
    assert split_text(text, max_words=5) == ["a b c", "d e f\n\ng h"]


def test_split_long_paragraph_on_sentence_ends() -> None:
    s1 = "The cat sat on the mat."
    s2 = "It was warm there!"
    s3 = "Was it happy?"
    chunks = split_text(f"{s1} {s2} {s3}", max_words=10)
    # The 6+4 words of s1+s2 fit in 10; s3 starts a new chunk.
    assert chunks == [f"{s1} {s2}", s3]


def test_split_hard_splits_a_sentence_longer_than_max() -> None:
    words = [f"w{i}" for i in range(25)]
    chunks = split_text(" ".join(words), max_words=10)
    assert [len(c.split()) for c in chunks] == [10, 10, 5]
    assert _words(chunks) == words


def test_split_normalises_whitespace_and_drops_empty() -> None:
    assert split_text("  hello\t  world \n  again  ") == ["hello world again"]
    assert split_text("") == []
    assert split_text("\n\n   \n\t\n") == []


def test_split_rejects_nonpositive_max_words() -> None:
    with pytest.raises(ValueError):
        split_text("x", max_words=0)


@pytest.mark.parametrize("seed", range(30))
def test_split_respects_size_and_keeps_every_word_in_order(seed: int) -> None:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta.", "eps!", "zeta?", "eta", '"quote."', "(paren.)"]
    paragraphs = []
    for _ in range(rng.randint(0, 12)):
        n = rng.choice([0, 1, 3, 10, 40, 150, 400])
        paragraphs.append(" ".join(rng.choice(vocab) for _ in range(n)))
    seps = ["\n\n", "\n \n", "\n\n\n", "\r\n\r\n", "\n\t\n"]
    text = "".join(p + rng.choice(seps) for p in paragraphs)
    max_words = rng.choice([1, 5, 17, 120])
    chunks = split_text(text, max_words=max_words)
    assert all(c.strip() for c in chunks), "no empty chunks"
    assert all(len(c.split()) <= max_words for c in chunks)
    assert _words(chunks) == text.split()


# --- ids ------------------------------------------------------------------------------------


def test_chunk_id_is_content_addressed() -> None:
    assert chunk_id("T", "body") == _sha16("T", "body")
    assert len(chunk_id("T", "body")) == 16
    assert chunk_id("T", "body") != chunk_id("U", "body")
    assert chunk_id("T", "body") != chunk_id("T", "body!")


def test_ids_stable_across_reingestion_and_match_content(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("First paragraph here.\n\nSecond one.\n", encoding="utf-8")
    a = load_documents([f])
    b = load_documents([str(f)])
    assert [c.id for c in a] == [c.id for c in b]
    assert len(a) == 1
    c = a[0]
    assert c.title == "notes"
    assert c.id == _sha16(c.title, c.text)
    assert c.metadata == {"source": str(f)}


def test_identical_chunks_are_deduplicated_first_kept(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "same.txt").write_text("identical text", encoding="utf-8")
    (tmp_path / "b" / "same.txt").write_text("identical text", encoding="utf-8")
    chunks = load_documents([tmp_path])
    assert len(chunks) == 1
    assert chunks[0].metadata["source"] == str(tmp_path / "a" / "same.txt")


# --- files and folders ----------------------------------------------------------------------


def test_folders_are_recursed_and_unsupported_files_skipped(tmp_path: Path) -> None:
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "top.txt").write_text("top level text", encoding="utf-8")
    (tmp_path / "sub" / "mid.md").write_text("# Heading\n\nmiddle text", encoding="utf-8")
    (tmp_path / "sub" / "deeper" / "deep.jsonl").write_text(
        json.dumps({"text": "deep text", "title": "Deep"}) + "\n", encoding="utf-8"
    )
    (tmp_path / "sub" / "image.png").write_bytes(b"\x89PNG not text")
    (tmp_path / "sub" / "data.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    chunks = load_documents([tmp_path])
    assert sorted(c.text for c in chunks) == ["deep text", "middle text", "top level text"]


def test_single_path_string_is_accepted(tmp_path: Path) -> None:
    f = tmp_path / "x.txt"
    f.write_text("hello", encoding="utf-8")
    assert [c.text for c in load_documents(str(f))] == ["hello"]  # type: ignore[arg-type]


def test_missing_path_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_documents([tmp_path / "nope.txt"])


def test_explicit_unsupported_file_raises_value_error(tmp_path: Path) -> None:
    f = tmp_path / "table.csv"
    f.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unsupported"):
        load_documents([f])


def test_long_txt_is_split_with_stem_title(tmp_path: Path) -> None:
    words = [f"word{i}" for i in range(300)]
    f = tmp_path / "long.txt"
    f.write_text(" ".join(words), encoding="utf-8")
    chunks = load_documents([f], max_words=50)
    assert len(chunks) == 6
    assert all(c.title == "long" for c in chunks)
    assert _words([c.text for c in chunks]) == words
    assert len({c.id for c in chunks}) == 6


def test_markdown_titles_come_from_nearest_heading(tmp_path: Path) -> None:
    md = (
        "Intro before any heading.\n\n"
        "# Cats\n\nCats purr.\n\n"
        "## Kittens ##\n\nKittens play.\n\n"
        "```python\n# not a heading\nx = 1\n```\n"
    )
    f = tmp_path / "guide.md"
    f.write_text(md, encoding="utf-8")
    chunks = load_documents([f])
    by_title = {c.title: c.text for c in chunks}
    assert by_title["guide"] == "Intro before any heading."
    assert by_title["Cats"] == "Cats purr."
    assert by_title["Kittens"].startswith("Kittens play.")
    assert "# not a heading" in by_title["Kittens"]
    assert "not a heading" not in by_title


# --- jsonl ----------------------------------------------------------------------------------


def test_jsonl_text_rows_with_explicit_id_and_title(tmp_path: Path) -> None:
    f = tmp_path / "docs.jsonl"
    rows = [
        {"id": "doc-1", "title": "Paris", "text": "Paris is the capital of France."},
        {"text": "No id or title here."},
        {"id": 7, "title": "Long", "text": " ".join(f"w{i}" for i in range(30))},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    chunks = load_documents([f], max_words=10)
    assert chunks[0].id == "doc-1"
    assert chunks[0].title == "Paris"
    assert chunks[1].title == ""
    assert chunks[1].id == _sha16("", "No id or title here.")
    # A long row splits into several chunks, which get content ids (one id cannot name three).
    long_chunks = chunks[2:]
    assert len(long_chunks) == 3
    assert all(c.id == _sha16("Long", c.text) for c in long_chunks)
    assert all(c.metadata == {"source": str(f)} for c in chunks)


def test_jsonl_ctxs_rows_give_one_document_per_passage(tmp_path: Path) -> None:
    f = tmp_path / "eval.jsonl"
    rows = [
        {"id": "q1", "question": "?", "ctxs": [{"title": "A", "text": "alpha text"}, {"title": "B", "text": "beta text"}]},
        {"id": "q2", "question": "?", "ctxs": [{"title": "B", "text": "beta text"}, {"title": "C", "text": "gamma"}]},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    chunks = load_documents([f])
    assert [(c.title, c.text) for c in chunks] == [("A", "alpha text"), ("B", "beta text"), ("C", "gamma")]
    assert all(c.id == _sha16(c.title, c.text) for c in chunks)


@pytest.mark.parametrize(
    "line",
    ["not json", "[1, 2]", json.dumps({"foo": "bar"}), json.dumps({"ctxs": [{"title": "x"}]})],
)
def test_jsonl_bad_rows_raise_value_error_with_location(tmp_path: Path, line: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_documents([f])


@pytest.mark.skipif(not NQ_DEV.exists(), reason="evaluation data not present")
def test_real_eval_file_rows(tmp_path: Path) -> None:
    with NQ_DEV.open(encoding="utf-8") as src:
        lines = [next(src) for _ in range(2)]
    f = tmp_path / "nq_two.jsonl"
    f.write_text("".join(lines), encoding="utf-8")
    rows = [json.loads(line) for line in lines]
    chunks = load_documents([f], max_words=10_000)
    expected = {(c["title"], " ".join(c["text"].split())) for r in rows for c in r["ctxs"]}
    assert {(c.title, " ".join(c.text.split())) for c in chunks} == expected
    assert len(chunks) == len(expected)


# --- token caps (issue #18) -------------------------------------------------------------------


class _ByteTokenizer:
    """One token per UTF-8 byte (the worst case of a byte-level BPE), HF-style call and encode."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))


def test_a_run_without_spaces_is_split_to_the_token_cap() -> None:
    from kvrag.ingest.documents import split_text

    text = "x" * 100_000  # one "word": the word splitter alone gives one 100k-token chunk
    chunks = split_text(text, max_words=120, max_tokens=256, tokenizer=_ByteTokenizer())
    assert all(1 <= len(c.encode()) <= 256 for c in chunks)
    assert "".join(chunks) == text


def test_long_words_text_is_capped_with_a_tokenizer_and_keeps_every_word() -> None:
    from kvrag.ingest.documents import split_text

    words = [f"{'w' * 30}{i}" for i in range(400)]  # 120 words of ~33 bytes: ~4k tokens per chunk
    chunks = split_text(" ".join(words), max_words=120, max_tokens=256, tokenizer=_ByteTokenizer())
    assert all(len(c.encode()) <= 256 for c in chunks)
    assert _words(chunks) == words


def test_without_a_tokenizer_a_byte_bound_caps_chunks() -> None:
    from kvrag.ingest.documents import BYTES_PER_TOKEN_BOUND, split_text

    text = "\u4e2d" * 50_000  # no spaces, 3 bytes per character
    chunks = split_text(text, max_tokens=256)
    assert all(len(c.encode()) <= 256 * BYTES_PER_TOKEN_BOUND for c in chunks)
    assert "".join(chunks) == text


def test_ordinary_text_keeps_its_chunks_and_ids_under_the_cap(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("First paragraph here.\n\nSecond one.\n", encoding="utf-8")
    assert [c.id for c in load_documents([f], tokenizer=_ByteTokenizer())] == [c.id for c in load_documents([f])]


def test_load_documents_caps_tokens_per_chunk(tmp_path: Path) -> None:
    f = tmp_path / "blob.txt"
    rng = random.Random(0)
    text = "".join(rng.choice("abcdef") for _ in range(20_000))  # no spaces, no repeated chunks
    f.write_text(text, encoding="utf-8")
    chunks = load_documents([f], max_tokens=100, tokenizer=_ByteTokenizer())
    assert len(chunks) == 200 and all(len(c.text) <= 100 for c in chunks)
    assert "".join(c.text for c in chunks) == text


def test_check_chunk_lengths_refuses_a_chunk_longer_than_the_context() -> None:
    from kvrag.ingest.documents import check_chunk_lengths
    from kvrag.errors import ContextTooLongError
    from kvrag.types import Chunk

    ok = Chunk(id="ok", text="short")
    check_chunk_lengths([ok], _ByteTokenizer(), max_tokens=10)
    with pytest.raises(ContextTooLongError, match=r"'big'.*12 tokens.*10"):
        check_chunk_lengths([ok, Chunk(id="big", text="x" * 12)], _ByteTokenizer(), max_tokens=10)


# --- binary content (issue #18) -------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        b"\x7fELF\x02\x01\x01\x00\x00\x00" + bytes(range(256)) * 60,  # a program binary
        b"text with a NUL\x00 in it",
        "caf\u00e9 cr\u00e8me br\u00fbl\u00e9e".encode("latin-1"),  # not UTF-8
        ("ok " + "\x01\x02\x03\x04\x05" * 20) .encode(),  # mostly control characters
    ],
)
@pytest.mark.parametrize("suffix", [".txt", ".md", ".jsonl"])
def test_binary_content_is_refused_naming_the_file(tmp_path: Path, data: bytes, suffix: str) -> None:
    from kvrag.ingest.documents import NotTextError

    f = tmp_path / f"program{suffix}"
    f.write_bytes(data)
    with pytest.raises(NotTextError, match=r"program\.") as info:
        load_documents([f])
    assert isinstance(info.value, ValueError)
    with pytest.raises(NotTextError):
        load_documents([tmp_path])  # inside a folder too


def test_is_text_accepts_real_text() -> None:
    from kvrag.ingest.documents import is_text

    assert is_text("Tabs\tand\r\nnewlines, caf\u00e9, \u4e2d\u6587, form\x0cfeed.".encode())
    assert is_text(b"")
    assert not is_text(b"\x00")


def test_document_chunk_ids_are_the_ids_ingest_gives(tmp_path: Path) -> None:
    from kvrag.ingest.documents import document_chunk_ids

    f = tmp_path / "doc.md"
    f.write_text("# A\n\nalpha text\n\n# B\n\nbeta text\n", encoding="utf-8")
    (tmp_path / "other.txt").write_text("other text", encoding="utf-8")
    ids = document_chunk_ids(f)
    assert ids == [c.id for c in load_documents([f])] and len(ids) == 2
    assert set(ids).isdisjoint(c.id for c in load_documents([tmp_path / "other.txt"]))
