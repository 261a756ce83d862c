"""Turning user files (.txt, .md, .jsonl) into retrievable chunks.

Chunk ids are content-addressed, so ingesting the same files twice gives the same ids: the
index upserts instead of duplicating, and per-chunk KV caches keyed by id stay valid.

Every chunk is bounded: at most `max_words` words and at most `max_tokens` tokens (counted with
the tokenizer when one is given; without one, at most `max_tokens * BYTES_PER_TOKEN_BOUND` UTF-8
bytes). Text the word splitter cannot cut (a run without spaces) is cut on characters. Files whose
bytes are not text (NUL bytes, invalid UTF-8, many control characters) are refused with
`NotTextError`, naming the file (`check_document` checks a file without chunking it).

Files are read as they are chunked (`iter_file_chunks`, `iter_documents`): a .txt or .md file a line
at a time, a .jsonl one a row at a time, so memory does not grow with a file's size. Walking a folder
does not follow symlinks that lead out of it unless asked (`follow_symlinks=True`); a file named
explicitly is read as given.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag.errors import ContextTooLongError
from kvrag.ingest.folders import SkippedPath, walk_folder
from kvrag.ingest.splitting import BYTES_PER_TOKEN_BOUND, DEFAULT_MAX_CHUNK_TOKENS, Packer, cap, check_limits, count_tokens, split_text
from kvrag.types import Chunk

__all__ = [
    "BYTES_PER_TOKEN_BOUND",
    "DEFAULT_MAX_CHUNK_TOKENS",
    "NotTextError",
    "SUPPORTED_EXTENSIONS",
    "SkippedPath",
    "check_chunk_lengths",
    "check_document",
    "chunk_id",
    "count_tokens",
    "document_chunk_ids",
    "document_files",
    "is_blank",
    "is_text",
    "iter_documents",
    "iter_file_chunks",
    "load_documents",
    "read_text_file",
    "split_text",
    "text_or_raise",
]

SUPPORTED_EXTENSIONS = (".txt", ".md", ".jsonl")
# Share of control characters (other than tab, newlines, form feed) above which a file is not text.
MAX_CONTROL_SHARE = 0.01
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f]")


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


_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")


def chunk_id(title: str, text: str) -> str:
    """Content-addressed id: first 16 hex digits of sha256(title + "\\n" + text)."""
    return hashlib.sha256(f"{title}\n{text}".encode("utf-8")).hexdigest()[:16]


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


def _capped_chunks(title: str, texts: Iterable[str], source: str, limits: _Limits) -> Iterator[Chunk]:
    """Chunks of packed texts (the packer's output) after the token cap, as `split_text` gives them."""
    for piece in cap(texts, limits.max_tokens, limits.tokenizer):
        yield Chunk(id=chunk_id(title, piece), text=piece, title=title, metadata={"source": source})


# A line that separates paragraphs (the content between two "\n" that the paragraph break in kvrag.ingest.splitting matches).
_BLANK_LINE = re.compile(r"[ \t\r\f\v]*")
_READ_BLOCK = 1 << 20


def _not_text(path: Path, reason: str) -> NotTextError:
    return NotTextError(f"{path}: not a text file ({reason}); only UTF-8 text can be ingested")


def _lines(path: Path, on_bytes: Callable[[int], None] | None = None) -> Iterator[str]:
    """The file's lines, split at "\n" only (kept), decoded as they are read (a leading BOM
    dropped): NotTextError at NUL bytes or invalid UTF-8. `on_bytes(n)` after each line's n bytes."""
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            if b"\x00" in raw:
                raise _not_text(path, "it contains NUL bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_text(path, f"it is not valid UTF-8 (byte {offset + e.start})") from None
            if offset == 0 and line.startswith("\ufeff"):
                line = line[1:]
            offset += len(raw)
            if on_bytes is not None:
                on_bytes(len(raw))
            yield line


def _check_text(path: Path) -> None:
    """NotTextError unless the whole file is text (see `is_text`), read a block at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = chars = controls = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ_BLOCK)
            if b"\x00" in block:
                raise _not_text(path, "it contains NUL bytes")
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise _not_text(path, f"it is not valid UTF-8 (byte {offset - pending + e.start})") from None
            if chars == 0 and text.startswith("\ufeff"):
                text = text[1:]
            chars += len(text)
            controls += len(_CONTROL.findall(text))
            offset += len(block)
            if not block:
                break
    if chars and controls > MAX_CONTROL_SHARE * chars:
        raise _not_text(path, "too many of its characters are control characters")


def _jsonl_rows(path: Path, on_bytes: Callable[[int], None] | None = None) -> Iterator[dict[str, Any]]:
    """Rows are either one document ({"text", "title"?, "id"?}) or a set of passages ({"ctxs": [...]});
    ValueError naming the file and line of the first that is neither."""
    for lineno, line in enumerate(_lines(path, on_bytes), start=1):
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
        elif not isinstance(row.get("text"), str):
            raise ValueError(
                f"{where}: expected an object with a string 'text' (optional 'title', 'id') "
                "or a 'ctxs' list of {title, text} passages"
            )
        yield row


def _stream_txt(path: Path, limits: _Limits, on_bytes: Callable[[int], None] | None) -> Iterator[Chunk]:
    packer, title, source = Packer(limits.max_words), path.stem, str(path)
    for line in _lines(path, on_bytes):
        content = line[:-1] if line.endswith("\n") else line
        done = packer.end_paragraph() if _BLANK_LINE.fullmatch(content) else packer.words(content.split())
        yield from _capped_chunks(title, done, source, limits)
    yield from _capped_chunks(title, packer.finish(), source, limits)


def _stream_md(path: Path, limits: _Limits, on_bytes: Callable[[int], None] | None) -> Iterator[Chunk]:
    """Sections run from one heading to the next, titled by it (the file's stem before the first);
    headings inside fenced code blocks are ignored (a `# comment` in code is not a title)."""
    packer, title, source = Packer(limits.max_words), path.stem, str(path)
    in_fence = False
    for raw in _lines(path, on_bytes):
        for line in raw.splitlines():  # the lines str.splitlines gives for the whole text
            if _FENCE.match(line):
                in_fence = not in_fence
            elif not in_fence:
                m = _HEADING.match(line)
                if m:
                    yield from _capped_chunks(title, packer.finish(), source, limits)
                    title, packer = (m.group(2).strip() or path.stem), Packer(limits.max_words)
                    continue
            done = packer.end_paragraph() if _BLANK_LINE.fullmatch(line) else packer.words(line.split())
            yield from _capped_chunks(title, done, source, limits)
    yield from _capped_chunks(title, packer.finish(), source, limits)


def _stream_jsonl(path: Path, limits: _Limits, on_bytes: Callable[[int], None] | None) -> Iterator[Chunk]:
    source = str(path)
    for row in _jsonl_rows(path, on_bytes):
        if isinstance(row.get("ctxs"), list):
            for ctx in row["ctxs"]:
                yield from _chunks_for(str(ctx.get("title") or ""), ctx["text"], source, limits)
        else:
            title = str(row.get("title") or "")
            pieces = _chunks_for(title, row["text"], source, limits)
            if len(pieces) == 1 and row.get("id") is not None:
                only = pieces[0]
                pieces = [Chunk(id=str(row["id"]), text=only.text, title=title, metadata=only.metadata)]
            yield from pieces


_LOADERS = {".txt": _stream_txt, ".md": _stream_md, ".jsonl": _stream_jsonl}


def check_document(path: str | os.PathLike[str]) -> None:
    """Read a file once, a block at a time, and raise what ingesting it would: NotTextError if its
    bytes are not UTF-8 text, ValueError naming the line of a .jsonl row of the wrong shape, OSError
    if it cannot be read. Checking every file first lets an ingest refuse or skip a bad one before
    any of it is indexed."""
    p = Path(path)
    _check_text(p)
    if p.suffix.lower() == ".jsonl":
        for _ in _jsonl_rows(p):
            pass


def is_blank(path: str | os.PathLike[str]) -> bool:
    """True when the file holds nothing but whitespace (or nothing at all): it gives no chunk, and an
    ingest names it as skipped rather than passing over it in silence. Reads only until the first
    character that is not whitespace."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors="replace")
    with open(path, "rb") as f:
        while True:
            block = f.read(_READ_BLOCK)
            if decoder.decode(block, final=not block).strip():
                return False
            if not block:
                return True


def document_files(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    follow_symlinks: bool = False,
    skipped: list[SkippedPath] | None = None,
) -> list[Path]:
    """The files `load_documents` reads for `paths`: a file named is read as given (through a symlink
    too); a folder is walked for .txt/.md/.jsonl files (hidden entries skipped, symlinks leaving it
    not followed unless `follow_symlinks`: each one is appended to `skipped`, with the folders
    that could not be listed). A missing path, or an unsupported file named explicitly, raises ValueError."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(walk_folder(path, _LOADERS, follow_symlinks, skipped))
        elif path.is_file():
            if path.suffix.lower() not in _LOADERS:
                raise ValueError(
                    f"unsupported file type {path.suffix or '(none)'!r} for {path}; "
                    f"supported: {', '.join(SUPPORTED_EXTENSIONS)}"
                )
            files.append(path)
        elif path.exists():
            raise ValueError(f"not a regular file or folder: {path}")
        else:
            raise ValueError(f"no such file or folder: {path}")
    return list(dict.fromkeys(files))


def iter_file_chunks(
    path: str | os.PathLike[str],
    max_words: int = 120,
    max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
    tokenizer: Any = None,
    check: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> Iterator[Chunk]:
    """One file's chunks, as `load_documents` gives them, produced as the file is read: memory holds
    about one chunk of it (a .txt or .md file is read a line at a time, a .jsonl one a row at a time).

    `check` (default): the whole file is checked first (`check_document`), so a file that is not
    text raises before any of its chunks is produced; without it a NUL byte or invalid UTF-8 raises
    NotTextError where it is read. `on_bytes(n)` is called as each n bytes of the file are read.
    Chunks repeated within the file are not dropped here (`iter_documents` does).
    """
    check_limits(max_words, max_tokens)
    p = Path(path)
    loader = _LOADERS.get(p.suffix.lower())
    if loader is None:
        raise ValueError(f"unsupported file type {p.suffix or '(none)'!r} for {p}; supported: {', '.join(SUPPORTED_EXTENSIONS)}")
    return _file_chunks(p, loader, _Limits(max_words, max_tokens, tokenizer), check, on_bytes)


def _file_chunks(path: Path, loader: Any, limits: _Limits, check: bool, on_bytes: Callable[[int], None] | None) -> Iterator[Chunk]:
    if check:
        check_document(path)
    yield from loader(path, limits, on_bytes)


def iter_documents(
    paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    max_words: int = 120,
    max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
    tokenizer: Any = None,
    follow_symlinks: bool = False,
) -> Iterator[Chunk]:
    """`load_documents` as a generator: chunks are produced as the files are read, so memory does not
    grow with the files' size (beyond the ids seen, kept to drop repeats). The paths are checked
    (missing, unsupported) when it is called; each file's content when it is reached."""
    check_limits(max_words, max_tokens)
    files = document_files(paths, follow_symlinks)
    return _unique(c for f in files for c in iter_file_chunks(f, max_words, max_tokens, tokenizer))


def _unique(chunks: Iterable[Chunk]) -> Iterator[Chunk]:
    seen: set[str] = set()
    for chunk in chunks:
        if chunk.id not in seen:
            seen.add(chunk.id)
            yield chunk


def load_documents(
    paths: Sequence[str | os.PathLike[str]],
    max_words: int = 120,
    max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS,
    tokenizer: Any = None,
    follow_symlinks: bool = False,
) -> list[Chunk]:
    """Chunks from files and folders (recursively) of .txt, .md and .jsonl.

    Unsupported files inside folders are skipped, and so are symlinks that lead out of a folder
    (unless `follow_symlinks`; a file named explicitly is read as given); a missing path, or an
    unsupported file named explicitly, raises ValueError; a file whose bytes are not UTF-8 text
    raises NotTextError (a ValueError) naming it. Chunks with the same id are kept once (first
    wins). Each chunk has at most `max_words` words and `max_tokens` tokens (see `split_text`; pass
    the model's tokenizer for an exact count). Titles: the file stem for .txt, the nearest preceding
    heading for .md (else the stem), the row's or passage's `title` for .jsonl. `iter_documents`
    gives the same chunks one at a time, as the files are read.
    """
    return list(iter_documents(paths, max_words, max_tokens, tokenizer, follow_symlinks))


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
                f"split it into smaller chunks (kvrag.ingest.documents caps chunks at {DEFAULT_MAX_CHUNK_TOKENS} tokens by default)"
            )
