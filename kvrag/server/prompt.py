"""OpenAI chat messages as the engine's input, through `kvrag.chat`, so a chat through the server and one
through `ChatKVRag` build the same prompt (and the server needs no LangChain)."""

from __future__ import annotations

from typing import Sequence

from kvrag.chat import Turn, last_user_text, prompt_of
from kvrag.server.schemas import Message


def turns_of(messages: Sequence[Message]) -> list[Turn]:
    return [(m.role, m.content) for m in messages]


def chat_prompt(messages: Sequence[Message]) -> str:
    """Plain chat: the messages as one prompt for `KVRag.complete` (a lone user message untouched)."""
    return prompt_of(turns_of(messages))


def question_of(messages: Sequence[Message]) -> str:
    """With retrieved chunks: the question is the last user message."""
    return last_user_text(turns_of(messages))
