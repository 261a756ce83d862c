"""Request bodies, and how they become engine calls (options, chunks, the prompt).

The chat body is OpenAI's, plus one documented extra field, `kvrag`, carrying the retrieved
context; fields OpenAI clients send that change nothing in an answer (`user`, `stream_options`,
`metadata`, ...) are ignored, while those asking for what kvrag does not do (`tools`,
`response_format` other than text, `logprobs`, `n` > 1, penalties, `logit_bias`) are a 400
`unsupported` rather than silently ignored.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvrag.defaults import DefaultSetting
from kvrag.options import DECODE_KEYS, OPTION_KEYS, AnswerOptions
from kvrag.server.errors import APIError
from kvrag.server.params import Model, check_method_params
from kvrag.server.settings import ServerSettings
from kvrag.types import Chunk

_RESERVED = {*OPTION_KEYS, "options", *DECODE_KEYS}
CACHE_SALT_HELP = ("scopes what this request reads from and leaves in the server's caches (the exact prefix cache, its inline "
                   "chunks' KV): only requests with the same salt and API key share them (kvrag.server.tenants)")
MODEL_ALIAS = "kvrag"  # the name every kvrag client sends; always accepted besides the served model's own
INT64 = 2**63


def id_problem(chunk_id: str) -> str | None:
    """Why a chunk id cannot be ingested over HTTP (None: it can). Control characters (newlines,
    tabs, NUL, DEL, C1) and lone surrogates are refused: such an id could not be named in a URL path
    to delete it, nor written to a log line, a Redis field or a terminal unambiguously."""
    for ch in chunk_id:
        cat = unicodedata.category(ch)
        if cat == "Cc":
            return f"chunk ids must not contain control characters (found {ch!r}); use printable text"
        if cat == "Cs":
            return "chunk ids must not contain lone surrogates; use valid Unicode text"
    return None


def text_problem(text: str) -> str | None:
    """Why a text cannot be read as Unicode (None: it can): a lone surrogate (JSON's "\\ud800" with no
    partner) is no character, and no tokenizer encodes it."""
    for i, ch in enumerate(text):
        if unicodedata.category(ch) == "Cs":
            return (f"holds a lone surrogate (U+{ord(ch):04X} at character {i}), which is not valid Unicode text and "
                    "cannot be encoded: send UTF-8 text (a JSON \\ud83d must be followed by its low half)")
    return None


def _checked_text(value: Any) -> Any:
    """`value` if it is a string that encodes (or no string), else the ValueError a 400 names."""
    if isinstance(value, str):
        problem = text_problem(value)
        if problem:
            raise ValueError(problem)
    return value


class ChunkIn(BaseModel):
    """A chunk with its text: `{"id", "text", "title"?, "source"?, "source_name"?}`. `source`: the document it
    came from, as `kvrag remove` names it (`kvrag ingest --server` sends the file's path as the command was
    given it, as a local ingest records it); `source_name`: its name as chat answers' `kvrag_sources` show
    it (default: `source`'s file name; the command sends the path relative to the folder ingested)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=1024)
    text: str = Field(min_length=1)
    title: str = ""
    source: str = Field("", max_length=4096)
    source_name: str = Field("", max_length=1024)

    @field_validator("id", mode="before")  # before pydantic's own str check: it refuses a lone surrogate in generic words
    @classmethod
    def _printable_id(cls, value: Any) -> Any:
        problem = id_problem(value) if isinstance(value, str) else None
        if problem:
            raise ValueError(problem)
        return value

    def to_chunk(self) -> Chunk:
        """As a local ingest records a file's chunk: its source, and the name shown for it (SOURCE_NAME_KEY)."""
        from kvrag.ingest.retrieval import SOURCE_NAME_KEY

        meta = {"source": self.source} if self.source else {}
        if self.source_name:
            meta[SOURCE_NAME_KEY] = self.source_name
        return Chunk(id=self.id, text=self.text, title=self.title, metadata=meta)

    def texts(self) -> tuple[str, str]:
        """Every text field the token limit counts."""
        return self.title, self.text


class KVRagContext(BaseModel):
    """The `kvrag` extra field: the retrieved chunks (by id, or with their text) and the method."""

    model_config = ConfigDict(extra="forbid")
    chunk_ids: list[str] | None = None
    chunks: list[ChunkIn] | None = None
    method: str | None = None
    recompute_ratio: float | Literal["auto"] | None = Field(default=None)  # checked by AnswerOptions: [0, 1] or "auto"
    kv_kind: Literal["chunk", "similarity"] | None = None
    min_recompute: int | None = Field(default=None, ge=0, description="chunk tokens recomputed at least; no more than this: Full Attention (0: off)")
    short_context: int | None = Field(default=None, ge=0, description="contexts of at most this many chunk tokens: Full Attention (0: off)")
    records_whole: bool | None = Field(default=None, description="chunks that are records of one kind: Full Attention (default: on)")
    stop_at: Literal["none", "line", "sentence"] | None = None  # when the answer is complete (default: the server's)
    params: dict[str, Any] = Field(default_factory=dict, description="the method's own parameters, e.g. {'layer': 1}")
    retrieve: bool | None = Field(default=None, description="without chunk_ids/chunks: retrieve from the server's index "
                                                           "(default: the server's setting), or false for plain chat")
    top_k: int | None = Field(default=None, ge=1, le=10_000, description="chunks retrieved, at most the server's --max-chunks "
                                                                          "(default: the server's --top-k)")
    cite: bool | None = Field(default=None, description="append 'Sources: [1] <title> (<file>)' for the retrieved chunks to "
                                                       "the answer's text (default: the server's --cite-sources, off)")
    prefix_cache: bool | None = Field(default=None, description="false: neither read this request's start from the exact "
                                                                "prefix cache nor keep its KV there (default: on)")
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024, description=CACHE_SALT_HELP)
    warn_in_answer: bool | None = Field(default=None, description="false: an answer that read no document says so only in X-KVRag-Warning and kvrag_warning, not in its first line (kvrag.server.empty)")

    @property
    def has_context(self) -> bool:
        return self.chunk_ids is not None or self.chunks is not None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _encodable(cls, value: Any) -> Any:
        """A message the tokenizer cannot encode is the client's 400, said plainly (not the tokenizer's own words)."""
        for part in value if isinstance(value, list) else [value]:
            _checked_text(part.get("text") if isinstance(part, dict) else part)
        return value


class ChatRequest(BaseModel):
    """OpenAI's chat completion request (the fields kvrag honours) plus `kvrag`."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # the served model's name or "kvrag" (any with ServerSettings.accept_any_model); absent: the served one
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # absent: greedy (0), not OpenAI's 1
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, le=INT64 - 1)  # OpenAI's: a 64-bit integer
    stream: bool = False
    kvrag: KVRagContext | None = None

    @field_validator("stop")
    @classmethod
    def _encodable_stop(cls, value: Any) -> Any:
        for stop in [value] if isinstance(value, str) else value or ():
            _checked_text(stop)
        return value

    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024, description=CACHE_SALT_HELP)  # vLLM's field
    # asked of OpenAI, not done here: a 400 `unsupported` unless the value asks for nothing (see check_supported)
    n: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


def _off(field: str, value: Any) -> bool:
    """Whether an OpenAI field's value asks for nothing kvrag would have to do."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if field == "n":
        return value == 1 and not isinstance(value, bool)
    if field in ("presence_penalty", "frequency_penalty", "top_logprobs"):
        return value == 0 and not isinstance(value, bool)
    if field in ("tool_choice", "function_call"):
        return value == "none"
    if field == "response_format":
        return isinstance(value, dict) and value.get("type") == "text" and set(value) == {"type"}
    if field == "modalities":
        return value == ["text"]
    return False


_UNSUPPORTED = {
    "n": "more than one choice per request is not supported by this server: n must be 1 (send n requests instead)",
    "tools": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "tool_choice": "tool calling is not supported by this server",
    "function_call": "function calling is not supported by this server",
    "response_format": 'structured output is not supported by this server: response_format may only be {"type": "text"}',
    "logprobs": "log probabilities are not returned by this server: logprobs must be false",
    "top_logprobs": "log probabilities are not returned by this server: top_logprobs must be 0",
    "logit_bias": "logit_bias is not supported by this server",
    "presence_penalty": "penalties are not supported by this server: presence_penalty must be 0",
    "frequency_penalty": "penalties are not supported by this server: frequency_penalty must be 0",
    "audio": "audio output is not supported by this server",
    "modalities": 'this server answers with text only: modalities may only be ["text"]',
    "prediction": "predicted outputs are not supported by this server",
}


def check_supported(req: ChatRequest) -> None:
    """A 400 `unsupported` naming the first OpenAI field that asks for what this server does not do."""
    for field, message in _UNSUPPORTED.items():
        if not _off(field, getattr(req, field)):
            raise APIError(400, message, "unsupported", param=field)


def check_model(name: str | None, served: str, settings: ServerSettings) -> None:
    """OpenAI answers an unknown model with 404 `model_not_found`; so does this server, unless it is
    configured to accept any name (`accept_any_model`)."""
    if name is None or settings.accept_any_model or name in (served, MODEL_ALIAS):
        return
    raise APIError(
        404,
        f"The model {name[:200]!r} does not exist on this server: it serves {served!r} (also named {MODEL_ALIAS!r})",
        "model_not_found",
        param="model",
        type="invalid_request_error",
    )


def message_texts(messages: Iterable[Message]) -> list[str]:
    """Every text a chat's messages hold (string contents and the text of content parts)."""
    out: list[str] = []
    for m in messages:
        if isinstance(m.content, str):
            out.append(m.content)
        elif isinstance(m.content, list):
            out.extend(p["text"] for p in m.content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return out


class IngestRequest(BaseModel):
    """`POST /v1/chunks`: `{"chunks": [{"id", "text", "title"?}, ...], "replace"?: false}`. An id that
    already holds other text or another title (ingested by `kvrag ingest` or another writer) is a 409
    unless `replace` is true."""

    model_config = ConfigDict(extra="forbid")
    chunks: list[ChunkIn] = Field(min_length=1)
    replace: bool = False


def answer_options(req: ChatRequest, settings: ServerSettings, default_method: str | DefaultSetting, model: Model | None = None,
                   cache_salt: str = "") -> AnswerOptions:
    """The request's options over the server's defaults; an unknown method or parameter, or a
    parameter's value the served `model` (its layer count, its link adapter) cannot use, is a 400 now,
    before the request waits for a slot. `default_method` is the engine's (KVRag.default_setting, with
    the ratio its model's calibration chose where the request and the settings name no other): a
    request and the settings that name no method are checked against the method that will answer.
    A parameter given as null is the method's default. `cache_salt`: the caller's cache scope (kvrag.server.tenants)."""
    ctx = req.kvrag or KVRagContext()
    clash = sorted(_RESERVED & set(ctx.params))
    if clash:
        raise APIError(400, f"kvrag.params may hold only the method's own parameters; move {clash} out of it", "invalid_request")
    params = {k: v for k, v in ctx.params.items() if v is not None}
    check_method_params(params, model or Model())
    max_new = req.max_completion_tokens or req.max_tokens or settings.max_new_tokens
    if max_new > settings.max_tokens_limit:
        raise APIError(400, f"max_tokens is {max_new} but this server allows at most {settings.max_tokens_limit}", "invalid_request")
    kwargs: dict[str, Any] = dict(
        method=ctx.method or settings.method,  # None: the engine's default (below)
        recompute_ratio=settings.recompute_ratio if ctx.recompute_ratio is None else ctx.recompute_ratio,
        max_new_tokens=max_new,
        temperature=req.temperature or 0.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=req.stop,
        seed=req.seed,
        cache_salt=cache_salt,
        **params,
    )
    if ctx.kv_kind is not None:
        kwargs["kv_kind"] = ctx.kv_kind
    for name in ("min_recompute", "short_context", "records_whole", "prefix_cache"):
        if getattr(ctx, name) is not None:
            kwargs[name] = getattr(ctx, name)
    if ctx.stop_at is not None:
        kwargs["stop_at"] = ctx.stop_at
    try:
        opts = AnswerOptions.from_kwargs(**kwargs).with_default_method(default_method)
    except (ValueError, TypeError) as exc:  # a ratio, kind or decode setting out of range
        raise APIError(400, str(exc), "invalid_request") from None
    try:
        opts.resolved_method()  # unknown method or parameter: ValueError / TypeError with the engine's message
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), "invalid_method") from None
    return opts


def check_chunk_count(n: int, settings: ServerSettings) -> None:
    if n > settings.max_chunks:
        raise APIError(413, f"{n} chunks in one request; this server accepts at most {settings.max_chunks}", "too_many_chunks")


def check_token_count(n: int, settings: ServerSettings) -> None:
    if n > settings.max_request_tokens:
        raise APIError(413, f"the request holds {n} tokens of text; this server accepts at most {settings.max_request_tokens}", "too_many_tokens")
