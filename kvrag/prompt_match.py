"""Finding known chunks inside a prompt that a framework built itself (the drop-in LLM path)."""

from __future__ import annotations

from typing import Iterable

from kvrag.types import Chunk


def match_prompt(prompt: str, chunks: Iterable[Chunk]) -> tuple[list[Chunk], str]:
    """Known chunks whose text appears verbatim in `prompt` (in prompt order) and the text after the last."""
    found: list[tuple[int, int, Chunk]] = []
    for chunk in chunks:
        if chunk.text and (at := prompt.find(chunk.text)) >= 0:
            found.append((at, at + len(chunk.text), chunk))
    found.sort(key=lambda f: (f[0], -f[1]))
    picked: list[tuple[int, int, Chunk]] = []
    for start, end, chunk in found:
        if not picked or start >= picked[-1][1]:  # no overlaps: a chunk inside another is skipped
            picked.append((start, end, chunk))
    rest = prompt[picked[-1][1] :].strip() if picked else prompt
    return [c for _, _, c in picked], rest
