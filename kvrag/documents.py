"""Turning user files (.txt, .md, .jsonl) into retrievable chunks.

Chunk ids are content-addressed, so ingesting the same files twice gives the same ids: the
index upserts instead of duplicating, and per-chunk KV caches keyed by id stay valid.

Every chunk is bounded: at most `max_words` words and at most `max_tokens` tokens (counted with
the tokenizer when one is given; without one, at most `max_tokens * BYTES_PER_TOKEN_BOUND` UTF-8
bytes). Text the word splitter cannot cut (a run without spaces) is cut on characters. Files whose
bytes are not text (NUL bytes, invalid UTF-8, many control characters) are refused with
`NotTextError`, naming the file.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag.errors import ContextTooLongError
from kvrag.types import Chunk

__all__ = [
    "BYTES_PER_TOKEN_BOUND",
    "DEFAULT_MAX_CHUNK_TOKENS",
    "NotTextError",
    "SUPPORTED_EXTENSIONS",
    "check_chunk_lengths",
    "chunk_id",
    "count_tokens",
    "document_chunk_ids",
    "is_text",
    "load_documents",
    "read_text_file",
    "split_text",
    "text_or_raise",
]

SUPPORTED_EXTENSIONS = (".txt", ".md", ".jsonl")
DEFAULT_MAX_CHUNK_TOKENS = 256
# Without a tokenizer a chunk is kept under max_tokens * 4 UTF-8 bytes: about max_tokens tokens of
# ordinary text, and never more than 4 * max_tokens even for a tokenizer that spends a token per byte.
BYTES_PER_TOKEN_BOUND = 4
# Share of control characters (other than tab, newlines, form feed) above which a file is not text.
MAX_CONTROL_SHARE = 0.01
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")
# The cut search looks at most this many characters per token ahead (a piece may come out shorter
# than the cap allows for text whose tokens are longer; never longer).
_CHARS_PER_TOKEN_WINDOW = 8


class NotTextError(ValueError):
    """A file (or upload) whose bytes are not text: NUL bytes, invalid UTF-8, or many control characters."""


def _not_text_reason(data: bytes) -> str | None:
    if b"\x00" in data:
        return "it contains NUL bytes"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return f"it is not valid UTF-8 (byte {e.start})"
    if text and len(_CONTROL.findall(text)) > MAX_CONTROL_SHARE * len(text):
        return "too many of its characters are control characters"
    return None


def is_text(data: bytes) -> bool:
    """True if `data` is UTF-8 text: no NUL bytes, valid UTF-8, at most 1% control characters."""
    return _not_text_reason(data) is None


def text_or_raise(data: bytes, where: str) -> str:
    """`data` decoded as UTF-8 (a BOM dropped), or NotTextError naming `where`."""
    reason = _not_text_reason(data)
    if reason is not None:
        raise NotTextError(f"{where}: not a text file ({reason}); only UTF-8 text can be ingested")
    return data.decode("utf-8-sig")


def read_text_file(path: str | os.PathLike[str]) -> str:
    """The file's text, or NotTextError naming the file if its bytes are not UTF-8 text."""
    p = Path(path)
    return text_or_raise(p.read_bytes(), str(p))


def count_tokens(text: str, tokenizer: Any = None) -> int:
    """Tokens of `text` with `tokenizer` (no special tokens); without one, the byte bound's estimate:
    ceil(UTF-8 bytes / BYTES_PER_TOKEN_BOUND)."""
    if tokenizer is None:
        return -(-len(text.encode("utf-8")) // BYTES_PER_TOKEN_BOUND)
    if hasattr(tokenizer, "chunk_ids") and hasattr(tokenizer, "tokenizer"):  # a PromptLayout
        tokenizer = tokenizer.tokenizer
    if callable(tokenizer):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return len(tokenizer.encode(text, add_special_tokens=False))


def _cut(text: str, max_tokens: int, count: Any) -> list[str]:
    """Cut `text` into pieces of at most `max_tokens` tokens (by `count`), at word ends where a word fits,
    else inside the word. Pieces are stripped; joined back they hold every non-space character in order."""
    out: list[str] = []
    rest = text.strip()
    window = max(1, max_tokens * _CHARS_PER_TOKEN_WINDOW)
    while rest:
        if len(rest) <= window and count(rest) <= max_tokens:
            out.append(rest)
            break
        head = rest[:window]
        ends = [m.end() for m in re.finditer(r"\S+", head)]
        if len(head) < len(rest) and ends and ends[-1] == len(head) and not rest[len(head)].isspace():
            ends.pop()  # the window cut the last word: it is not a word end
        # largest number of whole words that fits (token counts grow with the prefix)
        lo, hi = 0, len(ends)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(head[: ends[mid - 1]]) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        if lo:
            cut = ends[lo - 1]
        else:  # not even the first word fits: cut inside it, on characters
            first_end = ends[0] if ends else len(head)
            lo, hi = 1, first_end
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if count(head[:mid]) <= max_tokens:
                    lo = mid
                else:
                    hi = mid - 1
            cut = lo
        while cut > 1 and count(head[:cut]) > max_tokens:  # counts need not grow strictly: make sure
            cut -= 1
        out.append(rest[:cut].strip())
        rest = rest[cut:].strip()
    return [piece for piece in out if piece]

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


def split_text(
    text: str, max_words: int = 120, max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS, tokenizer: Any = None
) -> list[str]:
    """Split text into chunks of at most `max_words` words and `max_tokens` tokens, keeping every word in order.

    Paragraphs (separated by blank lines) are packed together while they fit; a paragraph
    longer than `max_words` is cut at sentence ends, and a sentence still too long is cut
    every `max_words` words. Whitespace inside a paragraph is collapsed to single spaces;
    paragraphs packed into one chunk stay separated by a blank line.

    A chunk over `max_tokens` tokens (counted by `tokenizer`; without one, over
    `max_tokens * BYTES_PER_TOKEN_BOUND` UTF-8 bytes) is cut again at word ends, and a word
    that alone is too long (a run without spaces) on characters. `max_tokens=None`: no token cap.
    """
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    chunks = _split_words(text, max_words)
    if max_tokens is None:
        return chunks

    def count(piece: str) -> int:
        return count_tokens(piece, tokenizer)

    out: list[str] = []
    for chunk in chunks:
        # cheap test first: a chunk of few bytes cannot hold many tokens
        if len(chunk.encode("utf-8")) <= max_tokens or count(chunk) <= max_tokens:
            out.append(chunk)
        else:
            out.extend(_cut(chunk, max_tokens, count))
    return out


def _split_words(text: str, max_words: int) -> list[str]:
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


@dataclass(frozen=True)
class _Limits:
    max_words: int
    max_tokens: int | None
    tokenizer: Any


def _chunks_for(title: str, text: str, source: str, limits: _Limits) -> list[Chunk]:
    return [
        Chunk(id=chunk_id(title, piece), text=piece, title=title, metadata={"source": source})
        for piece in split_text(text, limits.max_words, limits.max_tokens, limits.tokenizer)
    ]


def _load_txt(path: Path, limits: _Limits) -> list[Chunk]:
    return _chunks_for(path.stem, read_text_file(path), str(path), limits)


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


def _load_md(path: Path, limits: _Limits) -> list[Chunk]:
    chunks: list[Chunk] = []
    for title, body in _markdown_sections(read_text_file(path), path.stem):
        chunks.extend(_chunks_for(title, body, str(path), limits))
    return chunks


def _load_jsonl(path: Path, limits: _Limits) -> list[Chunk]:
    """Rows are either one document ({"text", "title"?, "id"?}) or a set of passages ({"ctxs": [...]})."""
    source = str(path)
    chunks: list[Chunk] = []
    for lineno, line in enumerate(io.StringIO(read_text_file(path)), start=1):
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
                chunks.extend(_chunks_for(str(ctx.get("title") or ""), ctx["text"], source, limits))
        elif isinstance(row.get("text"), str):
            title = str(row.get("title") or "")
            pieces = _chunks_for(title, row["text"], source, limits)
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


def load_documents(
    paths: Sequence[str | os.PathLike[str]],
    max_words: int = 120,
    max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
    tokenizer: Any = None,
) -> list[Chunk]:
    """Chunks from files and folders (recursively) of .txt, .md and .jsonl.

    Unsupported files inside folders are skipped; a missing path, or an unsupported file named
    explicitly, raises ValueError; a file whose bytes are not UTF-8 text raises NotTextError (a
    ValueError) naming it. Chunks with the same id are kept once (first wins). Each chunk has at
    most `max_words` words and `max_tokens` tokens (see `split_text`; pass the model's tokenizer
    for an exact count). Titles: the file stem for .txt, the nearest preceding heading for .md
    (else the stem), the row's or passage's `title` for .jsonl.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    limits = _Limits(max_words, max_tokens, tokenizer)

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
        for chunk in _LOADERS[file.suffix.lower()](file, limits):
            if chunk.id not in seen:
                seen.add(chunk.id)
                chunks.append(chunk)
    return chunks


def document_chunk_ids(
    path: str | os.PathLike[str],
    max_words: int = 120,
    max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
    tokenizer: Any = None,
) -> list[str]:
    """The ids of the chunks `load_documents` gives for one file as it is now, in order: what to delete
    from the index (and the engine's registry) to remove that document.

    Ids are content hashes of (title, chunk text), so they depend on the file's current content
    and on the same `max_words` / `max_tokens` / `tokenizer` the file was ingested with; for a file
    that changed or is gone, use the chunks' `metadata["source"] == str(path)` in the index instead.
    A chunk with the same text in another ingested file has the same id (ingest kept it once).
    """
    return [c.id for c in load_documents([path], max_words=max_words, max_tokens=max_tokens, tokenizer=tokenizer)]


def check_chunk_lengths(chunks: Iterable[Chunk], tokenizer: Any, max_tokens: int) -> None:
    """Raise ContextTooLongError naming the first chunk longer than `max_tokens` tokens.

    `tokenizer`: a PromptLayout (its `chunk_ids`, i.e. the tokens the chunk takes in the prompt,
    title included) or an HF tokenizer (the chunk's text alone). Call it before precomputing, with
    `max_tokens` the model's context less the system prefix and room for a question.
    """
    for chunk in chunks:
        if hasattr(tokenizer, "chunk_ids"):
            n = len(tokenizer.chunk_ids(chunk))
        else:
            n = count_tokens(chunk.text, tokenizer)
        if n > max_tokens:
            raise ContextTooLongError(
                f"chunk {chunk.id!r} has {n} tokens, more than the {max_tokens} the model's context allows; "
                f"split it into smaller chunks (kvrag.documents caps chunks at {DEFAULT_MAX_CHUNK_TOKENS} tokens by default)"
            )
