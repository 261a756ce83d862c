"""Redis store URL options, parsed strictly, and the redaction of credentials wherever a URL is shown.

`redis://[user:password@]host:port/db?option=value&...` (also `rediss://`). kvrag's options:

- `socket_timeout` (seconds, default 0.5): the longest one read or write waits on a connected
  server. A frozen server (paused, swapping, blocked by a slow command) costs this once, then the
  store backs off and answers misses without waiting. Raise it for a distant server.
- `connect_timeout` (seconds, default 1.0): the longest a new connection may take.
- `ttl` (seconds, default none): entries expire after this.
- `part_bytes` (default 32 MiB, at most 512 MiB, Redis' largest string): larger entries are split.
- `max_entry_bytes` (default 4 GiB - 1, also the most a manifest can name): larger entries are
  not written, and a stored manifest claiming more is corrupt.
- `quantize` (`none`, `bf16` or `int8`): the precision entries are stored at.

Passed on to redis-py unchanged: `db`, `username`, `password`, `ssl_cert_reqs`, `ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_check_hostname`. Any other option, a repeated option or a
malformed value raises RedisOptionError (a ValueError) naming it, so a typo is never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from .base import StoreError

MAX_MANIFEST_BYTES = (1 << 32) - 1  # a manifest stores lengths as uint32
MAX_PART_BYTES = 512 << 20  # Redis' default proto-max-bulk-len
PASSED_TO_REDIS = ("db", "username", "password", "ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                   "ssl_check_hostname")  # fmt: skip
_SECRET_OPTIONS = ("password",)


class RedisOptionError(StoreError, ValueError):
    """A Redis store URL carries an unknown option or a malformed value."""


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = ("redis", "rediss", *CLUSTER_SCHEMES)  # every URL scheme the Redis store opens


def redact_url(url: str) -> str:
    """The URL with the password (and a bare userinfo, which may be one) and `password=` replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if sep else f"***@{host}"
    items = [_redact_item(item) for item in parts.query.split("&")] if parts.query else []
    return urlunsplit(parts._replace(netloc=netloc, query="&".join(items), fragment=""))


def _redact_item(item: str) -> str:
    name = item.split("=", 1)[0]
    return f"{name}=***" if unquote(name).lower() in _SECRET_OPTIONS else item


def url_secrets(url: str) -> tuple[str, ...]:
    """Every credential in the URL, raw and decoded, so they can be scrubbed from exception texts."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except ValueError:
        return ()
    found = []
    userinfo = parts.netloc.rsplit("@", 1)[0] if "@" in parts.netloc else ""
    found.append(userinfo.partition(":")[2] if ":" in userinfo else userinfo)
    found += [v for k, v in query if k.lower() in _SECRET_OPTIONS]
    found += [unquote(s) for s in found]
    return tuple(sorted({s for s in found if s}, key=len, reverse=True))


def connection_url(url: str) -> str:
    """The URL redis-py gets: kvrag's own options removed, credentials and pass-through options kept."""
    parts = urlsplit(url)
    kept = [item for item in parts.query.split("&") if item and unquote(item.split("=", 1)[0]) in PASSED_TO_REDIS]
    return urlunsplit(parts._replace(query="&".join(kept), fragment=""))


def _number(name: str, raw: Any, integer: bool, upper: float) -> float:
    """A positive, finite number no larger than `upper` (an integer where `integer`), or a clear error."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise RedisOptionError(f"Redis option {name}={raw!r} is not a number") from None
    if not math.isfinite(value) or value <= 0 or value > upper or (integer and not value.is_integer()):
        kind = "a whole number" if integer else "a number"
        raise RedisOptionError(f"Redis option {name}={raw!r} must be {kind} above 0 and at most {upper:g}")
    return int(value) if integer else value


_PARSERS = {
    "socket_timeout": lambda raw: _number("socket_timeout", raw, False, 3600),
    "connect_timeout": lambda raw: _number("connect_timeout", raw, False, 3600),
    "ttl": lambda raw: _number("ttl", raw, True, 10 * 365 * 86400),
    "part_bytes": lambda raw: _number("part_bytes", raw, True, MAX_PART_BYTES),
    "max_entry_bytes": lambda raw: _number("max_entry_bytes", raw, True, MAX_MANIFEST_BYTES),
    "quantize": lambda raw: _quantize(raw),
}


def _quantize(raw: Any) -> str:
    from .format import storage_of

    try:
        return storage_of(raw)
    except ValueError:
        raise RedisOptionError(f"Redis option quantize={raw!r} must be none, bf16 or int8") from None


@dataclass(frozen=True)
class RedisOptions:
    """The store's settings; `url` is the redacted URL, safe to log. Holds no credentials."""

    url: str = "redis://127.0.0.1:6379/0"
    socket_timeout: float = 0.5
    connect_timeout: float = 1.0
    ttl: int | None = None
    part_bytes: int = 32 << 20
    max_entry_bytes: int = MAX_MANIFEST_BYTES
    quantize: bool | str = False  # the storage precision: format.storage_of

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> "RedisOptions":
        """Parse and check the URL's options; keyword overrides (None means unset) win over the URL."""
        shown = redact_url(url)
        try:
            query = parse_qsl(urlsplit(url).query, keep_blank_values=True, strict_parsing=False)
        except ValueError as exc:
            raise RedisOptionError(f"malformed Redis URL {shown}: {exc}") from None
        values: dict[str, Any] = {}
        for name, raw in query:
            if name in PASSED_TO_REDIS:
                continue
            if name not in _PARSERS:
                allowed = ", ".join(sorted(_PARSERS) + list(PASSED_TO_REDIS))
                raise RedisOptionError(f"unknown Redis option {name!r} in {shown}; allowed: {allowed}")
            if name in values:
                raise RedisOptionError(f"Redis option {name!r} given twice in {shown}")
            values[name] = _PARSERS[name](raw)
        for name, raw in overrides.items():
            if raw is not None:
                values[name] = _PARSERS[name](raw)
        return dataclasses.replace(cls(url=shown), **values)
