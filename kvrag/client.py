"""The client side of `kvrag ask/ingest --server URL`: talk to a running `kvrag serve` with the
standard library only, so the CLI needs no HTTP dependency and never loads a model. A server with API
keys is sent `$KVRAG_API_KEY` as `Authorization: Bearer` (what OpenAI clients send as api_key)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any, Iterable, Iterator, Mapping, Sequence

from kvrag.methods.auto_ratio import AutoRatio
from kvrag.errors import KVRagError
from kvrag.pipeline import AnswerStream
from kvrag.options import AnswerOptions
from kvrag.types import AnswerStats, Chunk


class ServerError(KVRagError):
    """The server could not be reached, or answered with an error (its message is kept)."""


def _post(url: str, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    return _call(url, path, "POST", body, timeout)


def _call(url: str, path: str, method: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    with _open(url, path, method, body, timeout) as resp:
        return json.loads(resp.read().decode("utf-8"))


def _open(url: str, path: str, method: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """The open HTTP response; unreachable servers and error answers as ServerError."""
    full = url.rstrip("/") + path
    data = json.dumps(body).encode("utf-8") if body is not None else None
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("KVRAG_API_KEY", "").strip()
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(full, data=data, method=method, headers=headers)
    try:
        return urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{full}: HTTP {exc.code}: {_message(exc)}") from None
    except urllib.error.URLError as exc:
        raise ServerError(f"cannot reach the kvrag server at {url} ({exc.reason}); is `kvrag serve` running there?") from None
    except (TimeoutError, ConnectionError) as exc:
        raise ServerError(f"cannot reach the kvrag server at {url} ({exc}); is `kvrag serve` running there?") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read().decode("utf-8"))
        return str(body["error"]["message"])
    except Exception:
        return str(exc.reason)


def ask_via_server(
    url: str,
    question: str,
    chunk_ids: Sequence[str] | None = None,
    *,
    chunks: Sequence[Chunk] | None = None,
    method: str | None = None,
    recompute_ratio: float | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    stop_at: str | None = None,
    params: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
    timeout: float = 300.0,
) -> tuple[str, AnswerStats]:
    """Answer `question` on the server at `url` (e.g. http://127.0.0.1:8600), from chunks by id or
    with their text (none: plain chat); `policy`: read-whole policies for this request
    (`read_whole_policy`). Returns the answer's text and the engine's stats."""
    ctx: dict[str, Any] = {}
    if chunk_ids is not None:
        ctx["chunk_ids"] = list(chunk_ids)
    if chunks is not None:
        ctx["chunks"] = [{"id": c.id, "text": c.text, "title": c.title} for c in chunks]
    if chunk_ids is None and chunks is None:
        ctx["retrieve"] = False  # none: plain chat, not the server's own retrieval
    out = _ask(url, question, ctx, method=method, recompute_ratio=recompute_ratio, max_new_tokens=max_new_tokens,
               temperature=temperature, stop_at=stop_at, params=params, policy=policy, timeout=timeout)
    return out["choices"][0]["message"]["content"], AnswerStats.from_dict(out.get("kvrag_stats", {}))


def ask_retrieving_via_server(url: str, question: str, *, top_k: int | None = None, **options: Any) -> tuple[str, AnswerStats, list[Chunk]]:
    """Answer `question` from the server's own retrieval (the top-k chunks of its index); `options` are
    `ask_via_server`'s (method, recompute_ratio, max_new_tokens, temperature, stop_at, params, policy, timeout). Returns
    the answer's text, the engine's stats and the chunks it read (id, title, source; no text): none
    when the server found nothing (its index is empty) and answered as plain chat."""
    # cite: false: the text stays the model's (a --cite-sources server would append the sources returned here)
    ctx: dict[str, Any] = {"retrieve": True, "cite": False, **({"top_k": top_k} if top_k is not None else {})}
    out = _ask(url, question, ctx, **options)
    found = [Chunk(id=str(s["id"]), text="", title=str(s.get("title") or ""), metadata={"source": s.get("source") or ""})
             for s in out.get("kvrag_sources") or []]
    return out["choices"][0]["message"]["content"], AnswerStats.from_dict(out.get("kvrag_stats", {})), found


def _ask(url: str, question: str, ctx: dict[str, Any], *, method: str | None = None, recompute_ratio: float | None = None,
         max_new_tokens: int | None = None, temperature: float | None = None, stop_at: str | None = None,
         params: dict[str, Any] | None = None, policy: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """One non-streamed chat completion for `question` with the kvrag context `ctx` and these options."""
    body: dict[str, Any] = {"model": "kvrag", "messages": [{"role": "user", "content": question}]}
    if max_new_tokens is not None:
        body["max_tokens"] = max_new_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if method is not None:
        ctx["method"] = method
    if recompute_ratio is not None:
        ctx["recompute_ratio"] = recompute_ratio
    if stop_at is not None:
        ctx["stop_at"] = stop_at
    if params:
        ctx["params"] = dict(params)
    unknown = set(policy or ()) - set(POLICY_FIELDS)
    if unknown:
        raise ValueError(f"policy: unknown {sorted(unknown)} (one of {POLICY_FIELDS})")
    ctx.update({name: value for name, value in (policy or {}).items() if value is not None})
    body["kvrag"] = ctx
    return _post(url, "/v1/chat/completions", body, timeout)


def _chunk_item(chunk: Chunk) -> dict[str, str]:
    """A chunk as `POST /v1/chunks` takes it: its source as a local ingest records it (what `kvrag remove`
    names), and the name answers show for it (`public_source`: relative to the folder ingested)."""
    from kvrag.ingest.retrieval import public_source

    item = {"id": chunk.id, "text": chunk.text, "title": chunk.title}
    source = (chunk.metadata or {}).get("source")
    if isinstance(source, str) and source:
        item["source"], item["source_name"] = source, public_source(chunk)
    return item


def ingest_via_server(url: str, chunks: Iterable[Chunk], batch: int = 64, timeout: float = 600.0) -> dict[str, Any]:
    """Ingest chunks on the server (in requests of `batch`, the server's per-request limit by
    default); returns the summed report: chunks, computed, already_cached, tokens, seconds, and
    `indexed` (added to or changed in the server's retrieval index) only when the server retrieves.
    ServerError when the server refuses a batch, or answers that its store did not keep some KV
    (a 503 naming the chunks; the batches after it are not sent)."""
    items = [_chunk_item(c) for c in chunks]
    total: dict[str, Any] = {"chunks": 0, "computed": 0, "already_cached": 0, "tokens": 0, "seconds": 0.0}
    indexed: int | None = None
    for i in range(0, len(items), batch):
        out = _post(url, "/v1/chunks", {"chunks": items[i : i + batch]}, timeout)
        for k in total:
            total[k] += out.get(k, 0)
        if "indexed" in out:
            indexed = (indexed or 0) + int(out["indexed"])
    if indexed is not None:
        total["indexed"] = indexed
    return total


def delete_via_server(url: str, chunk_id: str, timeout: float = 60.0) -> dict[str, Any]:
    from urllib.parse import quote

    segment = quote(chunk_id, safe="")
    if segment in (".", ".."):  # a dot segment would be resolved away by URL normalisation
        segment = segment.replace(".", "%2E")
    return _call(url, "/v1/chunks/" + segment, "DELETE", None, timeout)


def health(url: str, timeout: float = 5.0) -> dict[str, Any]:
    return _call(url, "/health", "GET", None, timeout)


POLICY_FIELDS = ("min_recompute", "short_context", "records_whole")  # the read-whole policies a request may set


def read_whole_policy(options: AnswerOptions) -> dict[str, Any]:
    """The read-whole policies `options` set, for a request's `kvrag` field; unset ones (None) are
    left to the server's own settings."""
    return {name: getattr(options, name) for name in POLICY_FIELDS if getattr(options, name) is not None}


def request_body(
    text: str | Sequence[Mapping[str, Any]],
    chunk_ids: Sequence[str] | None = None,
    chunks: Sequence[Chunk] | None = None,
    options: AnswerOptions | None = None,
    stream: bool = False,
) -> dict[str, Any]:
    """The chat request for one question or a conversation (`text`: a string, or messages as
    `{"role", "content"}` dicts), with chunks or without (a ready-made prompt), carrying `options` as
    the local engine would read them. A lone user message reaches the engine untouched."""
    opts = options or AnswerOptions()
    if opts.evict is not None:
        raise ValueError("evict= (SnapKV) is not available through the server")
    method = opts.method if opts.method is None or isinstance(opts.method, str) else opts.method.name  # None: the server's
    dec = opts.decode
    body: dict[str, Any] = {
        "model": "kvrag", "stream": stream,
        "messages": [{"role": "user", "content": text}] if isinstance(text, str) else [dict(m) for m in text],
        "max_tokens": dec.max_new_tokens, "temperature": dec.temperature, "top_p": dec.top_p,
    }
    if dec.stop:
        body["stop"] = list(dec.stop)
    if dec.seed is not None:
        body["seed"] = dec.seed
    ratio = "auto" if isinstance(opts.recompute_ratio, AutoRatio) else opts.recompute_ratio
    ctx: dict[str, Any] = {"method": method, "recompute_ratio": ratio, "kv_kind": opts.kv_kind, "stop_at": dec.stop_at,
                           "params": dict(opts.method_params), **read_whole_policy(opts)}
    if not opts.prefix_cache:
        ctx["prefix_cache"] = False
    if chunks is not None:
        ctx["chunks"] = [{"id": c.id, "text": c.text, "title": c.title} for c in chunks]
    elif chunk_ids is not None:
        ctx["chunk_ids"] = list(chunk_ids)
    else:
        ctx["retrieve"] = False  # a ready-made prompt: plain chat, not the server's own retrieval
    body["kvrag"] = ctx
    return body


class RemoteStream(AnswerStream):
    """An `AnswerStream` over a server's SSE answer: iterate for text pieces; `.stats` is the same
    object throughout and is filled in place when the last chunk arrives."""

    def __init__(self, url: str, body: dict[str, Any], timeout: float = 300.0) -> None:
        self._resp = _open(url, "/v1/chat/completions", "POST", {**body, "stream": True}, timeout)
        ctx = body.get("kvrag", {})
        chunk_ids = [c["id"] for c in ctx.get("chunks", ())] or list(ctx.get("chunk_ids", ()))
        super().__init__(self._events(), AnswerStats(), chunk_ids)

    def _events(self) -> Iterator[str]:
        with self._resp as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise ServerError(str(event["error"].get("message")))
                if "kvrag_stats" in event:
                    for k, v in AnswerStats.from_dict(event["kvrag_stats"]).__dict__.items():
                        setattr(self.stats, k, v)
                piece = event["choices"][0]["delta"].get("content") if event.get("choices") else None
                if piece:
                    yield piece


def stream_via_server(
    url: str,
    text: str | Sequence[Mapping[str, Any]],
    chunk_ids: Sequence[str] | None = None,
    *,
    chunks: Sequence[Chunk] | None = None,
    options: AnswerOptions | None = None,
    timeout: float = 300.0,
) -> RemoteStream:
    """What `rag.stream(text, chunk_ids, chunks=..., options=...)` (with chunks) or
    `rag.complete(text, options=...)` (without) return, answered by the server at `url`; with
    messages for `text`, what `rag.stream_chat` / `rag.complete_chat` return."""
    return RemoteStream(url, request_body(text, chunk_ids, chunks, options), timeout)
