"""Finding known chunks inside a prompt that a framework built itself (the drop-in LLM path).

Only whole chunks count: a chunk's text must stand in the prompt as its own segment (nothing
alphanumeric touching either end) and be at least `MIN_MATCH_CHARS` long, so a short chunk such as
"a" never cuts a word out of a question.
"""

from __future__ import annotations

from typing import Iterable

from kvrag.types import Chunk

MIN_MATCH_CHARS = 12


def _at_boundary(prompt: str, start: int, end: int) -> bool:
    before = prompt[start - 1] if start > 0 else " "
    after = prompt[end] if end < len(prompt) else " "
    return not before.isalnum() and not after.isalnum()


def find_whole(prompt: str, text: str) -> int:
    """Where `text` first stands in `prompt` as a whole segment, or -1."""
    at = prompt.find(text)
    while at >= 0 and not _at_boundary(prompt, at, at + len(text)):
        at = prompt.find(text, at + 1)
    return at


def match_prompt(prompt: str, chunks: Iterable[Chunk], min_chars: int = MIN_MATCH_CHARS) -> tuple[list[Chunk], str]:
    """Known chunks whose text stands verbatim in `prompt` (in prompt order) and the text after the last."""
    found: list[tuple[int, int, Chunk]] = []
    for chunk in chunks:
        text = chunk.text
        if len(text.strip()) >= min_chars and (at := find_whole(prompt, text)) >= 0:
            found.append((at, at + len(text), chunk))
    found.sort(key=lambda f: (f[0], -f[1]))
    picked: list[tuple[int, int, Chunk]] = []
    for start, end, chunk in found:
        if not picked or start >= picked[-1][1]:  # no overlaps: a chunk inside another is skipped
            picked.append((start, end, chunk))
    rest = prompt[picked[-1][1] :].strip() if picked else prompt
    return [c for _, _, c in picked], rest
