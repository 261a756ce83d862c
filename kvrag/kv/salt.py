"""Cache salts: what keys a cache entry to one caller's scope (a tenant of a shared server: kvrag.server.tenants).

A salt is hashed before any cache keys with it, so neither a store's keys nor a cache's counters hold it."""

from __future__ import annotations

import hashlib


def salt_digest(salt: str) -> str:
    """A cache salt as the caches key with it (any text, lone surrogates too)."""
    return hashlib.sha256(b"kvrag-cache-salt\0" + salt.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def salt_context(salt: str) -> str:
    """What a salted chunk entry's key holds beside its tokens ("" for no salt: the plain key)."""
    return f"cache_salt={salt_digest(salt)}" if salt else ""
