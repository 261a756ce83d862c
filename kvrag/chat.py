"""Chat messages as one prompt, shared by every face that takes a conversation (the LangChain chat model,
the server's OpenAI-compatible chat), so the same messages build the same prompt whichever way they came.

A message is a `(role, content)` pair in OpenAI's vocabulary (`user`, `assistant`, `system`, ...);
content is a string or a list of content blocks, of which only the text blocks count.
"""

from __future__ import annotations

from typing import Any, Sequence

Turn = tuple[str, Any]  # (role, content)
_LABELS = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def text_of(content: Any) -> str:
    """The text of a message's content; non-text blocks (images, ...) are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p if isinstance(p, str) else p.get("text", "") for p in content if isinstance(p, str) or p.get("type") == "text"]
    return "".join(parts)


def prompt_of(turns: Sequence[Turn]) -> str:
    """One plain-text prompt for `KVRag.complete`; a lone user message is passed through untouched so
    chunk texts inside it still match verbatim."""
    if len(turns) == 1 and turns[0][0] == "user":
        return text_of(turns[0][1])
    return "\n\n".join(f"{_LABELS.get(role, role.capitalize())}: {text_of(content)}" for role, content in turns)


def last_user_text(turns: Sequence[Turn]) -> str:
    """The question of a conversation that comes with documents: its last user message."""
    for role, content in reversed(turns):
        if role == "user":
            return text_of(content)
    raise ValueError("with documents=..., the messages must contain a human message (the question)")
