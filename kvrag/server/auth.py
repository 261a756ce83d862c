"""API keys: `Authorization: Bearer <key>` (what OpenAI clients send as `api_key`) on every route but
`/health`, with two rights: read (chat, completions, models, metrics) and write (POST and DELETE
/v1/chunks, which change what every client is answered from).

Pure ASGI, before any body is read: a refused request costs no parsing. Keys are compared as SHA-256
digests with `hmac.compare_digest`, against every key (no early exit), and never appear in a log,
an error or the settings' repr.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from kvrag.server.errors import error_body

READ, WRITE = "read", "write"
OPEN_PATHS = frozenset({"/health"})  # a load balancer's probe carries no key
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
WRITE_PREFIX = "/v1/chunks"


KEY_ID_STATE = "kvrag_key_id"  # where an accepted key's identity travels with its request (scope["state"], request.state)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def key_id(key: str) -> str:
    """A key's identity, the same in every replica given the key: a digest that names it without
    revealing it (the caches' tenant scope, kvrag.server.tenants). Never the key itself."""
    return hashlib.sha256(b"kvrag-key-id\0" + _digest(key)).hexdigest()[:32]


class KeyRing:
    """The keys a server accepts and the right each grants (a key given as both is a write key)."""

    def __init__(self, write_keys: Iterable[str] = (), read_keys: Iterable[str] = ()) -> None:
        self._keys = [(_digest(k), READ, key_id(k)) for k in read_keys] + [(_digest(k), WRITE, key_id(k)) for k in write_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def right_of(self, presented: str) -> str | None:
        """WRITE, READ, or None for a key this server does not accept; every key is compared."""
        return self.identify(presented)[0]

    def identify(self, presented: str) -> tuple[str | None, str | None]:
        """(right, key_id) of a presented key, (None, None) for one this server does not accept;
        every key is compared."""
        probe, found, ident = _digest(presented), None, None
        for digest, right, kid in self._keys:
            if hmac.compare_digest(probe, digest) and found != WRITE:
                found, ident = right, kid
        return found, ident


def needed_right(method: str, path: str) -> str | None:
    """The right a request needs: None for the open paths, WRITE for changing chunks, else READ."""
    if path in OPEN_PATHS:
        return None
    if method.upper() in WRITE_METHODS and (path == WRITE_PREFIX or path.startswith(WRITE_PREFIX + "/")):
        return WRITE
    return READ


def bearer_of(scope: Scope) -> str | None:
    """The key in `Authorization: Bearer <key>` (the scheme in any case), or None when there is none."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer":
                return None
            return key.strip() or None
    return None


class APIKeys:
    """Refuse a request without an accepted key (401) or with a read key where it writes (403), as
    OpenAI-shaped errors; pass the rest on untouched."""

    def __init__(self, app: ASGIApp, keys: KeyRing) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        needed = needed_right(scope.get("method", "GET"), scope.get("path", ""))
        if needed is None:
            await self.app(scope, receive, send)
            return
        presented = bearer_of(scope)
        right, ident = self.keys.identify(presented) if presented is not None else (None, None)
        if presented is None:
            await _refuse(send, 401, "no API key: this server needs `Authorization: Bearer <key>` (the OpenAI clients' "
                                     "api_key; kvrag's CLI and client read $KVRAG_API_KEY)", "missing_api_key")
        elif right is None:
            await _refuse(send, 401, "the API key is not one this server accepts", "invalid_api_key")
        elif needed == WRITE and right != WRITE:
            await _refuse(send, 403, "this API key may read (chat, models, metrics) but not write: adding, replacing and "
                                     "deleting chunks needs a key the server was given with --api-key",
                          "insufficient_permissions", "permission_error")
        else:
            scope.setdefault("state", {})[KEY_ID_STATE] = ident  # the caller's tenant (kvrag.server.tenants)
            await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str, code: str, type: str = "invalid_request_error") -> None:
    body = json.dumps(error_body(status, message, code, type=type)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="kvrag"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
