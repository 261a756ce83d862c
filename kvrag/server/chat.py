"""`POST /v1/chat/completions`: OpenAI's chat completion, answered by the engine.

The conversation (system messages, earlier turns, the last user message) is answered through the
model's chat template (`KVRag.stream_chat`). With `kvrag.chunk_ids` / `kvrag.chunks` it is answered
from those chunks' cached KV. Without them (what any OpenAI client sends) the server retrieves: the
top-k chunks of its own index (the one `kvrag ingest` and `POST /v1/chunks` fill) for the recent user
turns, a follow-up reading the chunks its previous turn read first, in that turn's order (so the prefix
cache serves it: kvrag.ingest.follow_up), and the response names this turn's chunks in `kvrag_sources` (and the `X-KVRag-Sources`
header: their ids). An index it cannot reach is a 503 (index_unavailable), never an answer without
the context it should have read. With retrieval off (`kvrag serve --no-retrieval`, or `"kvrag": {"retrieve":
false}`), or nothing indexed, it is plain chat: the messages alone through the chat template. The engine's stats ride along as
`kvrag_stats` (in the last chunk when streaming), with OpenAI's `usage`. With `--cite-sources` (or the
request's `"kvrag": {"cite": true}`) the answer's text ends with the retrieved documents' titles and files
(kvrag.server.cite), for clients that show nothing but the text. A request the server retrieved for and
found nothing for (an empty index) says so: `X-KVRag-Warning`, `kvrag_warning` and, unless the request's
`"kvrag": {"warn_in_answer": false}`, the answer's first line (kvrag.server.empty); /metrics counts it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvrag.ingest.follow_up import conversation_chunks
from kvrag.kv.registry import removed_ids_by, request_scoped_chunks
from kvrag.pipeline import AnswerStream
from kvrag.server import empty
from kvrag.server.cite import sources_block, with_sources
from kvrag.server.errors import APIError, as_api_error, error_body, log
from kvrag.server.fit import fit_retrieved
from kvrag.server.gate import Slot
from kvrag.chat import Conversation
from kvrag.server.prompt import conversation_of
from kvrag.server.schemas import (
    ChatRequest,
    KVRagContext,
    answer_options,
    check_chunk_count,
    check_model,
    check_supported,
    check_token_count,
    message_texts,
)
from kvrag.server.state import ServerState, admit, client_gone, in_thread, pieces_async
from kvrag.server.tenants import cache_scope, request_salt
from kvrag.types import AnswerStats

router = APIRouter()


def _usage(stats: AnswerStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def _finish_reason(stats: AnswerStats, max_new: int) -> str:
    return "length" if stats.generated_tokens >= max_new else "stop"


@dataclass
class Started:
    """A prefilled answer, and the chunks the server retrieved for it (None: it retrieved nothing because
    the request brought its own context, or asked for plain chat)."""

    stream: AnswerStream
    sources: list[dict[str, Any]] | None = None
    cite: str = ""  # the sources block to append to the answer's text (kvrag.server.cite), or ""
    dropped: list[dict[str, str]] | None = None  # retrieved chunks not answered from, and why (kvrag.server.fit)
    warning: str | None = None  # why the answer read no document although the server retrieved (kvrag.server.empty)
    preface: str = ""  # the warning's line that opens the answer's text, or "" (the request opted out)

    def extra(self) -> dict[str, Any]:
        """The kvrag fields of the response: `kvrag_sources` when the server retrieved, `kvrag_dropped` when it skipped
        any, `kvrag_warning` when it found nothing to read."""
        out: dict[str, Any] = {} if self.sources is None else {"kvrag_sources": self.sources}
        if self.dropped:
            out["kvrag_dropped"] = self.dropped
        return {**out, **empty.fields(self.warning)}

    def headers(self) -> dict[str, str]:
        """The response's kvrag headers: the retrieved chunks' ids, and the warning."""
        return {**_source_headers(self.sources), **empty.headers(self.warning)}


def _starter(state: ServerState, req: ChatRequest, scope: str = "") -> Callable[[], Started]:
    """The engine call that prefills this request (run later, in a worker thread, holding a slot).

    The whole conversation reaches the model in every mode: the client's system messages (after the
    engine's instruction), the earlier turns and the question, through the model's chat template;
    a turn whose start an earlier turn computed reads only the rest (the exact prefix cache).
    It first checks the request's text against the token limit: every message and every chunk's
    title and text count. The tokenizer runs in that thread too, next to the engine's own
    tokenisation, never on the event loop. Inline chunks (`kvrag.chunks`) belong to this request
    alone (`request_scoped_chunks`): answered from, KV cached by content, never bound to their ids.
    `scope`: the caller's cache scope (kvrag.server.tenants): its prefix cache entries, inline chunks'
    KV and system prefixes are its own; retrieved and by-id chunks (the corpus) are shared.
    """
    check_model(req.model, state.model_name, state.settings)
    check_supported(req)
    opts = answer_options(req, state.settings, state.rag.default_setting, state.model_facts, cache_salt=scope)
    rag, settings, ctx = state.rag, state.settings, req.kvrag
    try:
        conv = conversation_of(req.messages)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_request", param="messages") from None
    if ctx is not None and ctx.has_context:
        if ctx.chunk_ids is not None and ctx.chunks is not None:
            raise as_api_error(ValueError("kvrag: pass either chunk_ids or chunks, not both"))
        check_chunk_count(len(ctx.chunk_ids or ctx.chunks or ()), settings)
        chunks = [c.to_chunk() for c in ctx.chunks] if ctx.chunks is not None else None
        texts = message_texts(req.messages) + [t for c in ctx.chunks or () for t in c.texts()]

        def start() -> Started:
            check_token_count(state.count_tokens(texts), settings)
            with request_scoped_chunks(scope), removed_ids_by(state.removed_ids):  # an id deleted through any replica: 400
                return Started(rag.stream_chat(conv, ctx.chunk_ids, chunks=chunks, options=opts))

        return start
    retrieve = _retriever(state, req, conv)
    texts = message_texts(req.messages)
    cite = settings.cite_sources if ctx is None or ctx.cite is None else ctx.cite
    warn_in_answer = ctx is None or ctx.warn_in_answer is not False

    def start_plain() -> Started:
        check_token_count(state.count_tokens(texts), settings)  # every message, as the engine reads them
        found = retrieve() if retrieve is not None else None
        # index entries retrieval skipped (the store binds their id to other text, or a moved vector): named too
        skipped = getattr(state.index, "last_skipped", None) if found is not None else None
        dropped: list[dict[str, str]] = list(skipped()) if callable(skipped) else []
        if found:  # a bad or oversized entry is skipped, the lowest-ranked dropped until they fit: never a 400
            found, fitted = fit_retrieved(rag, conv, found, opts, state.model_facts.adapter_link_tokens)
            dropped += fitted
        with request_scoped_chunks(scope, corpus=True):  # retrieved: the corpus's shared KV
            if found:  # answered from the retrieved chunks' cached KV (ingested: hits), never bound by id here
                sources = [source_of(c) for c in found]
                return Started(rag.stream_chat(conv, chunks=found, options=opts), sources, sources_block(sources) if cite else "", dropped)
            # plain chat through the model's chat template; known chunks a client pasted into its messages are reused
            warning = empty.warning_for(found, dropped)
            if warning is not None:
                empty.count(state.metrics, warning)
            return Started(rag.complete_chat(conv, options=opts), None if found is None else [], dropped=dropped, warning=warning,
                           preface=empty.first_line(warning) if warning and warn_in_answer else "")

    return start_plain


def source_of(chunk: Any) -> dict[str, Any]:
    """A retrieved chunk as `kvrag_sources` names it: id, title and its file's name relative to the folder
    ingested (kvrag.ingest.retrieval.public_source), never the server's own path."""
    from kvrag.ingest.retrieval import public_source

    return {"id": chunk.id, "title": chunk.title, "source": public_source(chunk)}


def _retriever(state: ServerState, req: ChatRequest, conv: Conversation) -> Callable[[], list] | None:
    """How a request without its own context finds its chunks: the top-k of the server's index for the
    conversation's recent user turns (a follow-up that says "it" retrieves with the question it follows:
    `ServerSettings.retrieval_turns`), those the turn before read first in its order, so the prefix cache
    serves the follow-up (kvrag.ingest.follow_up); None for plain chat (retrieval off for the server or the request).
    A request asking for retrieval from a server without an index is a 400."""
    ctx = req.kvrag or KVRagContext()
    wanted = state.settings.retrieval if ctx.retrieve is None else ctx.retrieve
    if not wanted:
        return None
    if state.index is None:
        if ctx.retrieve:
            raise APIError(400, "this server has no retrieval index (started with --no-retrieval): send kvrag.chunk_ids or "
                                "kvrag.chunks with the request", "no_retrieval_index", param="kvrag.retrieve")
        return None
    k = min(ctx.top_k or state.settings.top_k, state.settings.max_chunks)  # capped: a request reads at most max_chunks
    index, turns = state.index, state.settings.retrieval_turns
    return lambda: conversation_chunks(index, conv, k=k, turns=turns)


def _completion(req_id: str, created: int, model: str, text: str, stats: AnswerStats, max_new: int,
                extra: dict[str, Any]) -> dict[str, Any]:
    out = {
        "id": req_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": _finish_reason(stats, max_new), "logprobs": None}],
        "usage": _usage(stats),
        "kvrag_stats": stats.as_dict(),
        **extra,
    }
    return out


SOURCES_HEADER = "X-KVRag-Sources"
HEADER_LIMIT = 4096  # bytes of the header's JSON; beyond, it names the first ids that fit (the body has them all)


def _source_headers(sources: list[dict[str, Any]] | None) -> dict[str, str]:
    """The retrieved chunks' ids as a header (JSON, ASCII-escaped): where a client shows headers but not
    the body's extra fields (LangChain's `ChatOpenAI(include_response_headers=True)`)."""
    if sources is None:
        return {}
    ids = [s["id"] for s in sources]
    while ids and len(json.dumps(ids)) > HEADER_LIMIT:
        ids.pop()
    return {SOURCES_HEADER: json.dumps(ids)}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Finish:
    """Release the slot and count the answer, once, from whichever path ends the request first."""

    def __init__(self, state: ServerState, slot: Slot, stream: AnswerStream) -> None:
        self.state, self.slot, self.stream, self.done = state, slot, stream, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.slot.release()
            self.state.metrics.observe_answer(self.stream.stats)


class _StreamingAnswer(StreamingResponse):
    """A StreamingResponse that finishes its request however the response ends: a client that hung
    up before the first chunk cancels the body before the generator ever starts (so its own
    `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], finish: _Finish, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._finish()


async def _events(state: ServerState, started: Started, finish: _Finish, req_id: str, created: int, max_new: int) -> AsyncIterator[str]:
    """OpenAI's chunk stream. The slot is released in `finally` (and by `_StreamingAnswer`): when the
    client disconnects, the server cancels the body and the next request starts (after at most one
    more token)."""
    model, stream = state.model_name, started.stream
    sources = started.extra()  # kvrag_sources (and kvrag_dropped) in the first and the last chunk

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}

    try:
        yield _sse(chunk({"role": "assistant", "content": ""}, **sources))
        if started.preface:  # the warning first: the one place every client shows (kvrag.server.empty)
            yield _sse(chunk({"content": started.preface}))
        said = False
        async for piece in pieces_async(stream):
            if not said:  # the non-streaming answer is stripped; match it
                piece = piece.lstrip()
                said = bool(piece)
            if piece:
                yield _sse(chunk({"content": piece}))
        if started.cite:  # after the model's last piece: what the answer read, for clients that show only text
            yield _sse(chunk({"content": started.cite if said else started.cite.lstrip("\n")}))
        stats = stream.stats
        yield _sse(chunk({}, _finish_reason(stats, max_new), usage=_usage(stats), kvrag_stats=stats.as_dict(), **sources))
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client hung up: stop after the token in flight
        state.metrics.abandoned.labels("decoding").inc()
        raise
    except Exception as exc:  # the headers are sent: report the error in-band, as OpenAI does
        err = as_api_error(exc)
        yield _sse(error_body(err.status, err.message, err.code))
    finally:
        finish()


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatRequest, request: Request) -> Any:
    state: ServerState = request.app.state.kvrag
    empty.counter_of(state.metrics)  # on /metrics (at 0) from the first chat request on
    try:
        scope = cache_scope(request.state, state.settings, request_salt(req.cache_salt, req.kvrag and req.kvrag.cache_salt))
        start = _starter(state, req, scope)  # 400s (and 404 model_not_found) here, before queueing
    except Exception as exc:
        raise as_api_error(exc) from None
    max_new = req.max_completion_tokens or req.max_tokens or state.settings.max_new_tokens
    slot = await admit(state, request)  # QueueFullError -> 503; None: the client left while queued
    if slot is None:
        return client_gone(state, "queued")
    try:
        started = await in_thread(start)
    except BaseException as exc:
        slot.release()
        raise as_api_error(exc) if isinstance(exc, Exception) else exc
    stream = started.stream
    if await request.is_disconnected():  # the client left during the prefill: decode nothing
        slot.release()
        state.metrics.observe_answer(stream.stats)
        return client_gone(state, "prefilled")
    req_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        finish = _Finish(state, slot, stream)
        return _StreamingAnswer(
            _events(state, started, finish, req_id, created, max_new),
            finish,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **started.headers()},
        )
    try:
        text = await _collect(stream, request, state)
    except Exception as exc:
        raise as_api_error(exc) from None
    finally:
        slot.release()
        state.metrics.observe_answer(stream.stats)
    answer = started.preface + with_sources(text.strip(), started.cite)
    return JSONResponse(_completion(req_id, created, state.model_name, answer, stream.stats, max_new, started.extra()),
                        headers=started.headers())


async def _collect(stream: AnswerStream, request: Request, state: ServerState) -> str:
    """Decode to the end, stopping after the token in flight if the client went away (its slot is
    then free sooner). Checking costs one non-blocking receive per token."""
    text = []
    async for piece in pieces_async(stream):
        text.append(piece)
        if await request.is_disconnected():
            log.info("client disconnected; abandoning its answer after %d pieces", len(text))
            state.metrics.abandoned.labels("decoding").inc()
            break
    return "".join(text)
