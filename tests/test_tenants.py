"""Several tenants on one server: the caches never tell one tenant what another sent.

A hostile probe had a victim with the write key send an inline chunk holding a secret; a client with the
read key sent guesses, and `kvrag_stats.prefix_hit_tokens` rose with every right token (the exact prefix
cache matched the victim's cached prompt), while the inline chunk's KV was a cache hit for the right text.
Now each API key is a tenant (kvrag.server.tenants): its prefix cache entries, inline chunks' KV and
system prefixes are its own; a `cache_salt` (top-level, as vLLM's, or in `kvrag`) narrows a scope further;
the ingested corpus stays shared. The oracle runs against a real `kvrag serve` on the bundled model.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag import Chunk  # noqa: E402
from kvrag.kv.registry import request_scoped_chunks  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from conftest import SHORT_CONTEXT_ENV  # noqa: E402
from test_backends import free_port  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, tiny_rag  # noqa: E402
from tiny import THREE_CHUNKS, THREE_Q  # noqa: E402

WRITE_KEY, READ_KEY, OTHER_KEY = "sk-tenant-victim-0123", "sk-tenant-reader-4567", "sk-tenant-other-8901"
SECRET = "Layoff list: Dana Okafor, salary 91400."
# each guess departs from the other guesses right after "Layoff list: ", so the attacker's own earlier guesses
# shorten each later guess by the same tokens: any difference between the right guess and a wrong one is a leak
GUESSES = {"wrong-first": "Layoff list: Mia Ruiz, salary 10200.", "right": SECRET, "wrong-after": "Layoff list: Tom Baker, salary 55100."}
QUESTION = "Who is on the list?"


def _inline(text: str, method: str | None = None, **extra) -> dict:
    ctx = {"chunks": [{"id": "memo", "text": text}], **({"method": method} if method else {})}
    return {"model": "kvrag", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "kvrag": ctx, **extra}


class Serve:
    """A real `kvrag serve` process on the bundled model, with a write key and two read keys."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KVRAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False",
               "KVRAG_API_KEYS": WRITE_KEY, "KVRAG_READ_KEYS": f"{READ_KEY},{OTHER_KEY}",
               **{n: "0" for n in SHORT_CONTEXT_ENV}}  # chunks answered from their cached KV, short as they are
        cmd = [sys.executable, "-m", "kvrag.cli", "serve", "--port", str(self.port), "--no-retrieval", "--max-new-tokens", "1"]
        self.log = home / "serve.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log.open("wb"))

    def wait(self, seconds: float = 300) -> "Serve":
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvrag serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"kvrag serve did not come up in {seconds} s")

    def stats(self, key: str, body: dict) -> dict:
        r = httpx.post(self.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300, trust_env=False)
        assert r.status_code == 200, r.text
        return r.json()["kvrag_stats"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = Serve(tmp_path_factory.mktemp("tenants")).wait()
    try:
        yield server
    finally:
        server.stop()


def _probe(served: Serve, key: str, method: str | None, **extra) -> dict[str, tuple[int, int, int]]:
    """(prefix_hit_tokens, cache_hits, cache_misses) of each guess, sent in order."""
    out = {}
    for name, text in GUESSES.items():
        s = served.stats(key, _inline(text, method, **extra))
        out[name] = (s["prefix_hit_tokens"], s["cache_hits"], s["cache_misses"])
    return out


@pytest.mark.parametrize("method", ["full", None], ids=["full-attention", "default-method"])
def test_another_keys_guesses_learn_nothing_from_the_victims_inline_secret(served, method):
    """Full Attention: the exact prefix cache may stop anywhere (the leak token by token); the default method:
    the inline chunk's KV (a cache hit for the right text) and the whole-prompt prefix entry."""
    served.stats(WRITE_KEY, _inline(SECRET, method))
    again = served.stats(WRITE_KEY, _inline(SECRET, method))  # the victim's own cache serves it
    assert again["prefix_hit_tokens"] > 0 if method == "full" else again["cache_hits"] == 1
    guesses = _probe(served, READ_KEY, method)
    fresh = _probe(served, READ_KEY, method, cache_salt=f"fresh-{uuid.uuid4().hex}")  # the same sequence on a fresh cache
    assert guesses == fresh, (guesses, fresh)
    assert guesses["right"] == guesses["wrong-after"], guesses
    assert guesses["wrong-first"][0] == 0 and guesses["right"][1] == 0  # nothing of the victim's: no hit, no stored KV


def test_kvrag_serve_warms_up_before_it_listens(served):
    """A fresh server's first request took about 10x the later ones: it now answers once before it binds."""
    log = served.log.read_text()
    assert "warmed up in" in log and log.index("warmed up in") < log.index("kvrag serve: http://"), log


def test_a_key_id_is_not_the_key_and_agrees_across_rings():
    from kvrag.server.auth import KeyRing, key_id

    ring = KeyRing([WRITE_KEY], [READ_KEY])
    right, ident = ring.identify(WRITE_KEY)
    assert right == "write" and ident == key_id(WRITE_KEY) == KeyRing([WRITE_KEY]).identify(WRITE_KEY)[1]
    assert WRITE_KEY not in ident and ident != ring.identify(READ_KEY)[1] and ring.identify("nope") == (None, None)


# -- in-process: a tiny engine behind real HTTP ---------------------------------------------------------
def _post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60, trust_env=False)


def _full(text: str, **extra) -> dict:
    return chat(kvrag={"chunks": [{"id": "memo", "text": text}], "method": "full"}, **extra)


def test_without_keys_one_tenant_as_before_unless_a_cache_salt_is_sent():
    with LiveServer(create_app(tiny_rag(), SETTINGS)) as live:
        text = THREE_CHUNKS[0].text
        first = _post(live.url, _full(text)).json()["kvrag_stats"]
        again = _post(live.url, _full(text)).json()["kvrag_stats"]
        assert first["prefix_hit_tokens"] == 0 and again["prefix_hit_tokens"] > 0  # one tenant: its own cache, as before
        salted = _post(live.url, _full(text, cache_salt="alice")).json()["kvrag_stats"]
        assert salted["prefix_hit_tokens"] == 0  # another scope
        in_kvrag = _post(live.url, chat(kvrag={"chunks": [{"id": "memo", "text": text}], "method": "full", "cache_salt": "alice"}))
        assert in_kvrag.json()["kvrag_stats"]["prefix_hit_tokens"] > 0  # the same salt, given in kvrag
        clash = _post(live.url, chat(cache_salt="a", kvrag={"chunks": [{"id": "memo", "text": text}], "cache_salt": "b"}))
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "cache_salt"
        assert _post(live.url, _full(text, cache_salt="")).status_code == 400  # vLLM's rule: a salt is never empty


def test_keys_are_tenants_unless_the_cache_is_shared_and_the_corpus_always_is():
    keyed = dict(SETTINGS.__dict__, api_keys=(WRITE_KEY,), read_keys=(READ_KEY,))
    text = THREE_CHUNKS[1].text
    for share, crossed in ((False, 0), (True, None)):
        rag = tiny_rag()
        with LiveServer(create_app(rag, ServerSettings(**{**keyed, "share_prefix_cache": share}))) as live:
            _post(live.url, _full(text), WRITE_KEY)
            other = _post(live.url, _full(text), READ_KEY).json()["kvrag_stats"]["prefix_hit_tokens"]
            assert other == crossed if crossed is not None else other > 0
            # the ingested corpus's chunk KV is shared by every key: ingested with the write key, a hit for the reader
            assert httpx.post(live.url + "/v1/chunks", json={"chunks": [{"id": c.id, "text": c.text} for c in THREE_CHUNKS]},
                              headers={"Authorization": f"Bearer {WRITE_KEY}"}, timeout=60, trust_env=False).status_code == 200
            by_id = _post(live.url, chat(kvrag={"chunk_ids": ["a", "b"], "method": "a3"}), READ_KEY).json()["kvrag_stats"]
            assert by_id["cache_hits"] == 2 and by_id["cache_misses"] == 0


def test_inline_chunks_kv_is_keyed_by_salt_and_the_corpus_by_content(tmp_path):
    rag = tiny_rag()
    chunk = Chunk("x", THREE_CHUNKS[2].text)

    def hits(salt: str, corpus: bool = False) -> int:
        with request_scoped_chunks(salt, corpus=corpus):
            return rag.answer(THREE_Q, chunks=[chunk], method="a3", max_new_tokens=1, prefix_cache=False).stats.cache_hits

    assert hits("alice") == 0 and hits("alice") == 1  # computed once, then its own
    assert hits("bob") == 0  # another tenant computes its own
    assert hits("") == 0 and hits("bob", corpus=True) == 1  # the unsalted entry is the corpus's, whoever reads it
    # the engine's own option: the exact prefix cache under a salt
    a = rag.chat([("user", THREE_Q)], chunks=[chunk], method="full", max_new_tokens=1, cache_salt="alice").stats
    b = rag.chat([("user", THREE_Q)], chunks=[chunk], method="full", max_new_tokens=1, cache_salt="bob").stats
    c = rag.chat([("user", THREE_Q)], chunks=[chunk], method="full", max_new_tokens=1, cache_salt="alice").stats
    assert a.prefix_hit_tokens == 0 and b.prefix_hit_tokens == 0 and c.prefix_hit_tokens > 0
