"""`LayoutOptions`: how a RAG prompt is laid out, as one object a user sets on `KVRag`, `kvrag serve` and the
integrations.

Four choices shape the prompt: where the documents go (`place`), the engine's instruction, how each chunk
is written (`chunk_template`, with `{text}` and optionally `{title}`), and how each user turn is written
(`question_template`, with `{question}`). Whatever is chosen, each chunk is tokenised on its own and its
KV depends on nothing but the layout's prefix, so a layout is a free choice, made by measurement
(`kvrag eval layout`, docs/bench/layout/).

Places:
- "system": the documents in the system message, after the instruction (what LlamaIndex's context chat
  engines and LangChain's RAG templates do); the caller's own system text follows them there.
- "user": the documents at the head of the first user turn, before its question; the instruction and the
  caller's system text in the system message.
- "turn": the documents as a user turn of their own; `history="after"` puts it before every turn of the
  conversation, `history="before"` right before the question (after the earlier turns).
"""

from __future__ import annotations

import dataclasses
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

PLACES = ("system", "user", "turn")
HISTORY = ("after", "before")

# kvrag's instruction up to layout version 2 (the v1 preset's), and the wording LlamaIndex's context chat engine uses;
# the default layout has none (version 3: the measured instruction cost follow-ups over an index their turns)
V1_INSTRUCTION = "You are a helpful assistant. Answer the question using the documents below. Answer with a short phrase."
DEFAULT_INSTRUCTION = ""
FRAMEWORK_INSTRUCTION = "Use the context information below to assist the user."

_FIELDS = ("place", "instruction", "chunk_template", "untitled_chunk_template", "question_template", "documents_end", "history")


def _placeholders(template: str, field: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"layout {field} is not a valid template ({exc}): {template!r}; write a literal brace as {{{{ or }}}}") from None


def _check_template(template: Any, field: str, required: str, allowed: set[str]) -> None:
    if not isinstance(template, str):
        raise ValueError(f"layout {field} must be a string, got {type(template).__name__}")
    names = _placeholders(template, field)
    if required not in names:
        raise ValueError(f"layout {field} must contain {{{required}}} (where the {required} goes), got {template!r}")
    unknown = names - allowed
    if unknown:
        raise ValueError(f"layout {field} may only use {', '.join('{' + a + '}' for a in sorted(allowed))}; "
                         f"{', '.join('{' + u + '}' for u in sorted(unknown))} is unknown in {template!r}")


@dataclass(frozen=True)
class LayoutOptions:
    """How the prompt is laid out (module docstring). Validated when made: a template without its
    placeholder, an unknown place or a history order the place has no use for raises ValueError naming
    the field."""

    place: str = "system"
    instruction: str = DEFAULT_INSTRUCTION  # before the documents ("system") or as the system message ("user", "turn"); "" none
    chunk_template: str = "{title}\n{text}\n"  # a titled chunk: its title line, then its text
    untitled_chunk_template: str | None = None  # None: chunk_template without its "{title}" line
    question_template: str = "{question}"  # every user turn of a conversation with documents
    documents_end: str = ""  # text right after the last document, in the documents' message
    history: str = "after"  # "turn" only: the documents' turn before the conversation ("after") or right before the question

    def __post_init__(self) -> None:
        if self.place not in PLACES:
            raise ValueError(f"layout place must be one of {', '.join(PLACES)}, got {self.place!r}")
        if self.history not in HISTORY:
            raise ValueError(f"layout history must be one of {', '.join(HISTORY)}, got {self.history!r}")
        if self.history == "before" and self.place != "turn":
            raise ValueError("layout history='before' needs place='turn' (the documents as a user turn of their own); "
                             f"with place={self.place!r} the documents come before the conversation")
        for name in ("instruction", "documents_end"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"layout {name} must be a string, got {type(getattr(self, name)).__name__}")
        _check_template(self.chunk_template, "chunk_template", "text", {"text", "title"})
        if self.untitled_chunk_template is not None:
            _check_template(self.untitled_chunk_template, "untitled_chunk_template", "text", {"text"})
        _check_template(self.question_template, "question_template", "question", {"question"})

    @property
    def untitled(self) -> str:
        """The template of a chunk without a title: the given one, else chunk_template less its "{title}" line
        (a title inside a line: the template from "{text}" on)."""
        if self.untitled_chunk_template is not None:
            return self.untitled_chunk_template
        if "{title}\n" in self.chunk_template:
            return self.chunk_template.replace("{title}\n", "")
        if "{title}" in self.chunk_template:
            return self.chunk_template[self.chunk_template.index("{text}"):]
        return self.chunk_template

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One canonical line naming every choice (what a layout's identity hashes)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> "LayoutOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, value: "LayoutOptions | Mapping[str, Any] | str | Path | None") -> "LayoutOptions":
        """Options from what a user gives: None (the default), LayoutOptions, a dict, a preset's name
        (`PRESETS`), JSON text, or the path of a JSON file. Unknown keys are refused, naming them."""
        if value is None:
            return DEFAULT_LAYOUT
        if isinstance(value, LayoutOptions):
            return value
        if isinstance(value, Path):
            return cls.of(json.loads(value.read_text(encoding="utf-8")))
        if isinstance(value, str):
            text = value.strip()
            if text in PRESETS:
                return PRESETS[text]
            if text.startswith("{"):
                try:
                    return cls.of(json.loads(text))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"layout: not valid JSON ({exc})") from None
            path = Path(text).expanduser()
            if path.is_file():
                return cls.of(path)
            raise ValueError(f"layout must be a preset ({', '.join(PRESETS)}), JSON text or a JSON file, got {value!r}")
        if isinstance(value, Mapping):
            fields = dict(value)
            unknown = sorted(set(fields) - set(_FIELDS) - {"preset"})
            if unknown:
                raise ValueError(f"unknown layout option(s) {', '.join(unknown)}; known: preset, {', '.join(_FIELDS)}")
            preset = str(fields.pop("preset", "default"))
            if preset not in PRESETS:
                raise ValueError(f"unknown layout preset {preset!r}; known: {', '.join(PRESETS)}")
            return dataclasses.replace(PRESETS[preset], **fields)
        raise ValueError(f"layout must be LayoutOptions, a dict, a preset name, JSON text or a file, got {type(value).__name__}")


# the layout up to LAYOUT_VERSION 1: instruction in the system message, "Document:" headers at the head of the
# first user turn, "Question: " before every user turn
V1_LAYOUT = LayoutOptions(place="user", instruction=V1_INSTRUCTION, chunk_template="Document: {title}\n{text}\n\n",
                          untitled_chunk_template="Document: {text}\n\n", question_template="Question: {question}")
# the default from LAYOUT_VERSION 3 (the fields' own defaults): the documents in the system message with no
# instruction, a titled chunk as its title line and its text (an untitled one as its text), the question as the user
# wrote it; chosen by `kvrag eval layout`'s rule (docs/bench/layout)
DEFAULT_LAYOUT = LayoutOptions()
# as the model's own chat template would be given documents: the texts alone in the system message
CHAT_LAYOUT = DEFAULT_LAYOUT.replace(chunk_template="{text}\n")
# the default of layout version 2: CHAT_LAYOUT after kvrag's instruction
INSTRUCTION_LAYOUT = CHAT_LAYOUT.replace(instruction=V1_INSTRUCTION)
PRESETS: dict[str, LayoutOptions] = {"default": DEFAULT_LAYOUT, "chat": CHAT_LAYOUT, "instruction": INSTRUCTION_LAYOUT,
                                     "v1": V1_LAYOUT}


def face_layout(value: Any, *, rag: Any = None, server: str | None = None) -> LayoutOptions | None:
    """An integration's `layout` field, checked when the integration is made (not at its first call): the
    options themselves, and that they can apply (an engine passed in has its own layout; a server lays out
    its own prompts)."""
    if value is None:
        return None
    opts = LayoutOptions.of(value)
    if server:
        raise ValueError("layout: a kvrag server lays out its own prompts (`kvrag serve --layout ...`); leave layout unset with server=")
    if rag is not None and rag.layout.options != opts:
        raise ValueError("layout: the engine passed as rag= has another layout; set it on the engine (KVRag(..., layout=...)) instead")
    return opts
