"""Where the demo keeps its data and which KV stores the page may open.

The store URL is typed by whoever opens the page, so: disk stores must live inside the demo
folder or be the store `kvrag ingest` fills (the default), only known schemes are accepted, and a networked store (Redis) must be on a loopback host
unless the person who launched the demo allowed its host (`KVRAG_DEMO_ALLOW_HOSTS=host1,host2`, or
`kvrag.demo.launch.launch(allow_store_hosts=[...])`). A failed probe says only that the store could
not be reached: nothing the server at that address answered is shown.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from urllib.parse import parse_qs, urlparse, urlunparse

from kvrag.defaults import kvrag_home

DEMO_DIR_ENV = "KVRAG_DEMO_DIR"
ALLOW_HOSTS_ENV = "KVRAG_DEMO_ALLOW_HOSTS"
STORE_SCHEMES = ("disk", "memory", "redis", "rediss", "tiered")
NETWORK_SCHEMES = ("redis", "rediss")


class StoreUnreachable(Exception):
    """The store could not be reached; the message carries no detail from the server."""


def data_dir() -> Path:
    """Where the demo keeps its index, KV store and uploads: $KVRAG_DEMO_DIR or $KVRAG_HOME/demo."""
    raw = os.environ.get(DEMO_DIR_ENV)
    return (Path(raw).expanduser() if raw else kvrag_home() / "demo").resolve()


def shared_store_root() -> Path:
    """The store `kvrag ingest` and `kvrag quickstart` fill ($KVRAG_HOME/kv)."""
    return (kvrag_home() / "kv").resolve()


def default_store_url(folder: Path) -> str:
    """The disk store `kvrag ingest` and the quickstart fill, at the precision they write: the demo answers
    from the KV they computed rather than computing a copy of its own (`folder` keeps the uploads)."""
    from kvrag.cache_backends import default_disk_url

    return default_disk_url(shared_store_root())


def redact_url(url: str) -> str:
    """The URL with any password replaced, for showing on the page."""
    try:
        parsed = urlparse(url)
        if parsed.password:
            netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@", 1)
            return urlunparse(parsed._replace(netloc=netloc))
    except ValueError:
        pass
    return url


def allowed_hosts() -> set[str]:
    """Hosts beyond loopback that the launcher allowed for networked stores (lower-cased)."""
    raw = os.environ.get(ALLOW_HOSTS_ENV, "")
    return {h.strip().strip("[]").lower() for h in raw.split(",") if h.strip()}


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or `localhost` (names are not resolved: a name that resolves elsewhere is not loopback)."""
    host = host.strip().strip("[]").lower()
    if host in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_store_url(url: str, folder: Path) -> None:
    """Raise ValueError for a store the page must not open.

    A disk store must be inside the demo folder; Redis must be on a loopback host or one allowed at
    launch ($KVRAG_DEMO_ALLOW_HOSTS); a tiered store is checked through its lower tier.
    """
    try:
        parsed = urlparse(url)
        host = parsed.hostname
    except ValueError:
        raise ValueError("the store URL could not be parsed") from None
    scheme = parsed.scheme.lower()
    if scheme not in STORE_SCHEMES:
        raise ValueError(f"unknown store URL scheme {scheme!r}; use one of {', '.join(s + '://' for s in STORE_SCHEMES)}")
    if scheme == "disk":
        path = Path(parsed.netloc + parsed.path).expanduser().resolve()
        if not (path.is_relative_to(folder.resolve()) or path.is_relative_to(shared_store_root())):
            raise ValueError(f"a disk store must be inside the demo folder {folder} (set {DEMO_DIR_ENV} to move it) "
                             f"or be the store kvrag ingest fills ({shared_store_root()})")
    elif scheme in NETWORK_SCHEMES:
        host = (host or "").lower()
        if not host:
            raise ValueError("a Redis store URL needs a host")
        if not (is_loopback_host(host) or host in allowed_hosts()):
            raise ValueError(
                "the demo only opens stores on this machine (127.0.0.1, ::1, localhost); "
                f"to use another host, start the demo with {ALLOW_HOSTS_ENV}=HOST"
            )
    elif scheme == "tiered":
        lower = parse_qs(parsed.query).get("lower", [""])[0]
        if lower:
            check_store_url(lower, folder)


def check_store(store: object) -> None:
    """Raise StoreUnreachable now if a networked store (Redis, or under a tiered one) does not answer.

    The engine treats a down Redis as a cache miss by design, which would hide a mistyped URL. The
    message names the (redacted) URL only: what answered there, if anything, is not repeated.
    """
    for s in (store, getattr(store, "lower", None)):
        client = getattr(s, "client", None)
        if client is None or not hasattr(client, "ping"):
            continue
        try:
            client.ping()
        except Exception:
            raise StoreUnreachable(f"could not connect to the store at {redact_url(str(getattr(s, 'url', '?')))}") from None
