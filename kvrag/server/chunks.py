"""`POST /v1/chunks` (ingest: register and precompute) and `DELETE /v1/chunks/{id}` (forget).

Documents have owners: an id already bound to other text (by `kvrag ingest`, or another writer through
any replica) is not rewritten by a POST unless it says `"replace": true`; both routes need a write key
when the server has keys (kvrag.server.auth)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Request
from starlette.convertors import Convertor, register_url_convertor

from kvrag.errors import ChunkNotFoundError, StoreUnavailableError
from kvrag.engine import KVRag
from kvrag.kv.repository import check_fits

from kvrag.server.errors import APIError, as_api_error
from kvrag.server.schemas import IngestRequest, check_chunk_count, check_token_count
from kvrag.server.state import ServerState, admit, client_gone, in_thread
from kvrag.server.write_undo import WriteUndo
from kvrag.types import Chunk

router = APIRouter()
log = logging.getLogger("kvrag.server")


class _AnyText(Convertor[str]):
    """Starlette's `path` convertor, newlines included: an id registered through the library (or
    before ingest refused control characters) can still be deleted over HTTP."""

    regex = r"[\s\S]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("kvrag_chunk_id", _AnyText())


def _report(report: Any, indexed: int | None) -> dict[str, Any]:
    out = {"chunks": report.chunks, "computed": report.computed, "already_cached": report.already_cached,
           "tokens": report.tokens, "seconds": round(report.seconds, 4)}
    if indexed is not None:
        out["indexed"] = indexed  # added to (or changed in) the server's retrieval index
    return out


@router.post("/v1/chunks")
async def ingest(body: IngestRequest, request: Request) -> Any:
    """Register the chunks by id and compute the KV of those not cached yet.

    Response: `{"chunks": n, "computed": n, "already_cached": n, "tokens": n, "seconds": s, "indexed": n}`
    (`tokens`: of the chunks computed now; `indexed`: added to or changed in the server's retrieval
    index, present when the server retrieves). Every limit (chunk count, tokens of every title and text,
    each chunk fitting the model's context) is checked before anything is registered: a refused
    request leaves no chunk behind, here or in the store's id index. When the store did not keep
    the KV of some computed chunks (down, frozen, full), the answer is a 503 whose `error.not_stored`
    lists them, and each of them is put back as it was before the request: its registration here, its link in
    the store and its entry in the index (kvrag.server.write_undo); the other chunks of the request are written.
    """
    state: ServerState = request.app.state.kvrag
    check_chunk_count(len(body.chunks), state.settings)
    ids = [c.id for c in body.chunks]
    if len(set(ids)) != len(ids):
        raise APIError(400, "chunk ids must be unique within one request", "duplicate_id")
    chunks = [c.to_chunk() for c in body.chunks]
    texts = [t for c in body.chunks for t in c.texts()]
    rag = state.rag

    def run() -> Any:
        check_token_count(state.count_tokens(texts), state.settings)
        resolved = rag.repo.resolve(chunks, memo=False)  # no text or no tokens: a 400, nothing registered
        check_fits(rag.lm, rag.layout, chunks, resolved.token_ids)  # too long for the context: a 400, likewise
        held = holdings(state, chunks, resolved.keys)  # before anything is written: an unreachable index is a 503 here
        taken = [i for i, verdict in held.items() if verdict == OTHER]
        if taken and not body.replace:
            raise APIError(409, f"{len(taken)} chunk id(s) already hold other text or another title (ingested by `kvrag ingest` "
                                f"or another writer): {', '.join(map(repr, taken[:5]))}{' ...' if len(taken) > 5 else ''}. "
                                'Send "replace": true to replace them (their source and title become this request\'s), '
                                "or use new ids", "chunk_exists", param="chunks", extra={"conflicts": taken})
        before = rag.repo.bindings(ids) if state.index is not None else None  # what a failed index write puts back
        undo = WriteUndo.before(rag.repo, chunks, resolved.keys)  # what a write the store did not take puts back
        report = rag.precompute(chunks, progress=False)
        failed = undo.failed(report.not_stored)
        undo.undo(failed)  # a 503 below: nothing of these ids' write is left, here or in the store
        report.not_stored = list(dict.fromkeys([*report.not_stored, *failed]))
        indexed = None
        if state.index is not None:  # retrievable by chat requests without context, as `kvrag ingest` leaves them
            missing = set(report.not_stored)  # as kvrag ingest: the index holds only chunks whose KV is stored
            # a chunk the index holds as it is keeps its entry (an ingested file's source stays its own); a new or
            # replaced one, or one the index lacks or the store key cannot verify there (LINKED: written signed
            # now), is written whole: its source and title are this request's, never the old file's
            fresh = [c for c in chunks if c.id not in missing and held.get(c.id) != SAME]
            try:
                indexed = state.index.add(fresh) if fresh else 0
            except Exception:  # the index refused (down, frozen): the store's links go back, so the 503 changed nothing
                if before is not None:
                    rag.repo.rebind(before)
                else:  # the store could not be read before: this replica's own registration goes back at least
                    undo.undo([c.id for c in fresh])
                raise
            try:
                settle(state, [c.id for c in fresh])
            except Exception as exc:  # noqa: BLE001 (the write is done; a later write or read settles it)
                log.warning("could not confirm the store's links against the index after a write: %s", exc)
        return report, indexed

    slot = await admit(state, request)  # precompute runs the model: it waits its turn like an answer
    if slot is None:
        return client_gone(state, "queued")
    try:
        report, indexed = await in_thread(run)
    except Exception as exc:
        raise as_api_error(exc) from None
    finally:
        slot.release()
    out = _report(report, indexed)
    state.metrics.precomputed.labels("computed").inc(out["computed"])
    state.metrics.precomputed.labels("already_cached").inc(out["already_cached"])
    if report.not_stored:
        state.metrics.precomputed.labels("not_stored").inc(len(report.not_stored))
        n = len(report.not_stored)
        raise APIError(
            503,
            f"the KV store did not keep the KV of {n} of {report.chunks} chunks, or could not confirm their ids' links "
            f"(is it reachable, or full?): {', '.join(map(repr, report.not_stored[:5]))}{' ...' if n > 5 else ''}. "
            "These ids were put back as they were before this request (here, in the store and in the index): "
            "retry the ingest once the store is back",
            "kv_not_stored",
            headers={"Retry-After": str(state.settings.retry_after_s)},
            type="server_error",
            extra={**out, "not_stored": list(report.not_stored)},
        )
    return out


SAME, OTHER, LINKED = "same", "other", "linked"  # LINKED: this text in the store's links, not (verified) in the index
SETTLE_ROUNDS = 5


def settle(state: ServerState, ids: list[str]) -> None:
    """After a write to the retrieval index, bind each id in the store to the text the index now holds
    for it, then read the index again until the two agree: two replicas replacing one id at once end
    with one text in both places (the last index write), whatever order their writes landed in. A
    replica's last act is a link it confirmed by reading the index after it; any later index write is
    followed by its writer's own confirmed link."""
    repo = state.rag.repo
    for _ in range(SETTLE_ROUNDS):
        held = {c.id: c for c in state.index.get(ids, bound=False)} if ids else {}  # the index as it is, bound or not
        links = repo.store_links(list(held))
        if not held or links is None:
            return
        stale = [c for c, key in zip(held.values(), links) if key != repo.chunk_key(repo.layout.chunk_ids(c, memo=False))]
        if not stale:
            return
        log.info("%d chunk id(s) were replaced through another writer meanwhile: bound to the index's text", len(stale))
        state.rag.register(stale)
    log.warning("chunk ids %s: the index and the store's links kept changing under concurrent writes", ids[:5])


def holdings(state: ServerState, chunks: list[Chunk], keys: list[str]) -> dict[str, str]:
    """What these ids hold already, for the ids that hold anything: SAME (this text and title), OTHER, or
    LINKED (the store links this text, the index does not hold it: to be indexed).

    The retrieval index (shared by every replica when it is a chroma server) is asked first: it has the
    text, title and source of what `kvrag ingest` and every writer put there (with a store key, only the
    entries the key verifies). An id it does not hold is looked up in the KV store's node-id index
    (shared through Redis), which knows the content key.
    """
    out: dict[str, str] = {}
    if state.index is not None:
        for old in state.index.get([c.id for c in chunks]):
            new = next(c for c in chunks if c.id == old.id)
            out[old.id] = SAME if (old.text, old.title) == (new.text, new.title) else OTHER
    rest = [(c, k) for c, k in zip(chunks, keys) if c.id not in out]
    for (chunk, key), held in zip(rest, _stored_keys(state.rag, [c.id for c, _ in rest])):
        if held is not None:
            out[chunk.id] = LINKED if held == key else OTHER
    return out


def _stored_keys(rag: KVRag, ids: list[str]) -> list[str | None]:
    """The KV entry key each id is bound to in the store's node-id index (every replica's); None for an
    id it does not bind, whatever this process's table says (another replica may have deleted it). Only
    where the store cannot be read is this process's registry asked instead."""
    if not ids:
        return []
    repo = rag.repo
    found = repo.store_links(ids)
    if found is not None:
        return found
    return [repo.resolve([repo.chunks[i]]).keys[0] if i in repo.chunks else None for i in ids]


def forget(rag: KVRag, chunk_id: str) -> dict[str, Any] | None:
    """Forget one id: drop it from the engine's registry and from the store's node-id index, and
    delete its KV entries unless another id still refers to them (entries are content-keyed; see
    `ChunkRegistry.forget_report` for how far that is checked); None when nobody knows the id.

    A chunk only the store knows (ingested through another replica) is found through the
    repository's namespaced node-id index. `unlinked`: the store's index no longer resolves the id.
    """
    try:
        resolved = rag.repo.lookup([chunk_id], None)  # with the token ids the entry was stored under
    except ChunkNotFoundError:
        return None
    report = rag.repo.forget_report(resolved)
    return {"id": chunk_id, "deleted": True, "kv_entries_removed": report.deleted, "kv_entries_kept": report.kept,
            "unlinked": report.unlinked}


def check_links_reachable(state: ServerState, chunk_id: str) -> None:
    """A 503 (`kv_store_unavailable`) when the store's node-id index cannot be read now (a Redis down, or
    inside its back-off after a fault). Why before anything is removed: the id's link there is what every
    replica resolves it through, and it cannot be dropped while the store is out of reach; deleting the
    index entry and this registry's copy without it would leave the id answered by id elsewhere. Refused
    whole instead, a retry once the store is back deletes it fully. A store that never fails to read its
    index (memory, disk) is never refused here (`KVRag.check_links_readable`)."""
    try:
        state.rag.check_links_readable([chunk_id])
        return
    except StoreUnavailableError:
        pass
    retry = state.settings.retry_after_s
    raise APIError(
        503,
        f"chunk {chunk_id!r} was not deleted: the KV store's node-id index (shared by every replica) cannot be "
        f"reached, so its link could not be removed; nothing was changed. Retry after {retry}s, once the store is back",
        "kv_store_unavailable",
        headers={"Retry-After": str(retry)},
        type="server_error",
    )


@router.delete("/v1/chunks/{chunk_id:kvrag_chunk_id}")
async def delete_chunk(chunk_id: str, request: Request) -> dict[str, Any]:
    """Forget a chunk: `{"id", "deleted": true, "kv_entries_removed": n, "kv_entries_kept": n, "unlinked": bool,
    "unindexed": bool}` (`kept`: entries another id still refers to; `unindexed`: removed from the
    server's retrieval index, present when the server retrieves); 404 if unknown; 503 with nothing
    changed when the retrieval index or the store's node-id index cannot be reached."""
    state: ServerState = request.app.state.kvrag

    def run() -> dict[str, Any] | None:
        check_links_reachable(state, chunk_id)  # before anything is removed: a delete is whole or not at all
        if state.index is None:
            return forget(state.rag, chunk_id)
        # the index first: when it cannot be reached the answer is a 503 and nothing has changed
        unindexed = bool(state.index.remove([chunk_id]))  # no longer retrieved for questions, by any replica
        out = forget(state.rag, chunk_id)
        if out is None and unindexed:  # only the retrieval index knew it
            out = {"id": chunk_id, "deleted": True, "kv_entries_removed": 0, "kv_entries_kept": 0, "unlinked": False}
        if out is not None:
            out["unindexed"] = unindexed
        return out

    try:
        out = await in_thread(run)
    except Exception as exc:  # an unreachable index: a 503 (nothing changed), not a logged 500
        raise as_api_error(exc) from None
    if out is None:
        raise APIError(404, f"unknown chunk id {chunk_id!r}", "chunk_not_found")
    return out
