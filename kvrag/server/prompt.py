"""OpenAI chat messages as the engine's input, through the LangChain integration's own functions,
so a chat through the server and one through `ChatKVRag` build the same prompt."""

from __future__ import annotations

from typing import Sequence

from langchain_core.messages import AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage

from kvrag.integrations.langchain.chat_model import last_human_text, messages_to_prompt
from kvrag.server.schemas import Message

_CLASSES = {"user": HumanMessage, "assistant": AIMessage, "system": SystemMessage, "developer": SystemMessage}


def to_langchain(messages: Sequence[Message]) -> list[BaseMessage]:
    out: list[BaseMessage] = []
    for m in messages:
        content = m.content if m.content is not None else ""
        cls = _CLASSES.get(m.role)
        out.append(cls(content=content) if cls else ChatMessage(role=m.role, content=content))
    return out


def chat_prompt(messages: Sequence[Message]) -> str:
    """Plain chat: the messages as one prompt for `KVRag.complete` (a lone user message untouched)."""
    return messages_to_prompt(to_langchain(messages))


def question_of(messages: Sequence[Message]) -> str:
    """With retrieved chunks: the question is the last user message."""
    return last_human_text(to_langchain(messages))
