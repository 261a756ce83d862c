"""Who shares cached state on one server: each API key is a tenant (and a client's `cache_salt` narrows
its own scope further).

What a request leaves cached that another request could detect (a shorter prefill, a higher
`prefix_hit_tokens`, a `cache_hits` count) is keyed with the caller's scope: the exact prefix cache
(finished turns: every message and chunk a tenant sent), the KV of chunks sent inline
(`kvrag.chunks`) and the memo of system prefixes. A tenant that guesses another's text therefore
learns nothing from it. What stays shared is the deployment's own corpus: chunks ingested with a
write key (`kvrag ingest`, `POST /v1/chunks`) and retrieved from the index, answered from one KV
entry each, the product itself (every reader may read them anyway).

The scope is the key's identity (kvrag.server.auth.key_id: a digest, never the key) plus the
request's `cache_salt` (vLLM's per-request field: top-level or in `kvrag`). Without API keys every
caller is one tenant: nothing changes unless a `cache_salt` is sent. `ServerSettings.share_prefix_cache`
(`kvrag serve --share-prefix-cache`) drops the key from the scope, for one trusted tenant with many
keys.
"""

from __future__ import annotations

from typing import Any

from kvrag.server.auth import KEY_ID_STATE
from kvrag.server.errors import APIError
from kvrag.server.settings import ServerSettings


def request_salt(top_level: str | None, in_kvrag: str | None) -> str | None:
    """The request's own `cache_salt`: top-level (as vLLM reads it) or in `kvrag`; both must agree."""
    if top_level is not None and in_kvrag is not None and top_level != in_kvrag:
        raise APIError(400, "cache_salt is given twice with different values (top-level and in kvrag): give it once",
                       "invalid_request", param="cache_salt")
    return top_level if top_level is not None else in_kvrag


def cache_scope(state: Any, settings: ServerSettings, salt: str | None) -> str:
    """The cache salt a request's cached state is keyed with ("": the unsalted scope every request
    of a server without keys shares). `state`: the request's `request.state`, where the API key
    middleware left the key's identity."""
    parts = []
    ident = getattr(state, KEY_ID_STATE, None)
    if ident and not settings.share_prefix_cache:
        parts.append(f"key:{ident}")
    if salt is not None:
        parts.append(f"salt:{salt}")
    return "\n".join(parts)
