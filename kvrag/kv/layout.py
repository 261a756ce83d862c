"""Prompt layout: system prefix | chunk 1 | ... | chunk n | question suffix.

Each segment is tokenised on its own, so a chunk's token ids (and so its cache key) never depend
on its neighbours or its rank. The split points come from the model's own chat template.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

from kvrag.chat import Conversation
from kvrag.types import Chunk

# Bump when the way segments are built or tokenised changes: old cache entries become misses.
LAYOUT_VERSION = "1"
# The input id a link slot carries in `Segments.all_ids` (never embedded: link slots take the link
# adapter's embedding rows instead).
LINK_PLACEHOLDER = 0

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question using the documents below. "
    "Answer with a short phrase."
)
DEFAULT_CHUNK_TEMPLATE = "Document: {title}\n{text}\n\n"
DEFAULT_UNTITLED_CHUNK_TEMPLATE = "Document: {text}\n\n"
DEFAULT_QUESTION_TEMPLATE = "Question: {question}"

_CTX = "\x00KVRAG_CONTEXT\x00"
_Q = "\x00KVRAG_QUESTION\x00"
# around each message's own text in a rendered conversation: the text between is the template's
_OPEN, _CLOSE = "\x00KVRAG_OPEN\x00", "\x00KVRAG_CLOSE\x00"


@dataclass(frozen=True)
class Segments:
    """Token ids of one prompt, segment by segment, with each segment's start position.

    `links` (KVLink): that many link-token slots follow every chunk, so chunk n starts after the
    previous chunks and their links. Link slots carry no token id of their own (`LINK_PLACEHOLDER`
    in `all_ids`); their inputs are the link adapter's embedding rows.
    """

    prefix: list[int]
    chunks: list[list[int]]
    question: list[int]
    links: int = 0

    @property
    def chunk_starts(self) -> list[int]:
        starts, pos = [], len(self.prefix)
        for c in self.chunks:
            starts.append(pos)
            pos += len(c) + self.links
        return starts

    @property
    def chunk_tokens(self) -> int:
        """Tokens inside chunks (link slots not counted)."""
        return sum(len(c) for c in self.chunks)

    @property
    def context_len(self) -> int:
        """Tokens before the question: prefix + chunks (+ their link slots)."""
        return len(self.prefix) + self.chunk_tokens + self.links * len(self.chunks)

    @property
    def total_len(self) -> int:
        return self.context_len + len(self.question)

    def link_positions(self) -> list[int]:
        """Positions of the link slots: `links` of them right after each chunk."""
        return [s + len(c) + i for s, c in zip(self.chunk_starts, self.chunks) for i in range(self.links)]

    def all_ids(self) -> list[int]:
        ids = list(self.prefix)
        for c in self.chunks:
            ids.extend(c)
            ids.extend([LINK_PLACEHOLDER] * self.links)
        ids.extend(self.question)
        return ids

    def read_ids(self) -> list[int]:
        """The prompt's own tokens in order, without link placeholders: what decoding drafts from
        (kvrag.decode.draft)."""
        return [*self.prefix, *(t for c in self.chunks for t in c), *self.question]


class PromptLayout:
    """Builds the segments of a RAG prompt from a tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: Any,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        chunk_template: str = DEFAULT_CHUNK_TEMPLATE,
        untitled_chunk_template: str = DEFAULT_UNTITLED_CHUNK_TEMPLATE,
        question_template: str = DEFAULT_QUESTION_TEMPLATE,
    ) -> None:
        self.tokenizer = tokenizer
        self._chunk_ids_memo: dict[str, tuple[int, ...]] = {}
        self._prefix_memo: dict[str, tuple[int, ...]] = {}
        self.system_prompt = system_prompt
        self.chunk_template = chunk_template
        self.untitled_chunk_template = untitled_chunk_template
        self.question_template = question_template
        self.prefix_text, self.suffix_text = self._split_template()
        self.prefix_ids = self._prefix_ids(self.prefix_text)
        self.suffix_ids = self._encode(self.suffix_text)

    # -- template -------------------------------------------------------------------------
    def _split_template(self) -> tuple[str, str]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": _CTX + _Q},
            ]
            try:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # templates that reject a system role: fold it into the user turn
                messages = [{"role": "user", "content": self.system_prompt + "\n\n" + _CTX + _Q}]
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            if _CTX in text and _Q in text:
                prefix, rest = text.split(_CTX, 1)
                _, suffix = rest.split(_Q, 1)
                return prefix, suffix
        # No chat template: a plain instruction layout.
        return f"{self.system_prompt}\n\n", "\nAnswer:"

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _encode_before(self, text: str, following: str) -> list[int]:
        """Ids of `text` as they are when `following` comes right after it in one string: a run of
        whitespace before a word splits differently than at the end of a string (byte-level BPE
        gives "\n\n" at the end, "\n" "\n" before "Question"), and Full Attention must read the
        chat template's rendering token for token. Depends on the first character of `following`
        only, so a chunk's ids still never depend on its neighbours."""
        if not text or not text[-1].isspace() or not following or following[0].isspace():
            return self._encode(text)
        ids = self._encode(text + following[0])
        if ids and self.tokenizer.decode(ids[-1:]) == following[0]:
            return ids[:-1]
        return self._encode(text)

    def _prefix_ids(self, text: str) -> list[int]:
        ids = self._encode(text)
        tok = self.tokenizer
        bos = getattr(tok, "bos_token", None)
        if bos and getattr(tok, "add_bos_token", False) and not text.startswith(bos):
            ids = [tok.bos_token_id] + ids
        return ids

    # -- segments -------------------------------------------------------------------------
    def chunk_text(self, chunk: Chunk) -> str:
        template = self.chunk_template if chunk.title else self.untitled_chunk_template
        return template.format(title=chunk.title, text=chunk.text)

    def header_lines(self, chunks: Sequence[Chunk]) -> set[str]:
        """The lines the chunk template puts above each chunk's text ("Document: eiffel"): a model
        that recites one before answering has not started its answer (see decode.leading_echo).
        Only a header on a line of its own counts; a template with none gives none."""
        mark = "\x00KVRAG_TEXT\x00"
        lines = set()
        for c in chunks:
            head = (self.chunk_template if c.title else self.untitled_chunk_template).format(title=c.title, text=mark).split(mark, 1)[0]
            if head.endswith("\n"):
                line = head.strip().splitlines()[-1].strip() if head.strip() else ""
                if line:
                    lines.add(line)
        return lines

    def chunk_ids(self, chunk: Chunk, memo: bool = True) -> list[int]:
        """Token ids of a chunk; memoised, since every answer re-reads the same chunks (`memo=False`:
        ids already memoised are reused, new ones are not kept: one-off request-scoped chunks)."""
        text = self.chunk_text(chunk)
        ids = self._chunk_ids_memo.get(text)
        if ids is None:
            ids = tuple(self._encode_before(text, self.question_template))
            if memo:
                if len(self._chunk_ids_memo) >= 8192:
                    self._chunk_ids_memo.clear()
                self._chunk_ids_memo[text] = ids
        return list(ids)

    def question_ids(self, question: str) -> list[int]:
        return self._encode(self.question_template.format(question=question)) + self.suffix_ids

    def segments(self, chunk_ids: Sequence[list[int]], question: str, links: int = 0) -> Segments:
        """The prompt's segments; `links` KVLink link slots after every chunk (never part of a cache key)."""
        return Segments(
            prefix=list(self.prefix_ids), chunks=[list(c) for c in chunk_ids], question=self.question_ids(question), links=int(links)
        )

    # -- conversations ---------------------------------------------------------------------
    def conversation_segments(
        self, chunk_ids: Sequence[list[int]], conv: Conversation, links: int = 0, documents: bool = True
    ) -> Segments:
        """The segments of a conversation: the chat template over the engine's instruction and the
        caller's system text (the prefix), the chunks at the head of the first user turn, then every
        turn after them to the generation prompt (the "question" segment: read exactly, like a
        question). One user message and no system text is `segments(...)`, token for token.

        `documents=False` (plain chat, no chunks): the caller's messages alone through the template,
        no engine instruction and no question template, as the model reads them anywhere else.
        """
        if documents and conv.is_single:
            return self.segments(chunk_ids, conv.question, links)
        prefix_text, pieces = self._render(conv, documents)
        prefix = self._prefix_memo.get(prefix_text)
        if prefix is None:
            if len(self._prefix_memo) >= 64:
                self._prefix_memo.clear()
            prefix = self._prefix_memo[prefix_text] = tuple(self._prefix_ids(prefix_text))
        tail = [t for i, piece in enumerate(pieces) for t in self._encode_before(piece, pieces[i + 1] if i + 1 < len(pieces) else "")]
        prefix_ids = list(prefix)
        if not prefix_ids:  # a template that renders nothing before the first message: its first token leads
            prefix_ids, tail = tail[:1], tail[1:]
        return Segments(prefix=prefix_ids, chunks=[list(c) for c in chunk_ids], question=tail, links=int(links))

    def conversation_messages(self, chunks: Sequence[Chunk], conv: Conversation, documents: bool = True) -> list[dict[str, str]]:
        """The conversation as chat-template messages with the chunk texts inline: what Full
        Attention over it reads (`tokenizer.apply_chat_template(these, add_generation_prompt=True)`)."""
        messages = self._messages(conv, documents, "".join(self.chunk_text(c) for c in chunks), mark=False)
        return messages

    def _messages(self, conv: Conversation, documents: bool, context: str, mark: bool) -> list[dict[str, str]]:
        wrap = (lambda t: _OPEN + t + _CLOSE) if mark else (lambda t: t)
        system = self.system_prompt + ("\n\n" + conv.system if conv.system else "") if documents else conv.system
        messages = [{"role": "system", "content": system}] if system else []
        first = True
        for role, text in conv.turns:
            if role == "user":
                body = wrap(self.question_template.format(question=text) if documents else text)
                messages.append({"role": "user", "content": (context if first else "") + body})
                first = False
            else:
                messages.append({"role": "assistant", "content": wrap(text)})
        return messages

    def _render(self, conv: Conversation, documents: bool) -> tuple[str, list[str]]:
        """(prefix text, the pieces after the chunks): template text and each message's own text
        apart, so each piece is tokenised on its own (a turn's ids never depend on the next turn's)."""
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            messages = self._messages(conv, documents, _CTX, mark=True)
            try:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception:  # templates that reject a system role: fold it into the first user turn
                if not messages or messages[0]["role"] != "system":
                    raise
                system, rest = messages[0]["content"], messages[1:]
                for m in rest:
                    if m["role"] == "user":
                        m["content"] = system + "\n\n" + m["content"]
                        break
                text = tok.apply_chat_template(rest, tokenize=False, add_generation_prompt=True)
            if _CTX in text:
                prefix, rest_text = text.split(_CTX, 1)
                return prefix, [p for p in re.split(f"{re.escape(_OPEN)}|{re.escape(_CLOSE)}", rest_text) if p]
        # No chat template: a plain instruction layout (as `_split_template`'s).
        system = self.system_prompt + ("\n\n" + conv.system if conv.system else "") if documents else conv.system
        pieces: list[str] = []
        for role, text in conv.turns:
            if role == "user":
                pieces += [self.question_template.format(question=text) if documents else text, "\nAnswer:"]
            else:
                pieces += [" ", text, "\n\n"]
        return (f"{system}\n\n" if system else ""), [p for p in pieces if p]

    def prompt_text(self, chunks: Sequence[Chunk], question: str) -> str:
        """The prompt as one string (what a plain LLM call would see), for display and debugging."""
        body = "".join(self.chunk_text(c) for c in chunks)
        return self.prefix_text + body + self.question_template.format(question=question) + self.suffix_text

    @property
    def identity(self) -> str:
        """Hash of everything that shapes cached KV besides the chunk itself: layout version and prefix ids."""
        h = hashlib.sha256(f"layout-v{LAYOUT_VERSION}:".encode())
        h.update(",".join(map(str, self.prefix_ids)).encode())
        return h.hexdigest()[:32]
