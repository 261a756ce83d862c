"""OpenAI chat messages as the engine's input, through `kvrag.chat`, so a chat through the server and one
through `ChatKVRag` build the same conversation (and the server needs no LangChain)."""

from __future__ import annotations

from typing import Sequence

from kvrag.chat import Conversation, Turn, prompt_of
from kvrag.server.schemas import Message


def turns_of(messages: Sequence[Message]) -> list[Turn]:
    return [(m.role, m.content) for m in messages]


def conversation_of(messages: Sequence[Message]) -> Conversation:
    """The request's messages as the engine reads them: system text, history and the question."""
    return Conversation.of(turns_of(messages))


def chat_prompt(messages: Sequence[Message]) -> str:
    """The messages as one prompt: a lone user message untouched (a client's own RAG prompt, whose
    known chunk texts `KVRag.complete` finds verbatim)."""
    return prompt_of(turns_of(messages))
