"""Prompt layout: system prefix | chunk 1 | ... | chunk n | question suffix.

Each segment is tokenised on its own, so a chunk's token ids (and so its cache key) never depend
on its neighbours or its rank. The split points come from the model's own chat template; where the
documents go and how chunks and questions are written is the layout's choice (`LayoutOptions`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Sequence

from kvrag.chat import Conversation
from kvrag.kv.layout_options import LayoutOptions
from kvrag.types import Chunk

# Bump when the way segments are built or tokenised changes, or the default layout does: old cache entries
# become misses.
LAYOUT_VERSION = "3"
# the versions whose layouts this code lays out token for token as they did (a link adapter trained under one
# still fits the same layout: kvrag.link_adapter.check_adapter)
SAME_SEGMENTS = ("1", "2", "3")
# The input id a link slot carries in `Segments.all_ids` (never embedded: link slots take the link
# adapter's embedding rows instead).
LINK_PLACEHOLDER = 0


_CTX = "\x00KVRAG_CONTEXT\x00"
_Q = "\x00KVRAG_QUESTION\x00"
# around each message's own text in a rendered conversation: the text between is the template's
_OPEN, _CLOSE = "\x00KVRAG_OPEN\x00", "\x00KVRAG_CLOSE\x00"


@dataclass(frozen=True)
class Links:
    """Link slots after every chunk: how many, and what they attend to. "global" (KVLink's links): every earlier
    position; "chunk" (trailers, KV Packet's vectors without its header): the prefix and their own chunk, so what
    they hold depends on that chunk alone. One object so the count and its picture travel together."""

    count: int = 0
    scope: str = "global"

    def __post_init__(self) -> None:
        if self.scope not in ("global", "chunk"):
            raise ValueError(f"link_scope must be 'global' or 'chunk', got {self.scope!r}")
        if self.count < 0:
            raise ValueError(f"link slots per chunk must be >= 0, got {self.count}")

    @classmethod
    def of(cls, links: "Links | int") -> "Links":
        """`links` as Links: a bare count is that many global link slots."""
        return links if isinstance(links, Links) else cls(int(links))


@dataclass(frozen=True)
class Segments:
    """Token ids of one prompt, segment by segment, with each segment's start position.

    `links` (KVLink): that many link-token slots follow every chunk, so chunk n starts after the
    previous chunks and their links. Link slots carry no token id of their own (`LINK_PLACEHOLDER`
    in `all_ids`); their inputs are the link adapter's embedding rows. `link_scope`: what the link slots
    attend to, "global" (KVLink: every earlier position) or "chunk" (trailers: the prefix and their own
    chunk; kvrag.fuse.links.owners).
    """

    prefix: list[int]
    chunks: list[list[int]]
    question: list[int]
    links: int = 0
    link_scope: str = "global"

    def __post_init__(self) -> None:
        Links(self.links, self.link_scope)  # the one check of a count and its scope

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
    """Builds the segments of a RAG prompt from a tokenizer's chat template and `LayoutOptions`.

    `options`: LayoutOptions, a dict, a preset name or JSON (`LayoutOptions.of`); the keywords change
    single fields of it (`system_prompt` is the instruction). A layout whose segments would not read as
    the chat template renders the same messages (Full Attention token for token) raises ValueError."""

    def __init__(
        self,
        tokenizer: Any,
        options: "LayoutOptions | dict | str | None" = None,
        system_prompt: str | None = None,
        chunk_template: str | None = None,
        untitled_chunk_template: str | None = None,
        question_template: str | None = None,
    ) -> None:
        opts = LayoutOptions.of(options)
        changes = {"instruction": system_prompt, "chunk_template": chunk_template, "untitled_chunk_template": untitled_chunk_template,
                   "question_template": question_template}
        changes = {k: v for k, v in changes.items() if v is not None}
        if "chunk_template" in changes and "untitled_chunk_template" not in changes and opts.untitled_chunk_template is not None:
            changes["untitled_chunk_template"] = None  # derived from the new chunk template, not the old one's
        self.options = opts.replace(**changes) if changes else opts
        self.tokenizer = tokenizer
        self._chunk_ids_memo: dict[str, tuple[int, ...]] = {}
        self._prefix_memo: dict[tuple[str, str], tuple[int, ...]] = {}
        self._specials = tuple(sorted(_special_texts(tokenizer), key=len, reverse=True))
        o = self.options
        # what follows every chunk's text: the next chunk's head, or what the layout puts after the documents
        self._chunk_follower = o.documents_end or (o.question_template.format(question="x") if o.place == "user" else "x")
        self._chunk_head = o.untitled.format(text="x")[:1] or "x"
        self.prefix_text, self._single = self._render(Conversation.ask(_Q), True)
        self.prefix_ids = self._prefix_ids(self.prefix_text, self._chunk_head)
        at = next(i for i, p in enumerate(self._single) if _Q in p)
        self.suffix_text = self._single[at].split(_Q, 1)[1] + "".join(self._single[at + 1 :])
        self.suffix_ids = self._tail_ids([self._single[at].split(_Q, 1)[1], *self._single[at + 1 :]] if self._single[at].split(_Q, 1)[1]
                                         else self._single[at + 1 :])
        self._check_full()

    # -- the options, by their old names -------------------------------------------------------------
    @property
    def system_prompt(self) -> str:
        return self.options.instruction

    @property
    def chunk_template(self) -> str:
        return self.options.chunk_template

    @property
    def untitled_chunk_template(self) -> str:
        return self.options.untitled

    @property
    def question_template(self) -> str:
        return self.options.question_template

    # -- tokenising -----------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _encode_before(self, text: str, following: str) -> list[int]:
        """Ids of `text` as they are when `following` comes right after it in one string: a run of
        whitespace before a word splits differently than at the end of a string (byte-level BPE
        gives "\n\n" at the end, "\n" "\n" before "Question"), and Full Attention must read the
        chat template's rendering token for token. Depends on the first character of `following`
        only (a special token, split off before anything else, is the end of a string), so a chunk's
        ids still never depend on its neighbours."""
        if not text or not text[-1].isspace() or not following or following[0].isspace() or following.startswith(self._specials):
            return self._encode(text)
        ids = self._encode(text + following[0])
        if ids and self.tokenizer.decode(ids[-1:]) == following[0]:
            return ids[:-1]
        return self._encode(text)

    def _prefix_ids(self, text: str, following: str) -> list[int]:
        memo_key = (text, following[:1])
        ids = self._prefix_memo.get(memo_key)
        if ids is None:
            out = self._encode_before(text, following)
            tok = self.tokenizer
            bos = getattr(tok, "bos_token", None)
            if bos and getattr(tok, "add_bos_token", False) and not text.startswith(bos):
                out = [tok.bos_token_id] + out
            if len(self._prefix_memo) >= 64:
                self._prefix_memo.clear()
            ids = self._prefix_memo[memo_key] = tuple(out)
        return list(ids)

    def _tail_ids(self, pieces: Sequence[str]) -> list[int]:
        """The pieces after the chunks, each tokenised on its own (before the next one's first character)."""
        return [t for i, piece in enumerate(pieces) for t in self._encode_before(piece, pieces[i + 1] if i + 1 < len(pieces) else "")]

    # -- segments -------------------------------------------------------------------------
    def chunk_text(self, chunk: Chunk) -> str:
        if chunk.title:
            return self.options.chunk_template.format(title=chunk.title, text=chunk.text)
        return self.options.untitled.format(text=chunk.text)

    def header_lines(self, chunks: Sequence[Chunk]) -> set[str]:
        """The lines the chunk template puts above each chunk's text ("Document: eiffel"): a model
        that recites one before answering has not started its answer (see decode.leading_echo).
        Only a header on a line of its own counts; a template with none gives none."""
        mark = "\x00KVRAG_TEXT\x00"
        lines = set()
        for c in chunks:
            head = (self.options.chunk_template.format(title=c.title, text=mark) if c.title else self.options.untitled.format(text=mark)).split(mark, 1)[0]
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
            ids = tuple(self._encode_before(text, self._chunk_follower))
            if memo:
                if len(self._chunk_ids_memo) >= 8192:
                    self._chunk_ids_memo.clear()
                self._chunk_ids_memo[text] = ids
        return list(ids)

    def question_ids(self, question: str) -> list[int]:
        """Everything after the chunks of a one-question prompt: the question, in its template, and the template's text around it."""
        return self._tail_ids([p.replace(_Q, question) for p in self._single])

    def segments(self, chunk_ids: Sequence[list[int]], question: str, links: Links | int = 0) -> Segments:
        """The prompt's segments; `links`: the link slots after every chunk (never part of a cache key)."""
        links = Links.of(links)
        return Segments(prefix=list(self.prefix_ids), chunks=[list(c) for c in chunk_ids], question=self.question_ids(question),
                        links=links.count, link_scope=links.scope)

    # -- conversations ---------------------------------------------------------------------
    def conversation_segments(
        self, chunk_ids: Sequence[list[int]], conv: Conversation, links: Links | int = 0, documents: bool = True
    ) -> Segments:
        """The segments of a conversation: the chat template over the layout's messages (`conversation_messages`):
        everything before the chunks is the prefix (read exactly, computed once per distinct prefix),
        everything after them to the generation prompt the "question" segment (read exactly, like a
        question). One user message and no system text is `segments(...)`, token for token.

        `documents=False` (plain chat, no chunks): the caller's messages alone through the template,
        no engine instruction and no question template, as the model reads them anywhere else.
        """
        if documents and conv.is_single:
            return self.segments(chunk_ids, conv.question, links)
        prefix_text, pieces = self._render(conv, documents)
        following = self._chunk_head if chunk_ids else (pieces[0] if pieces else "")
        prefix_ids = self._prefix_ids(prefix_text, following)
        tail = self._tail_ids(pieces)
        if not prefix_ids:  # a template that renders nothing before the first message: its first token leads
            prefix_ids, tail = tail[:1], tail[1:]
        links = Links.of(links)
        return Segments(prefix=prefix_ids, chunks=[list(c) for c in chunk_ids], question=tail, links=links.count, link_scope=links.scope)

    def conversation_messages(self, chunks: Sequence[Chunk], conv: Conversation, documents: bool = True) -> list[dict[str, str]]:
        """The conversation as chat-template messages with the chunk texts inline: what Full
        Attention over it reads (`tokenizer.apply_chat_template(these, add_generation_prompt=True)`)."""
        return self._messages(conv, documents, "".join(self.chunk_text(c) for c in chunks), mark=False)

    def _messages(self, conv: Conversation, documents: bool, context: str, mark: bool) -> list[dict[str, str]]:
        wrap = (lambda t: _OPEN + t + _CLOSE) if mark else (lambda t: t)
        o = self.options
        if not documents:  # the caller's messages as they are (the context marker, empty, marks where the turns begin)
            messages = [{"role": "system", "content": conv.system}] if conv.system else []
            first = True
            for role, text in conv.turns:
                messages.append({"role": role, "content": (context if first and role == "user" else "") + wrap(text)})
                first = first and role != "user"
            return messages
        docs = context + o.documents_end
        turns = [{"role": role, "content": wrap(o.question_template.format(question=text) if role == "user" else text)}
                 for role, text in conv.turns]
        if o.place == "system":
            system = (o.instruction + "\n\n" if o.instruction else "") + docs
            if conv.system:
                ends = o.documents_end or o.untitled
                system += ("" if ends[-1:].isspace() else "\n\n") + wrap(conv.system)
            return [{"role": "system", "content": system}, *turns]
        system = o.instruction + ("\n\n" + conv.system if conv.system and o.instruction else conv.system)
        head = [{"role": "system", "content": system}] if system else []
        if o.place == "user":
            first = next(i for i, t in enumerate(turns) if t["role"] == "user")
            turns[first] = {"role": "user", "content": docs + turns[first]["content"]}
            return head + turns
        at = 0 if o.history == "after" else len(turns) - 1
        return head + turns[:at] + [{"role": "user", "content": docs}] + turns[at:]

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
                prefix = prefix.replace(_OPEN, "").replace(_CLOSE, "")
                return prefix, [p for p in re.split(f"{re.escape(_OPEN)}|{re.escape(_CLOSE)}", rest_text) if p]
        # No chat template: a plain instruction layout (the documents after the instruction, wherever `place` says).
        system = self.system_prompt + ("\n\n" + conv.system if conv.system else "") if documents else conv.system
        pieces: list[str] = [self.options.documents_end] if documents else []
        for role, text in conv.turns:
            if role == "user":
                pieces += [self.question_template.format(question=text) if documents else text, "\nAnswer:"]
            else:
                pieces += [" ", text, "\n\n"]
        return (f"{system}\n\n" if system else ""), [p for p in pieces if p]

    def _check_full(self) -> None:
        """Refuse a layout whose segments would not be the chat template's rendering token for token
        (Full Attention reads the segments): trailing whitespace in a chunk template that the tokenizer
        splits differently at the end of the documents' message than before the next document."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return
        chunks = [Chunk("probe-a", "Alpha beta gamma.", title="Probe"), Chunk("probe-b", "Delta epsilon.")]
        ids = [self.chunk_ids(c, memo=False) for c in chunks]
        one = Conversation.ask("What is alpha?")
        two = Conversation.of([("system", "Be brief."), ("user", "What is alpha?"), ("assistant", "Beta."), ("user", "And delta?")])
        for conv in (one, two):
            try:
                out = tok.apply_chat_template(self.conversation_messages(chunks, conv), tokenize=True, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 (a template that refuses these messages: nothing to compare with)
                return
            ref = list(out["input_ids"] if hasattr(out, "keys") else out)
            if self.conversation_segments(ids, conv).all_ids() != ref:
                raise ValueError(
                    "this layout's segments do not read as the chat template renders the same messages (Full Attention must, "
                    "token for token): a chunk template's trailing whitespace splits differently at the end of the documents' "
                    f"message (place={self.options.place!r}); end chunk_template with a single newline, or set documents_end "
                    "to text that follows the documents")

    def prompt_text(self, chunks: Sequence[Chunk], question: str) -> str:
        """The prompt as one string (what a plain LLM call would see), for display and debugging."""
        conv = Conversation.ask(question)
        if getattr(self.tokenizer, "chat_template", None):
            try:
                return self.tokenizer.apply_chat_template(self.conversation_messages(chunks, conv), tokenize=False, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 (templates that reject a system role: the segments' own text)
                pass
        return self.tokenizer.decode(self.segments([self.chunk_ids(c, memo=False) for c in chunks], question).read_ids())

    @property
    def identity(self) -> str:
        """Hash of everything that shapes cached KV besides the chunk itself: layout version and prefix ids
        (a chunk's own ids, template included, are in its key beside this)."""
        return self.identity_at(LAYOUT_VERSION)

    def identity_at(self, version: str) -> str:
        h = hashlib.sha256(f"layout-v{version}:".encode())
        h.update(",".join(map(str, self.prefix_ids)).encode())
        return h.hexdigest()[:32]

    @property
    def adapter_identities(self) -> dict[str, str]:
        """This layout's identity under each layout version whose segments this code builds token for token
        as it does (`SAME_SEGMENTS`): a link adapter trained under any of them fits a layout with its identity."""
        return {v: self.identity_at(v) for v in SAME_SEGMENTS}


def make_layout(tokenizer: Any, layout: "PromptLayout | LayoutOptions | dict | str | None" = None, **changes: Any) -> PromptLayout:
    """The engine's layout from what a user gives (a PromptLayout as it is; anything `LayoutOptions.of` reads;
    `changes`: single fields by their keyword names, `system_prompt` the instruction)."""
    if isinstance(layout, PromptLayout):
        if changes:
            raise ValueError(f"pass layout options in the layout, not beside a ready PromptLayout: {', '.join(changes)}")
        return layout
    return PromptLayout(tokenizer, layout, **changes)


def _special_texts(tokenizer: Any) -> set[str]:
    """The texts the tokenizer splits off before anything else (special and added tokens)."""
    out = {str(t) for t in getattr(tokenizer, "all_special_tokens", []) or []}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out |= {str(getattr(t, "content", t)) for t in added.values()}
    return {t for t in out if t}
