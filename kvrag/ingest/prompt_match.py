"""Finding known chunks inside a prompt that a framework built itself (the drop-in LLM path).

Only whole chunks count: a chunk's text must stand in the prompt as its own segment (nothing
alphanumeric touching either end) and be at least `MIN_MATCH_CHARS` long, so a short chunk such as
"a" never cuts a word out of a question.
"""

from __future__ import annotations

import re
from typing import Iterable

from kvrag.chat import Conversation
from kvrag.types import Chunk

MIN_MATCH_CHARS = 12
_RULE = re.compile(r"^[\s\-=_*#~.:|]*$")  # a blank or separator line ("-----", "=====") around a context block


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


def after_context(rest: str) -> str:
    """What a context message says after its last chunk, less the separator lines frameworks draw
    around the context block: the caller's own instructions (LlamaIndex's chat engines append their
    `system_prompt` there) and the framework's closing ones."""
    return "\n".join(line for line in rest.splitlines() if not _RULE.match(line)).strip()


def match_conversation(conv: Conversation, chunks: Iterable[Chunk], min_chars: int = MIN_MATCH_CHARS) -> tuple[list[Chunk], Conversation]:
    """Known chunks that a framework pasted into a conversation's messages (a context system message,
    a user message holding "Context: ... Question: ..."), and the conversation without them.

    The engine's layout (its instruction, the chunks' KV at the head of the first user turn) replaces
    the framework's wrapper around the context: a system message that carried chunks keeps only what
    follows its last chunk (`after_context`), the others are kept whole, so the caller's own system
    text always reaches the model. A user message keeps its text after the last chunk (before the
    first, if nothing follows). Chunks come in message order, each once; with none found the
    conversation is returned as it is."""
    known = list(chunks)
    found: list[Chunk] = []

    def take(text: str) -> tuple[list[Chunk], str]:
        got, rest = match_prompt(text, known, min_chars)
        for c in got:
            if all(c.id != f.id for f in found):
                found.append(c)
        return got, rest

    system = []
    for part in conv.system_parts:
        got, rest = take(part)
        system.append(after_context(rest) if got else part)
    turns = []
    for role, text in conv.turns:
        if role == "user":
            got, rest = take(text)
            if got and not rest:
                rest = text[: find_whole(text, got[0].text)].strip()
            turns.append((role, rest if got and rest else text))
        else:
            turns.append((role, text))
    if not found:
        return [], conv
    return found, Conversation.with_system_parts(tuple(turns), system)
