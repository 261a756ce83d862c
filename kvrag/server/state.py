"""What every route shares: the engine, the settings, admission and metrics; and how the async
routes call the synchronous engine (in a worker thread, never on the event loop)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, TypeVar

import anyio.to_thread

from kvrag.engine import KVRag
from kvrag.server.gate import RequestGate
from kvrag.server.metrics import ServerMetrics
from kvrag.server.settings import ServerSettings

T = TypeVar("T")
_END = object()


@dataclass
class ServerState:
    rag: KVRag
    settings: ServerSettings
    gate: RequestGate
    metrics: ServerMetrics
    started: float = field(default_factory=time.time)

    @property
    def model_name(self) -> str:
        return str(self.settings.model or self.rag.lm.source)

    def count_tokens(self, texts: Iterable[str]) -> int:
        tok = self.rag.lm.tokenizer
        return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts if t)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run an engine call in a worker thread; the event loop keeps serving (health, metrics, 503s)."""
    return await anyio.to_thread.run_sync(fn, *args)


async def pieces_async(stream: Iterable[str]) -> AsyncIterator[str]:
    """An engine stream's pieces, each decoded in a worker thread. The engine takes the model lock per
    token, so a consumer that stops early (a client gone) leaves nothing held."""
    it = iter(stream)
    while True:
        piece = await anyio.to_thread.run_sync(next, it, _END)
        if piece is _END:
            return
        yield piece  # type: ignore[misc]
