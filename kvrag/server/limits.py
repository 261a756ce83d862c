"""ASGI middleware: the request body limit (413) and the per-endpoint request counter.

Pure ASGI rather than FastAPI middleware so a streamed response is neither buffered nor cut, and
so a body is refused from its Content-Length before it is read (or as soon as it runs past the
limit when sent chunked).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvrag.server.errors import error_body
from kvrag.server.metrics import ServerMetrics


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body; FastAPI passes HTTPExceptions through its body parsing."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body over the limit of {limit} bytes")


class LimitsAndCounts:
    def __init__(self, app: ASGIApp, metrics: ServerMetrics, max_body_bytes: int) -> None:
        self.app, self.metrics, self.max_body = app, metrics, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            length = _content_length(scope)
            if length is not None and length > self.max_body:
                await _send_413(counted_send, self.max_body)
                return
            received = 0

            async def limited_receive() -> Message:
                nonlocal received
                message = await receive()
                if message["type"] == "http.request":
                    received += len(message.get("body", b""))
                    if received > self.max_body:
                        raise BodyTooLarge(self.max_body)
                return message

            await self.app(scope, limited_receive, counted_send)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_413(send: Any, limit: int) -> None:
    body = json.dumps(error_body(413, f"request body over the limit of {limit} bytes", "body_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
