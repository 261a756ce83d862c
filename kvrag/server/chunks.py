"""`POST /v1/chunks` (ingest: register and precompute) and `DELETE /v1/chunks/{id}` (forget)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request

from kvrag.engine import KVRag
from kvrag.options import CHUNK_KINDS
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

    The keys are the engine repository's own (`repo.key(kind, token_ids)`) for every chunk kind; a
    chunk only the store knows (ingested through another replica) is found through its node-id link.
    The link itself is removed where the store offers `unlink`; otherwise it is left dangling, which
    resolves to a missing entry: an unknown chunk either way.
    """
    repo = rag.repo
    with repo._registry_lock:  # the registry's own lock: no request sees a half-forgotten chunk
        chunk = repo.chunks.pop(chunk_id, None)
    token_ids = repo.layout.chunk_ids(chunk) if chunk is not None else None
    linked = repo.guarded.resolve([chunk_id])[0]
    if token_ids is None and linked is not None:
        entry = repo.guarded.get(linked)
        if entry is None:  # a link to an entry already gone (forgotten before): nothing left to forget
            linked = None
        elif entry.token_ids is not None:
            token_ids = entry.token_ids.tolist()
    if token_ids is None and linked is None:
        return None
    keys = [repo.key(kind, token_ids) for kind in CHUNK_KINDS] if token_ids is not None else []
    if linked is not None and linked not in keys:
        keys.append(linked)
    removed = 0
    for key in keys:
        try:
            if repo.store.contains(key):
                repo.store.delete(key)
                removed += 1
        except Exception as exc:  # a store fault: report what was done, never a 500
            log.warning("could not delete cache entry %s…: %s", key[:12], exc)
    unlinked = False
    unlink = getattr(repo.store, "unlink", None)
    if callable(unlink):
        unlink([chunk_id])
        unlinked = True
    return {"id": chunk_id, "deleted": True, "kv_entries_removed": removed, "unlinked": unlinked}


@router.delete("/v1/chunks/{chunk_id:path}")
async def delete_chunk(chunk_id: str, request: Request) -> dict[str, Any]:
    """Forget a chunk: `{"id", "deleted": true, "kv_entries_removed": n, "unlinked": bool}`; 404 if unknown."""
    state: ServerState = request.app.state.kvrag
    out = await in_thread(forget, state.rag, chunk_id)
    if out is None:
        raise APIError(404, f"unknown chunk id {chunk_id!r}", "chunk_not_found")
    return out
