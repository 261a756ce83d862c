"""Checking and storing the demo's uploaded files, kept apart from Streamlit so it is unit-testable.

An upload is untrusted bytes: it is only ever decoded as UTF-8 text (never executed or
unpickled), and it is saved under the app's own folder with a name made from the sha256 of
its content, never from the name the user's browser sent, so no upload can pick a path.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from typing import Any

from kvrag.ingest.documents import DEFAULT_MAX_CHUNK_TOKENS, chunk_id, load_documents, text_or_raise
from kvrag.types import Chunk

__all__ = [
    "ALLOWED_SUFFIXES",
    "MAX_UPLOAD_BYTES",
    "MAX_UPLOAD_FILES",
    "UploadError",
    "ValidUpload",
    "load_uploads",
    "save_upload",
    "upload_chunks",
    "validate_upload",
]

MAX_UPLOAD_BYTES = 1_000_000  # per file: the demo chunks and precomputes on the request path
MAX_UPLOAD_FILES = 5
ALLOWED_SUFFIXES = (".txt", ".md")
UPLOAD_SOURCE = "upload"


class UploadError(ValueError):
    """An upload the demo refuses; the message is shown to the user as is."""


@dataclass(frozen=True)
class ValidUpload:
    """An accepted upload: its decoded text, the parser it needs and its content hash."""

    text: str
    suffix: str  # one of ALLOWED_SUFFIXES: picks the .txt or .md parser, nothing else
    digest: str  # sha256 of the raw bytes, hex

    @property
    def file_name(self) -> str:
        """The name it is stored under: derived from the content only."""
        return f"{self.digest}{self.suffix}"


def _suffix_of(name: str) -> str:
    """The allowed suffix the user's file name ends with (the name is used for nothing else)."""
    lower = (name or "").strip().lower()
    for suffix in ALLOWED_SUFFIXES:
        if lower.endswith(suffix):
            return suffix
    raise UploadError(f"only {' and '.join(ALLOWED_SUFFIXES)} files can be added")


def validate_upload(name: str, data: bytes, max_bytes: int = MAX_UPLOAD_BYTES) -> ValidUpload:
    """Accept `data` only if it is a non-empty, UTF-8 text .txt/.md file of at most `max_bytes`.

    Size is checked before decoding so a huge upload costs nothing; NUL bytes and a high share
    of control characters are refused because they mean a binary file that happens to decode
    (the same test `kvrag ingest` applies: `kvrag.ingest.documents.is_text`).
    """
    suffix = _suffix_of(name)
    if len(data) > max_bytes:
        raise UploadError(f"the file is too big: {len(data):,} bytes, the limit is {max_bytes:,} bytes")
    if b"\x00" in data:
        raise UploadError("the file looks binary (it contains NUL bytes); only plain text is accepted")
    try:
        data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UploadError("the file is not UTF-8 text; save it as UTF-8 and upload it again") from None
    try:
        text = text_or_raise(data, "the file")
    except ValueError:
        raise UploadError("the file looks binary (too many control characters); only plain text is accepted") from None
    if not text.strip():
        raise UploadError("the file is empty")
    return ValidUpload(text=text, suffix=suffix, digest=hashlib.sha256(data).hexdigest())


def save_upload(upload: ValidUpload, folder: str | os.PathLike[str]) -> Path:
    """Write the upload's text as `<sha256><suffix>` inside `folder` (atomically; idempotent)."""
    root = Path(folder).resolve()
    root.mkdir(parents=True, exist_ok=True)
    target = (root / upload.file_name).resolve()
    if target.parent != root:  # cannot happen with a hex name; kept as a guard for future edits
        raise UploadError("refusing to write outside the upload folder")
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".upload-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(upload.text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _untitled(chunk: Chunk, stem: str, digest: str) -> Chunk:
    """Drop a title that is only the hash file name: it would put a hex string in every prompt."""
    title = "" if chunk.title == stem else chunk.title
    return Chunk(id=chunk_id(title, chunk.text), text=chunk.text, title=title, metadata={"source": f"{UPLOAD_SOURCE}:{digest[:12]}"})


def upload_chunks(
    path: str | os.PathLike[str], max_words: int = 120, max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS, tokenizer: Any = None
) -> list[Chunk]:
    """Chunks of a saved upload, with the same ids whether read now or re-read at the next start
    (with the same limits: at most `max_words` words and `max_tokens` tokens by `tokenizer` each)."""
    p = Path(path)
    return [_untitled(c, p.stem, p.stem) for c in load_documents([p], max_words=max_words, max_tokens=max_tokens, tokenizer=tokenizer)]


def load_uploads(
    folder: str | os.PathLike[str], max_words: int = 120, max_tokens: int | None = DEFAULT_MAX_CHUNK_TOKENS, tokenizer: Any = None
) -> list[Chunk]:
    """Chunks of every upload saved in `folder` (none if it does not exist yet)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    chunks: list[Chunk] = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix in ALLOWED_SUFFIXES and not p.name.startswith("."):
            chunks.extend(upload_chunks(p, max_words, max_tokens, tokenizer))
    return chunks
