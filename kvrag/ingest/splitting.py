"""Splitting text into bounded chunks: at most `max_words` words and `max_tokens` tokens each.

`split_text` cuts a whole text; `Packer` does the same to text fed to it a piece at a time (a file's
lines, as `kvrag.ingest.documents` reads them), holding about one chunk, with the same chunks as the result.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["BYTES_PER_TOKEN_BOUND", "DEFAULT_MAX_CHUNK_TOKENS", "Packer", "cap", "check_limits", "count_tokens", "split_text"]

DEFAULT_MAX_CHUNK_TOKENS = 256
# Without a tokenizer a chunk is kept under max_tokens * 4 UTF-8 bytes: about max_tokens tokens of
# ordinary text, and never more than 4 * max_tokens even for a tokenizer that spends a token per byte.
BYTES_PER_TOKEN_BOUND = 4
# The cut search looks at most this many characters per token ahead (a piece may come out shorter
# than the cap allows for text whose tokens are longer; never longer).
_CHARS_PER_TOKEN_WINDOW = 8


def check_limits(max_words: int, max_tokens: int | None) -> None:
    if max_words < 1:
        raise ValueError(f"max_words must be >= 1, got {max_words}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")


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
    check_limits(max_words, max_tokens)
    return list(cap(_split_words(text, max_words), max_tokens, tokenizer))


def cap(chunks: Iterable[str], max_tokens: int | None, tokenizer: Any) -> Iterator[str]:
    """Each chunk, or its pieces where it is over `max_tokens` tokens (see `split_text`)."""
    if max_tokens is None:
        yield from chunks
        return

    def count(piece: str) -> int:
        return count_tokens(piece, tokenizer)

    for chunk in chunks:
        # cheap test first: a chunk of few bytes cannot hold many tokens
        if len(chunk.encode("utf-8")) <= max_tokens or count(chunk) <= max_tokens:
            yield chunk
        else:
            yield from _cut(chunk, max_tokens, count)


def _split_words(text: str, max_words: int) -> list[str]:
    packer = Packer(max_words)
    chunks: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(text):
        chunks += packer.words(paragraph.split())
        chunks += packer.end_paragraph()
    return chunks + packer.finish()


class Packer:
    """Words in, chunks out, a paragraph at a time (fed in pieces: a file's lines), holding at most
    one chunk's words: what `split_text` does to a whole text, for text read as it streams.

    Units: a paragraph of at most `max_words` words is one; a longer one is cut at sentence ends and
    a sentence still too long every `max_words` words. Units are packed into chunks while they fit;
    units of one paragraph are joined by a space, of different paragraphs by a blank line.
    `words`, `end_paragraph` and `finish` return the chunks that became complete.
    """

    def __init__(self, max_words: int) -> None:
        self.max_words = max_words
        self.paragraph = 0  # number of the paragraph being read
        self.pending: list[str] = []  # words of it not yet made into units
        self.long = False  # it has more than max_words words: cut at sentence ends
        self.current: list[tuple[int, list[str]]] = []  # units of the chunk being packed
        self.size = 0
        self.done: list[str] = []

    def words(self, words: list[str]) -> list[str]:
        if words:
            self.pending.extend(words)
            if not self.long and len(self.pending) > self.max_words:
                self.long = True
            if self.long:
                self._sentences(final=False)
        return self._take()

    def end_paragraph(self) -> list[str]:
        if self.long:
            self._sentences(final=True)
        elif self.pending:
            self._unit(self.pending)
        self.pending, self.long = [], False
        self.paragraph += 1
        return self._take()

    def finish(self) -> list[str]:
        done = self.end_paragraph()
        self._flush()
        return done + self._take()

    def _take(self) -> list[str]:
        done, self.done = self.done, []
        return done

    def _sentences(self, final: bool) -> None:
        """Units of a long paragraph: every finished sentence (in pieces of max_words words), and the
        whole pieces of the unfinished one (the same however it goes on); `final`: all of it."""
        m, words, start = self.max_words, self.pending, 0
        for i, word in enumerate(words):
            if _SENTENCE_END.search(word):
                for s in range(start, i + 1, m):
                    self._unit(words[s : min(s + m, i + 1)])
                start = i + 1
        whole = len(words) if final else start + (len(words) - start) // m * m
        for s in range(start, whole, m):
            self._unit(words[s : min(s + m, whole)])
        self.pending = words[whole:]

    def _unit(self, words: list[str]) -> None:
        if self.current and self.size + len(words) > self.max_words:
            self._flush()
        self.current.append((self.paragraph, words))
        self.size += len(words)

    def _flush(self) -> None:
        if not self.current:
            return
        parts: list[str] = []
        last_p = None
        for p, words in self.current:
            piece = " ".join(words)
            if last_p is None:
                parts.append(piece)
            elif p == last_p:
                parts.append(" " + piece)
            else:
                parts.append("\n\n" + piece)
            last_p = p
        self.done.append("".join(parts))
        self.current, self.size = [], 0
