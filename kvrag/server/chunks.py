"""`POST /v1/chunks` (ingest: register and precompute) and `DELETE /v1/chunks/{id}` (forget)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from kvrag.errors import ChunkNotFoundError
from kvrag.engine import KVRag

from kvrag.server.errors import APIError, as_api_error
from kvrag.server.schemas import IngestRequest, check_chunk_count, check_token_count
from kvrag.server.state import ServerState, in_thread

router = APIRouter()
log = logging.getLogger("kvrag.server")


@router.post("/v1/chunks")
async def ingest(body: IngestRequest, request: Request) -> dict[str, Any]:
    """Register the chunks by id and compute the KV of those not cached yet.

    Response: `{"chunks": n, "computed": n, "already_cached": n, "tokens": n, "seconds": s}`
    (`tokens`: of the chunks computed now).
    """
    state: ServerState = request.app.state.kvrag
    check_chunk_count(len(body.chunks), state.settings)
    ids = [c.id for c in body.chunks]
    if len(set(ids)) != len(ids):
        raise APIError(400, "chunk ids must be unique within one request", "duplicate_id")
    chunks = [c.to_chunk() for c in body.chunks]

    def run() -> dict[str, Any]:
        check_token_count(state.count_tokens(c.text for c in chunks), state.settings)
        report = state.rag.precompute(chunks, progress=False)
        return {"chunks": report.chunks, "computed": report.computed, "already_cached": report.already_cached,
                "tokens": report.tokens, "seconds": round(report.seconds, 4)}

    slot = await state.gate.acquire()  # precompute runs the model: it waits its turn like an answer
    state.metrics.queue_wait.observe(slot.waited_s)
    try:
        out = await in_thread(run)
    except Exception as exc:
        raise as_api_error(exc) from None
    finally:
        slot.release()
    state.metrics.precomputed.labels("computed").inc(out["computed"])
    state.metrics.precomputed.labels("already_cached").inc(out["already_cached"])
    return out


def forget(rag: KVRag, chunk_id: str) -> dict[str, Any] | None:
    """Drop a chunk from the engine's registry and its KV from the store; None when nobody knows it.

    A chunk only the store knows (ingested through another replica) is found through the
    repository's namespaced node-id index. The link itself stays (stores have no unlink yet): it
    resolves to a missing entry, i.e. an unknown chunk either way.
    """
    try:
        resolved = rag.repo.lookup([chunk_id], None)  # with the token ids the entry was stored under
    except ChunkNotFoundError:
        return None
    removed = rag.repo.forget(resolved)
    return {"id": chunk_id, "deleted": True, "kv_entries_removed": removed, "unlinked": False}


@router.delete("/v1/chunks/{chunk_id:path}")
async def delete_chunk(chunk_id: str, request: Request) -> dict[str, Any]:
    """Forget a chunk: `{"id", "deleted": true, "kv_entries_removed": n, "unlinked": bool}`; 404 if unknown."""
    state: ServerState = request.app.state.kvrag
    out = await in_thread(forget, state.rag, chunk_id)
    if out is None:
        raise APIError(404, f"unknown chunk id {chunk_id!r}", "chunk_not_found")
    return out
