"""Request bodies, and how they become engine calls (options, chunks, the prompt).

The chat body is OpenAI's, plus one documented extra field, `kvrag`, carrying the retrieved
context; fields OpenAI clients send that kvrag has no use for (`user`, `stream_options`, ...) are ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvrag.options import DECODE_KEYS, OPTION_KEYS, AnswerOptions
from kvrag.server.errors import APIError
from kvrag.server.settings import ServerSettings
from kvrag.types import Chunk

_RESERVED = {*OPTION_KEYS, "options", *DECODE_KEYS}


class ChunkIn(BaseModel):
    """A chunk with its text: `{"id": ..., "text": ..., "title": ...}`."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=1024)
    text: str = Field(min_length=1)
    title: str = ""

    def to_chunk(self) -> Chunk:
        return Chunk(id=self.id, text=self.text, title=self.title)


class KVRagContext(BaseModel):
    """The `kvrag` extra field: the retrieved chunks (by id, or with their text) and the method."""

    model_config = ConfigDict(extra="forbid")
    chunk_ids: list[str] | None = None
    chunks: list[ChunkIn] | None = None
    method: str | None = None
    recompute_ratio: float | Literal["auto"] | None = Field(default=None)  # checked by AnswerOptions: [0, 1] or "auto"
    kv_kind: Literal["chunk", "similarity"] | None = None
    min_recompute: int | None = Field(default=None, ge=0, description="chunk tokens recomputed at least; no more than this: Full Attention (0: off)")
    stop_at: Literal["none", "line", "sentence"] | None = None  # when the answer is complete (default: the server's)
    params: dict[str, Any] = Field(default_factory=dict, description="the method's own parameters, e.g. {'layer': 1}")

    @property
    def has_context(self) -> bool:
        return self.chunk_ids is not None or self.chunks is not None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(BaseModel):
    """OpenAI's chat completion request (the fields kvrag honours) plus `kvrag`."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # the server serves one model; any name is accepted
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # absent: greedy (0), not OpenAI's 1
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int | None = Field(default=None, ge=1, le=1)
    kvrag: KVRagContext | None = None


class IngestRequest(BaseModel):
    """`POST /v1/chunks`: `{"chunks": [{"id", "text", "title"?}, ...]}`."""

    model_config = ConfigDict(extra="forbid")
    chunks: list[ChunkIn] = Field(min_length=1)


def answer_options(req: ChatRequest, settings: ServerSettings, default_method: str) -> AnswerOptions:
    """The request's options over the server's defaults; an unknown method or parameter is a 400 now,
    before the request waits for a slot. `default_method` is the engine's (KVRag.default_method): a
    request and the settings that name no method are checked against the method that will answer."""
    ctx = req.kvrag or KVRagContext()
    clash = sorted(_RESERVED & set(ctx.params))
    if clash:
        raise APIError(400, f"kvrag.params may hold only the method's own parameters; move {clash} out of it", "invalid_request")
    max_new = req.max_completion_tokens or req.max_tokens or settings.max_new_tokens
    if max_new > settings.max_tokens_limit:
        raise APIError(400, f"max_tokens is {max_new} but this server allows at most {settings.max_tokens_limit}", "invalid_request")
    kwargs: dict[str, Any] = dict(
        method=ctx.method or settings.method or default_method,
        recompute_ratio=settings.recompute_ratio if ctx.recompute_ratio is None else ctx.recompute_ratio,
        max_new_tokens=max_new,
        temperature=req.temperature or 0.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop=req.stop,
        seed=req.seed,
        **ctx.params,
    )
    if ctx.kv_kind is not None:
        kwargs["kv_kind"] = ctx.kv_kind
    if ctx.min_recompute is not None:
        kwargs["min_recompute"] = ctx.min_recompute
    if ctx.stop_at is not None:
        kwargs["stop_at"] = ctx.stop_at
    try:
        opts = AnswerOptions.from_kwargs(**kwargs)
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
