"""Chat messages as the engine reads them: a `Conversation` (the caller's system text and the turns),
shared by every face that takes messages (the LangChain chat model, LlamaIndex's chat calls, the
server's OpenAI-compatible chat), so the same messages build the same prompt whichever way they came.

A message is a `(role, content)` pair, a `{"role", "content"}` dict, or an object with `.role` and
`.content`, in OpenAI's vocabulary (`user`, `assistant`, `system`, `developer`) or LangChain's
(`human`, `ai`); content is a string or a list of content blocks, of which only the text blocks count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

Turn = tuple[str, Any]  # (role, content)
_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant",
          "model": "assistant"}
# user turns a follow-up retrieves with (its own and the ones before it): see Conversation.retrieval_query
RETRIEVAL_TURNS = 2


def text_of(content: Any) -> str:
    """The text of a message's content; non-text blocks (images, ...) are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = [p if isinstance(p, str) else p.get("text", "") for p in content if isinstance(p, str) or p.get("type") == "text"]
    return "".join(parts)


def _role_and_content(message: Any) -> tuple[str, Any]:
    if isinstance(message, (tuple, list)) and len(message) == 2:
        return str(message[0]), message[1]
    if isinstance(message, dict):
        return str(message.get("role", "")), message.get("content")
    role = getattr(message, "role", None) or getattr(message, "type", None)
    role = getattr(role, "value", role)  # LlamaIndex's MessageRole is an enum
    return str(role or ""), getattr(message, "content", None)


@dataclass(frozen=True)
class Conversation:
    """What the model reads of a chat: the caller's system text (after the engine's own instruction)
    and the turns, user and assistant, the last one the user's (the question being answered)."""

    turns: tuple[tuple[str, str], ...]
    system: str = ""
    # the system messages one by one, as they came (`system` joins them): a framework's context message
    # can then be told from the caller's own instructions (kvrag.ingest.prompt_match)
    system_messages: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.turns or self.turns[-1][0] != "user":
            raise ValueError("a conversation must end with a user message (a human message in LangChain): the question to answer")
        if not self.turns[-1][1].strip():
            raise ValueError("the last user message must be a non-empty string (the question)")
        for role, _ in self.turns:
            if role not in ("user", "assistant"):
                raise ValueError(f"a turn's role must be 'user' or 'assistant', got {role!r}")

    @classmethod
    def ask(cls, question: str) -> "Conversation":
        """The one-question case: a single user message, no system text."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        return cls(turns=(("user", question),))

    @classmethod
    def of(cls, messages: "Iterable[Any] | Conversation | str") -> "Conversation":
        """A conversation from messages (see the module docstring); a string is one question. System
        messages anywhere are joined, in order, into the system text; roles other than system, user
        and assistant (tool results, functions) are refused."""
        if isinstance(messages, Conversation):
            return messages
        if isinstance(messages, str):
            return cls.ask(messages)
        system: list[str] = []
        turns: list[tuple[str, str]] = []
        for message in messages:
            raw, content = _role_and_content(message)
            role = _ROLES.get(raw.lower())
            if role is None:
                raise ValueError(f"unsupported message role {raw!r}: use system, user or assistant")
            text = text_of(content)
            if role == "system":
                if text.strip():
                    system.append(text.strip())
            else:
                turns.append((role, text))
        if not turns:
            raise ValueError("the messages must contain a user message (a human message in LangChain): the question")
        return cls(turns=tuple(turns), system="\n\n".join(system), system_messages=tuple(system))

    @property
    def system_parts(self) -> tuple[str, ...]:
        """The system messages one by one (the joined `system` as one where they were not kept apart)."""
        return self.system_messages or ((self.system,) if self.system else ())

    @classmethod
    def with_system_parts(cls, turns: tuple[tuple[str, str], ...], parts: Sequence[str]) -> "Conversation":
        """A conversation whose system text is these messages, joined as `of` joins them."""
        kept = tuple(p for p in parts if p.strip())
        return cls(turns=turns, system="\n\n".join(kept), system_messages=kept)

    @property
    def question(self) -> str:
        """The last user message: the question this turn answers."""
        return self.turns[-1][1]

    @property
    def is_single(self) -> bool:
        """One user message and no system text: the single-question prompt, token for token."""
        return len(self.turns) == 1 and not self.system

    @property
    def history(self) -> tuple[tuple[str, str], ...]:
        """The turns before the question."""
        return self.turns[:-1]

    def user_texts(self) -> list[str]:
        return [text for role, text in self.turns if role == "user"]

    def retrieval_query(self, turns: int = RETRIEVAL_TURNS) -> str:
        """What a follow-up retrieves with: the last `turns` user messages together, newest last (a
        follow-up that says "it" then still finds the documents the earlier question was about)."""
        users = [t.strip() for t in self.user_texts() if t.strip()]
        return "\n".join(users[-max(1, turns):])

    def messages(self) -> list[dict[str, str]]:
        """OpenAI-style message dicts (what a server request carries)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": role, "content": text} for role, text in self.turns]

    def with_answer(self, answer: str, question: str) -> "Conversation":
        """This conversation, answered, with a new question after it (how a client sends turn two)."""
        return Conversation(turns=(*self.turns, ("assistant", answer), ("user", question)), system=self.system,
                            system_messages=self.system_messages)


def prompt_of(turns: Sequence[Turn]) -> str:
    """One plain-text prompt (a lone user message untouched), for `KVRag.complete`: where a caller
    hands a framework's ready-made prompt rather than messages."""
    if len(turns) == 1 and turns[0][0] == "user":
        return text_of(turns[0][1])
    labels = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
    return "\n\n".join(f"{labels.get(role, role.capitalize())}: {text_of(content)}" for role, content in turns)


def last_user_text(turns: Sequence[Turn]) -> str:
    """The question of a conversation that comes with documents: its last user message."""
    for role, content in reversed(turns):
        if _ROLES.get(str(role).lower()) == "user":
            return text_of(content)
    raise ValueError("with documents=..., the messages must contain a human message (the question)")
