"""Errors as OpenAI-style JSON bodies (`{"error": {"message", "type", "code", "param"}}`).

Bad input gets a 4xx carrying the engine's own message; only a real fault is a 500, and its body
names no internals (the traceback goes to the server log).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvrag.errors import ChunkNotFoundError, ContextTooLongError, EmptyRetrievalError, KVRagError
from kvrag.ingest.index_url import EmbeddingMismatchError, IndexUnavailableError
from kvrag.server.gate import QueueFullError

log = logging.getLogger("kvrag.server")

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 503: "server_busy"}
# the code of an error the framework raised itself (FastAPI's "There was an error parsing the body" for JSON
# nested too deep or a number too long was `"code": null`, where every other parse error is invalid_request)
_HTTP_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
PARSE_FAILED = "There was an error parsing the body"  # FastAPI's detail when decoding the body raised other than JSONDecodeError
INDEX_RETRY_AFTER_S = 2  # what a 503 for an unreachable index suggests (a restarting `chroma run` is back in seconds)
CLIENT_CLOSED = 499  # nginx's "client closed request": the status counted for a request dropped because its client left


class APIError(Exception):
    """An error answer with its status, message, (OpenAI-style) code and the parameter at fault;
    `extra`: more fields of the answer's body, beside `error`."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        type: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers
        self.param, self.type, self.extra = param, type, extra


def error_body(status: int, message: str, code: str | None = None, param: str | None = None, type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "server_error"), "code": code, "param": param}}


def error_response(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def api_error_response(err: APIError) -> JSONResponse:
    body = {**error_body(err.status, err.message, err.code, err.param, err.type), **(err.extra or {})}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def as_api_error(exc: BaseException) -> APIError:
    """The answer for an exception an engine call raised: the engine's message for bad input, else a 500."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, IndexUnavailableError):  # never answered without the context it should have retrieved
        return APIError(503, str(exc), "index_unavailable", headers={"Retry-After": str(INDEX_RETRY_AFTER_S)}, type="server_error")
    if isinstance(exc, EmbeddingMismatchError):
        return APIError(503, str(exc), "index_mismatch", type="server_error")
    if isinstance(exc, ContextTooLongError):
        return APIError(400, str(exc), "context_length_exceeded")
    if isinstance(exc, ChunkNotFoundError):
        if exc.ids:  # the library's advice (precompute(), Chunk(...)) in HTTP terms
            return APIError(400, f"unknown chunk id(s) {exc.ids[:5]}: ingest them first (POST /v1/chunks) or send them "
                                 "with their text in kvrag.chunks", "chunk_not_found")
        return APIError(400, str(exc), "chunk_not_found")
    if isinstance(exc, EmptyRetrievalError):
        return APIError(400, str(exc), "no_chunks")
    if isinstance(exc, (KVRagError, ValueError, TypeError)):
        return APIError(400, str(exc), "invalid_request")
    log.error("internal error", exc_info=exc)
    return APIError(500, "internal server error (details are in the server log)", "internal_error")


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = [p for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":  # its location is a character offset, not a field
            parts.append(f"body is not valid JSON (at character {loc[0] if loc else '?'})")
            continue
        where = ".".join(str(p) for p in loc)
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")  # our validators' own messages
        parts.append(f"{where or 'body'}: {msg}")
    return "invalid request: " + "; ".join(parts)


def _counted(request: Request, err: APIError) -> APIError:
    """Count the refusals an operator alerts on (kvrag_index_unavailable_total)."""
    if err.code == "index_unavailable":
        state = getattr(request.app.state, "kvrag", None)
        if state is not None:
            state.metrics.index_unavailable.inc()
    return err


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can produce, rendered the same way."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return api_error_response(_counted(request, exc))

    @app.exception_handler(QueueFullError)
    async def _busy(request: Request, exc: QueueFullError) -> JSONResponse:
        state = request.app.state.kvrag
        state.metrics.rejected.inc()
        retry = str(state.settings.retry_after_s)
        return error_response(503, f"{exc}; retry after {retry}s", "queue_full", {"Retry-After": retry})

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc), "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 400 and message == PARSE_FAILED:
            message = "invalid request: body is not valid JSON (nested too deep, or a number too long to read)"
        return error_response(exc.status_code, message, _HTTP_CODES.get(exc.status_code), getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return api_error_response(_counted(request, as_api_error(exc)))
