"""`create_app(rag, settings)`: the FastAPI app around one engine (tests inject a tiny one)."""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvrag.decode.batch import decode_batch_stats, reserve_decode_rows
from kvrag.engine import KVRag
from kvrag.server import chat, chunks
from kvrag.server.auth import APIKeys, KeyRing
from kvrag.server.bindings import StoreBinding
from kvrag.server.errors import install_error_handlers
from kvrag.server.gate import RequestGate
from kvrag.server.limits import LimitsAndCounts
from kvrag.kv.prefix_cache import PrefixCacheStats
from kvrag.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics, index_state_of
from kvrag.server.schemas import MODEL_ALIAS
from kvrag.server.settings import ServerSettings
from kvrag.server.state import ServerState
from kvrag.version import __version__


def create_app(rag: KVRag, settings: ServerSettings | None = None, index: Any = None) -> FastAPI:
    """An app serving `rag`: OpenAI-compatible chat, chunk ingest/delete, health and metrics. `index`
    (a kvrag.ingest.retrieval.ChunkIndex) is what chat requests without their own chunks retrieve from,
    and what `POST /v1/chunks` adds to; None: no server-side retrieval."""
    settings = settings or ServerSettings()
    if index is not None:  # an id whose KV entry is damaged or gone is recomputed from the index's text
        rag.recover_from(index)
        if getattr(index, "_key", None) is not None and getattr(rag, "repo", None) is not None:
            index.binding = StoreBinding(rag)  # with a store key, retrieval answers only what the store binds
    gate = RequestGate(settings.max_concurrency, settings.max_queue)
    if getattr(getattr(rag, "lm", None), "model", None) is not None:  # the answers running at once decode in one pool's rows
        reserve_decode_rows(rag.lm, settings.max_concurrency)
    prefix_cache = getattr(rag, "prefix_cache", None)
    metrics = ServerMetrics(gate, lambda: decode_batch_stats(getattr(rag.lm, "model", None)),
                            prefix_cache.snapshot if prefix_cache is not None else PrefixCacheStats, lambda: index_state_of(index))
    app = FastAPI(title="kvrag", version=__version__, description="RAG answers from cached per-chunk KV, OpenAI-compatible.")
    app.state.kvrag = ServerState(rag=rag, settings=settings, gate=gate, metrics=metrics, index=index)
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(chunks.router)
    app.add_middleware(APIKeys, keys=KeyRing(settings.api_keys, settings.read_keys))  # inside the counter: refusals are counted
    app.add_middleware(LimitsAndCounts, metrics=metrics, max_body_bytes=settings.max_body_bytes)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        """Liveness plus what a client wants to know: the model, the store, uptime, the queue."""
        state: ServerState = request.app.state.kvrag
        index, counts = await anyio.to_thread.run_sync(index_and_counts, state)  # not the model's thread: health answers during answers
        return {
            "status": "ok" if index["state"] in ("ok", "off") else "degraded",
            "version": __version__,
            "model": state.model_name,
            "store": state.store_kind,  # the kind only: no path, host or credentials
            "index": index,
            "auth": state.settings.authenticated,
            "uptime_s": round(time.time() - state.started, 3),
            "queue": state.gate.as_dict(),
            "chunks": counts,
            "default": default_of(state.rag),
        }

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        return Response(request.app.state.kvrag.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        """OpenAI's model list (some clients call it first): the one model this server serves, under
        its own name and as "kvrag" (the name kvrag's clients send)."""
        state: ServerState = request.app.state.kvrag
        names = dict.fromkeys([state.model_name, MODEL_ALIAS])
        return {"object": "list", "data": [{"id": n, "object": "model", "created": int(state.started), "owned_by": "kvrag"} for n in names]}

    return app


def default_of(rag: Any) -> dict[str, Any]:
    """What a request naming no method gets and why (`KVRag.default_setting`: calibrated per model), without
    calibrating or waiting for one: {"state": "calibrating"} until it is known."""
    peek = getattr(rag, "peek_default", None)
    setting = peek() if peek is not None else rag.default_setting
    return {"state": "calibrating"} if setting is None else {"state": "ok", **setting.as_dict()}


HEALTH_INDEX_WAIT_S = 0.5  # how long /health waits for a fresh count of a shared index before it says the last known


def index_and_counts(state: ServerState) -> tuple[dict[str, Any], dict[str, int | None]]:
    """What `/health` says of the retrieval index (`kind`: embedded, chroma:// or null; `state`: ok,
    off, unreachable or mismatch: no host, path or key) and of the chunks: `retrievable`, in that index
    (null: retrieval off or the index not ok); `ids_in_store`, ids the store's node-id index
    answers (any replica's, any model's sharing the store; null where not cheap to count);
    `registered_here`, ids this process has seen. A shared index is never waited for past
    HEALTH_INDEX_WAIT_S (ChunkIndex.refresh): a frozen index server is reported as last known, and as
    unreachable once a call to it has passed its bound."""
    index: dict[str, Any] = {"kind": None, "state": "off"}
    retrievable: int | None = None
    if state.index is not None:
        state.index.refresh(HEALTH_INDEX_WAIT_S)
        index = {"kind": getattr(state.index, "kind", "embedded"), "state": index_state_of(state.index)}
        retrievable = state.index.last_count if index["state"] == "ok" else None
    counts = {"retrievable": retrievable, "ids_in_store": state.rag.repo.store_index_size(),
              "registered_here": len(state.rag.repo.chunks)}
    return index, counts
