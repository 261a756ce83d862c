"""Where a ChunkIndex lives: the embedded default (a folder on this machine) or a shared Chroma
server (`chroma://host:port/collection`, a `chroma run` every replica talks to), and the errors a
shared one adds: unreachable (a retry may help) and built with another embedding model (it never will).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator
from urllib.parse import unquote, urlsplit

from kvrag.errors import KVRagError

__all__ = ["EmbeddingMismatchError", "IndexURL", "IndexUnavailableError", "parse_index_url", "reachable_errors"]

SCHEME = "chroma"
DEFAULT_PORT = 8000  # `chroma run`'s own default
HTTP_TIMEOUT_S = 10.0  # the most a caller waits for one call (kvrag.ingest.index_calls): chromadb's client waits forever
CONNECT_TIMEOUT_S = 3.0
# httpx's own read timeout, past the callers' bound: a call its caller gave up on stays outstanding that long at most,
# and meanwhile new calls are refused at once (index_calls) rather than each waiting the bound again
READ_TIMEOUT_S = 3 * HTTP_TIMEOUT_S


class IndexUnavailableError(KVRagError):
    """The shared index server could not be reached (down, restarting, frozen). Retrieval refuses to
    answer without it rather than answer without context; the server says 503."""


class EmbeddingMismatchError(KVRagError):
    """The collection was filled with another embedding model: its vectors and ours do not compare."""


@dataclass(frozen=True)
class IndexURL:
    """A shared index: host, port and collection of a `chroma run` server."""

    host: str
    port: int
    collection: str | None  # None: the caller's default collection

    def display(self, collection: str) -> str:
        """The URL as logs may show it (it never carries credentials)."""
        return f"{SCHEME}://{self.host}:{self.port}/{collection}"


def parse_index_url(url: str) -> IndexURL:
    """`chroma://host:port/collection` (port 8000 and the caller's collection when left out); a clear
    error for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() != SCHEME:
        raise ValueError(f"index URL {url!r}: expected chroma://host:port/collection (a `chroma run` server)")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"index URL {parts.scheme}://{parts.hostname}: only chroma://host:port/collection is understood "
                         "(no user, password, query or fragment)")
    if not parts.hostname:
        raise ValueError(f"index URL {url!r} names no host: chroma://host:port/collection")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"index URL {url!r}: the port is not a number from 1 to 65535") from None
    name = unquote(parts.path.strip("/")) or None
    if name is not None and "/" in name:
        raise ValueError(f"index URL {url!r}: the path is one collection name, not {name!r}")
    return IndexURL(parts.hostname, port, name)


def open_http_client(where: IndexURL) -> Any:
    """chromadb's HttpClient for `where`, with bounded timeouts; IndexUnavailableError when nothing
    answers there. Callers bound the wait for it (kvrag.ingest.index_calls): the client's first requests
    are made before its timeouts can be set."""
    import chromadb

    try:
        client = chromadb.HttpClient(host=where.host, port=where.port, settings=chromadb.Settings(anonymized_telemetry=False))
    except Exception as exc:  # chromadb raises ValueError("Could not connect to a Chroma server...")
        raise IndexUnavailableError(f"cannot reach the index server at chroma://{where.host}:{where.port} ({exc}); "
                                    "is `chroma run` running there?") from None
    session = getattr(getattr(client, "_server", None), "_session", None)
    if session is not None:  # a call left behind by its caller (index_calls) ends, not a thread held forever
        import httpx

        session.timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    return client


def reachable_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the index server did not answer" (not "the request was wrong")."""
    import httpx

    return (httpx.TransportError, ConnectionError, TimeoutError)


@contextlib.contextmanager
def unavailable_as(where: str) -> Iterator[None]:
    """Turn a transport failure of the index server at `where` into IndexUnavailableError."""
    try:
        yield
    except reachable_errors() as exc:
        raise IndexUnavailableError(f"the index server at {where} is unreachable ({type(exc).__name__}: {exc}); "
                                    "retry once it is back") from None
