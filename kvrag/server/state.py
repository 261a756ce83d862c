"""What every route shares: the engine, the settings, admission and metrics; and how the async
routes call the synchronous engine (in a worker thread, never on the event loop)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, AsyncIterator, Callable, Iterable, Sequence, TypeVar
from urllib.parse import urlsplit

import anyio.to_thread
from fastapi import Request
from fastapi.responses import Response

from kvrag.model.home_thread import on_home

from kvrag.engine import KVRag
from kvrag.server.errors import CLIENT_CLOSED, log
from kvrag.server.gate import RequestGate, Slot
from kvrag.server.metrics import ServerMetrics
from kvrag.server.params import Model
from kvrag.server.settings import ServerSettings

T = TypeVar("T")
_END = object()
DISCONNECT_POLL_S = 0.1  # how often a queued request looks whether its client is still there


@dataclass
class ServerState:
    rag: KVRag
    settings: ServerSettings
    gate: RequestGate
    metrics: ServerMetrics
    index: Any = None  # the retrieval index (kvrag.ingest.retrieval.ChunkIndex); None: no server-side retrieval
    started: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        return str(self.settings.model or self.rag.lm.source)

    def count_tokens(self, texts: Iterable[str]) -> int:
        tok = self.rag.lm.tokenizer
        return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts if t)

    def removed_ids(self, ids: Sequence[str]) -> list[str]:
        """Of the ids this replica holds whose link the store's id index no longer has, those deleted
        (kvrag.kv.registry.removed_ids_by: a deleted id is chunk_not_found on every replica). With a
        retrieval index, which every DELETE empties first and every ingest fills, the index decides: an
        id it lacks was deleted, one it holds survived a store that lost its id index (a Redis
        restarted empty); an unreachable index is a 503, never an answer from text that may be deleted.
        Without one, the store's id index is every replica's registry: all of them."""
        if self.index is None:
            return list(ids)
        held = {c.id for c in self.index.get(ids)}
        return [i for i in ids if i not in held]

    @cached_property
    def model_facts(self) -> Model:
        """What the method-parameter checks need: the layer count and the link adapter's K."""
        from kvrag.model.loading import decoder_of

        try:
            n_layers: int | None = len(decoder_of(self.rag.lm.model).layers)
        except Exception:  # an engine stand-in without a decoder stack: layers checked loosely
            n_layers = None
        adapter = getattr(self.rag, "link_adapter", None)
        return Model(n_layers, getattr(adapter, "link_tokens", None))

    @property
    def store_kind(self) -> str:
        """The store's kind as a URL with nothing identifying in it (no path, host, user or password):
        `memory://`, `disk://`, `redis://`, `tiered://?tiers=host://|redis://`."""
        return store_kind(self.rag.store)


def store_kind(store: Any) -> str:
    tiers = getattr(store, "tiers", None)
    if isinstance(tiers, (list, tuple)) and tiers:
        return "tiered://?tiers=" + "|".join(store_kind(t) for t in tiers)
    scheme = urlsplit(str(getattr(store, "url", "") or "")).scheme.lower()
    return f"{scheme}://" if scheme.isalnum() else type(store).__name__


async def admit(state: ServerState, request: Request) -> Slot | None:
    """An engine slot for this request (QueueFullError when the queue is full), or None when its
    client disconnects while it waits: a request nobody will read never starts, and its place in the
    queue is free at once. Looks every DISCONNECT_POLL_S, and once more when the slot comes."""
    waiting = asyncio.ensure_future(state.gate.acquire())
    try:
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
            if done:
                slot = waiting.result()
                break
            if await request.is_disconnected():
                waiting.cancel()
                try:
                    late = await waiting  # the slot came as we cancelled: give it back
                except asyncio.CancelledError:
                    pass
                else:
                    late.release()
                return None
    except asyncio.CancelledError:  # the request itself is cancelled (server shutting down)
        waiting.cancel()
        raise
    state.metrics.queue_wait.observe(slot.waited_s)
    if await request.is_disconnected():
        slot.release()
        return None
    return slot


def client_gone(state: ServerState, stage: str) -> Response:
    """The answer to a request whose client has left (nobody reads it; the status is for the metrics)."""
    log.info("client disconnected while its request was %s; dropped", stage)
    state.metrics.abandoned.labels(stage).inc()
    return Response(status_code=CLIENT_CLOSED)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run an engine call off the event loop, which keeps serving (health, metrics, 503s): on the
    model's home thread when one serves (kvrag.model.home_thread), waited for by a worker thread."""
    return await anyio.to_thread.run_sync(on_home, fn, *args)


async def pieces_async(stream: Iterable[str]) -> AsyncIterator[str]:
    """An engine stream's pieces, each decoded in a worker thread. The engine takes the model lock per
    token, so a consumer that stops early (a client gone) leaves nothing held."""
    it = iter(stream)
    while True:
        piece = await anyio.to_thread.run_sync(next, it, _END)
        if piece is _END:
            return
        yield piece  # type: ignore[misc]
