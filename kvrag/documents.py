"""Turning user files (.txt, .md, .jsonl) into retrievable chunks.

Chunk ids are content-addressed, so ingesting the same files twice gives the same ids: the
index upserts instead of duplicating, and per-chunk KV caches keyed by id stay valid.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvrag.types import Chunk

__all__ = ["SUPPORTED_EXTENSIONS", "chunk_id", "load_documents", "split_text"]

SUPPORTED_EXTENSIONS = (".txt", ".md", ".jsonl")

_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
# A word that ends a sentence: . ! or ? possibly followed by closing quotes/brackets.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def chunk_id(title: str, text: str) -> str:
    """Content-addressed id: first 16 hex digits of sha256(title + "\\n" + text)."""
    return hashlib.sha256(f"{title}\n{text}".encode("utf-8")).hexdigest()[:16]


def _sentences(words: list[str]) -> list[list[str]]:
    """Group a paragraph's words into sentences (a sentence ends at . ! ? plus closers)."""
    out: list[list[str]] = []
    current: list[str] = []
    for word in words:
        current.append(word)
        if _SENTENCE_END.search(word):
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def split_text(text: str, max_words: int = 120) -> list[str]:
    """Split text into chunks of at most `max_words` words, keeping every word in order.

    Paragraphs (separated by blank lines) are packed together while they fit; a paragraph
    longer than `max_words` is cut at sentence ends, and a sentence still too long is cut
    every `max_words` words. Whitespace inside a paragraph is collapsed to single spaces;
    paragraphs packed into one chunk stay separated by a blank line.
    """
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")

    # Units: (paragraph number, words). Each unit has at most max_words words.
    units: list[tuple[int, list[str]]] = []
    for p, paragraph in enumerate(_PARAGRAPH_BREAK.split(text)):
        words = paragraph.split()
        if not words:
            continue
        if len(words) <= max_words:
            units.append((p, words))
            continue
        for sentence in _sentences(words):
            for start in range(0, len(sentence), max_words):
                units.append((p, sentence[start : start + max_words]))

    chunks: list[str] = []
    current: list[tuple[int, list[str]]] = []
    size = 0

    def flush() -> None:
        if not current:
            return
        parts: list[str] = []
        last_p = None
        for p, words in current:
            piece = " ".join(words)
            if last_p is None:
                parts.append(piece)
            elif p == last_p:
                parts.append(" " + piece)
            else:
                parts.append("\n\n" + piece)
            last_p = p
        chunks.append("".join(parts))

    for p, words in units:
        if current and size + len(words) > max_words:
            flush()
            current, size = [], 0
        current.append((p, words))
        size += len(words)
    flush()
    return chunks


def _chunks_for(title: str, text: str, source: str, max_words: int) -> list[Chunk]:
    return [
        Chunk(id=chunk_id(title, piece), text=piece, title=title, metadata={"source": source})
        for piece in split_text(text, max_words)
    ]


def _read_text(path: Path) -> str:
    # errors="replace": one bad byte should not make a whole folder unreadable.
    return path.read_text(encoding="utf-8", errors="replace")


def _load_txt(path: Path, max_words: int) -> list[Chunk]:
    return _chunks_for(path.stem, _read_text(path), str(path), max_words)


def _markdown_sections(text: str, default_title: str) -> Iterator[tuple[str, str]]:
    """(title, body) per section; a section runs from one heading to the next.

    Headings inside fenced code blocks are ignored (a `# comment` in code is not a title).
    """
    title = default_title
    body: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            m = _HEADING.match(line)
            if m:
                yield title, "\n".join(body)
                title, body = (m.group(2).strip() or default_title), []
                continue
        body.append(line)
    yield title, "\n".join(body)


def _load_md(path: Path, max_words: int) -> list[Chunk]:
    chunks: list[Chunk] = []
    for title, body in _markdown_sections(_read_text(path), path.stem):
        chunks.extend(_chunks_for(title, body, str(path), max_words))
    return chunks


def _load_jsonl(path: Path, max_words: int) -> list[Chunk]:
    """Rows are either one document ({"text", "title"?, "id"?}) or a set of passages ({"ctxs": [...]})."""
    source = str(path)
    chunks: list[Chunk] = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
            if isinstance(row.get("ctxs"), list):
                for j, ctx in enumerate(row["ctxs"]):
                    if not isinstance(ctx, dict) or not isinstance(ctx.get("text"), str):
                        raise ValueError(f"{where}: ctxs[{j}] must be an object with a string 'text'")
                    chunks.extend(_chunks_for(str(ctx.get("title") or ""), ctx["text"], source, max_words))
            elif isinstance(row.get("text"), str):
                title = str(row.get("title") or "")
                pieces = _chunks_for(title, row["text"], source, max_words)
                if len(pieces) == 1 and row.get("id") is not None:
                    only = pieces[0]
                    pieces = [Chunk(id=str(row["id"]), text=only.text, title=title, metadata=only.metadata)]
                chunks.extend(pieces)
            else:
                raise ValueError(
                    f"{where}: expected an object with a string 'text' (optional 'title', 'id') "
                    "or a 'ctxs' list of {title, text} passages"
                )
    return chunks


_LOADERS = {".txt": _load_txt, ".md": _load_md, ".jsonl": _load_jsonl}


def _files_under(folder: Path) -> list[Path]:
    """Supported files below `folder`, recursively, in a stable order; hidden entries skipped."""
    found = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if p.is_file() and p.suffix.lower() in _LOADERS:
            found.append(p)
    return sorted(found)


def load_documents(paths: Sequence[str | os.PathLike[str]], max_words: int = 120) -> list[Chunk]:
    """Chunks from files and folders (recursively) of .txt, .md and .jsonl.

    Unsupported files inside folders are skipped; a missing path, or an unsupported file named
    explicitly, raises ValueError. Chunks with the same id are kept once (first wins).
    Titles: the file stem for .txt, the nearest preceding heading for .md (else the stem),
    the row's or passage's `title` for .jsonl.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")

    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(_files_under(path))
        elif path.is_file():
            if path.suffix.lower() not in _LOADERS:
                raise ValueError(
                    f"unsupported file type {path.suffix or '(none)'!r} for {path}; "
                    f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
                )
            files.append(path)
        else:
            raise ValueError(f"no such file or folder: {path}")

    seen: set[str] = set()
    chunks: list[Chunk] = []
    for file in files:
        for chunk in _LOADERS[file.suffix.lower()](file, max_words):
            if chunk.id not in seen:
                seen.add(chunk.id)
                chunks.append(chunk)
    return chunks
