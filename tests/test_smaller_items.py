"""The smaller findings of a hostile probe of two replicas, each a reproduction that failed before its fix.

- `kvrag store gc --unverified` under key B deleted key A's genuine entries (`store sign` guarded them).
- Keys that can never match were accepted: a non-ASCII key (the header is read as latin-1), and
  `KVRAG_API_KEYS=" , "` meant no authentication at all.
- `kvrag serve --host 0.0.0.0` without a key only warned.
- A lone surrogate in a message came back as the tokenizer's internal error text.
- `kvrag.top_k` was uncapped (tests/test_retrieval_degrades.py).
- `kvrag demo` left its Streamlit child running (holding the port) when it got SIGTERM.
- A raw report under docs/ named an issue number.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrag.cache_backends import KEY_ENV, DiskStore
from kvrag.cache_backends.admin import gc, open_admin
from kvrag.cli.app import main
from test_backends import entry, free_port, running_redis
from kvrag.cache_backends import content_key

ROOT = Path(__file__).resolve().parent.parent
MINE, THEIRS = "replica A's key", "replica B's key"
OURS, FOREIGN, BARE = content_key("ours"), content_key("foreign"), content_key("bare")


# -- gc --unverified keeps another key's genuine data -------------------------------------------------
@pytest.fixture(scope="module")
def redis_url():
    with running_redis() as server:
        yield server.url


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_gc_unverified_keeps_another_keys_entries_unless_include_foreign(kind, tmp_path, monkeypatch, request):
    from kvrag.cache_backends.redis_store import RedisStore

    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        opener = lambda key: RedisStore(url, key=key)  # noqa: E731
        opener("").client.flushdb()
    else:
        url = f"disk://{tmp_path}"
        opener = lambda key: DiskStore(tmp_path, key=key)  # noqa: E731
    monkeypatch.delenv(KEY_ENV, raising=False)
    opener(MINE).put(OURS, entry(seed=1))
    opener(THEIRS).put(FOREIGN, entry(seed=2))  # another replica's genuine data, under its own key
    opener(THEIRS).link(["ns/theirs"], [FOREIGN])
    opener("").put(BARE, entry(seed=3))  # written without a key
    monkeypatch.setenv(KEY_ENV, MINE)
    plan = gc(open_admin(url), unverified=True)
    assert [b["key"] for b in plan["bad_entries"]] == [BARE]
    assert [b["key"] for b in plan["unverified_kept"]] == [FOREIGN] and plan["unverified_links_kept"]
    assert opener(THEIRS).get(FOREIGN) is not None and opener(THEIRS).resolve(["ns/theirs"]) == [FOREIGN]
    assert opener("").get(BARE) is None and opener(MINE).get(OURS) is not None
    assert main(["store", "gc", "--include-foreign", "--store", url]) == 2  # it widens --unverified: both or neither
    assert main(["store", "gc", "--unverified", "--include-foreign", "--store", url]) == 0
    assert not opener(THEIRS).contains(FOREIGN) and opener(THEIRS).resolve(["ns/theirs"]) == [None]
    assert opener(MINE).get(OURS) is not None


# -- keys that can never match, and an open non-loopback bind --------------------------------------------
def _serve_settings(*argv: str, env: dict[str, str] | None = None, monkeypatch=None):
    from kvrag.cli.app import _parser
    from kvrag.cli.serve import settings_from_args

    for name in ("KVRAG_API_KEYS", "KVRAG_READ_KEYS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    return settings_from_args(_parser().parse_args(["serve", *argv]))


def test_keys_that_can_never_match_are_refused_at_start(monkeypatch):
    from kvrag.server import ServerSettings

    for bad in ("sk-clé-secrète", "sk-\u2603", "sk-\x7f"):
        with pytest.raises(ValueError, match="ASCII"):
            ServerSettings(api_keys=(bad,))
        with pytest.raises(ValueError, match="ASCII"):
            _serve_settings("--read-key", bad, monkeypatch=monkeypatch)
    for blank in (" , ", ",", " ,, "):
        with pytest.raises(ValueError, match="holds no key"):
            _serve_settings(env={"KVRAG_API_KEYS": blank}, monkeypatch=monkeypatch)
        with pytest.raises(ValueError, match="holds no key"):
            _serve_settings(env={"KVRAG_READ_KEYS": blank}, monkeypatch=monkeypatch)
    assert not _serve_settings(env={"KVRAG_API_KEYS": ""}, monkeypatch=monkeypatch).authenticated  # unset in effect
    assert _serve_settings(env={"KVRAG_API_KEYS": " a, ,b "}, monkeypatch=monkeypatch).api_keys == ("a", "b")


def test_kvrag_serve_refuses_an_open_non_loopback_bind(monkeypatch, capsys):
    from kvrag.server import ServerSettings

    with pytest.raises(ValueError, match="--allow-no-auth"):
        ServerSettings(host="0.0.0.0")
    assert main(["serve", "--host", "0.0.0.0", "--port", "9"]) == 2  # refused before any model loads
    assert "--allow-no-auth" in capsys.readouterr().err
    assert _serve_settings("--host", "0.0.0.0", "--allow-no-auth", monkeypatch=monkeypatch).allow_no_auth
    assert _serve_settings("--host", "0.0.0.0", env={"KVRAG_READ_KEYS": "k"}, monkeypatch=monkeypatch).authenticated
    assert _serve_settings("--host", "127.0.0.2", monkeypatch=monkeypatch).host == "127.0.0.2"  # loopback needs no key


# -- a clear 400 for text no tokenizer encodes ---------------------------------------------------------
@pytest.fixture(scope="module")
def live():
    from kvrag.server import create_app
    from test_server import SETTINGS, LiveServer, tiny_rag

    with LiveServer(create_app(tiny_rag(), SETTINGS)) as server:
        yield server


def _raw_chat(live, body: dict):
    import httpx

    return httpx.post(live.url + "/v1/chat/completions", content=json.dumps(body).encode(),  # json.dumps keeps "\ud800" escaped
                      headers={"content-type": "application/json"}, timeout=60, trust_env=False)


@pytest.mark.parametrize("where", ["content", "part", "stop"])
def test_a_lone_surrogate_is_a_400_that_says_so(live, where):
    ask = {"model": "kvrag", "max_tokens": 2, "messages": [{"role": "user", "content": "When did it open? \ud800"}]}
    if where == "part":
        ask["messages"][0]["content"] = [{"type": "text", "text": "x\udfff"}]
    elif where == "stop":
        ask = {**ask, "messages": [{"role": "user", "content": "Hi"}], "stop": ["\ud800"]}
    r = _raw_chat(live, ask)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
    message = r.json()["error"]["message"]
    assert "lone surrogate" in message and "TextEncodeInput" not in message


# -- kvrag demo stops its Streamlit child on SIGTERM ---------------------------------------------------
def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_kvrag_demo_ends_its_streamlit_child_when_it_is_stopped(sig, tmp_path):
    pytest.importorskip("streamlit")
    port = free_port()
    env = {**os.environ, "KVRAG_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "demo", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the demo did not start"
            time.sleep(0.5)
        proc.send_signal(sig)  # to `kvrag demo` alone, as a service manager stops it
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _listening(port) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not _listening(port), "the Streamlit child still holds the port"
    finally:
        if proc.poll() is None:
            proc.kill()
        if _group_alive(proc.pid):  # the child the old `kvrag demo` left behind
            os.killpg(proc.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False


# -- no raw report under docs/ names an issue number ---------------------------------------------------
def test_no_report_under_docs_names_an_issue():
    from test_docs import HISTORY

    hits = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in sorted((ROOT / "docs").rglob("*.md"))
            for m in HISTORY.finditer(p.read_text(encoding="utf-8"))]
    assert not hits, "history belongs in CHANGELOG.md:\n" + "\n".join(hits)
