"""API keys (issue #52): `Authorization: Bearer` on every route but /health, read keys and write keys,
401/403 as OpenAI-shaped errors the openai client understands, keys never shown. Real HTTP (uvicorn
on a loopback port) around a tiny engine."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kvrag.cli.app import _parser as build_parser  # noqa: E402
from kvrag.cli.serve import settings_from_args  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402
from kvrag.server.auth import READ, WRITE, KeyRing, needed_right  # noqa: E402
from kvrag.server.runner import startup_notes  # noqa: E402
from test_server import SETTINGS, LiveServer, chat, chunk_json, tiny_rag  # noqa: E402
from tiny import THREE_CHUNKS  # noqa: E402

WRITE_KEY, READ_KEY = "sk-write-0123456789", "sk-read-9876543210"
KEYED = ServerSettings(**{**SETTINGS.__dict__, "api_keys": (WRITE_KEY,), "read_keys": (READ_KEY,)})


@pytest.fixture(scope="module")
def live():
    with LiveServer(create_app(tiny_rag(), KEYED)) as server:
        yield server


def _as(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key is not None else {}


def _call(live, method: str, path: str, key: str | None, **kw):
    with httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        return http.request(method, path, headers={**_as(key), **kw.pop("headers", {})}, **kw)


ROUTES = [("POST", "/v1/chat/completions", {"json": chat()}), ("GET", "/v1/models", {}), ("GET", "/metrics", {}),
          ("POST", "/v1/chunks", {"json": {"chunks": chunk_json(THREE_CHUNKS[:1])}}), ("DELETE", "/v1/chunks/a", {})]


@pytest.mark.parametrize("method,path,kw", ROUTES)
def test_no_key_or_an_unknown_one_is_a_401_on_every_route_but_health(live, method, path, kw):
    for key, code in ((None, "missing_api_key"), ("sk-nope", "invalid_api_key")):
        r = _call(live, method, path, key, **kw)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and "sk-nope" not in r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
    basic = _call(live, method, path, None, headers={"Authorization": f"Basic {WRITE_KEY}"}, **kw)
    assert basic.status_code == 401  # only the Bearer scheme carries a key


def test_health_needs_no_key_and_says_keys_are_on(live):
    r = _call(live, "GET", "/health", None)
    assert r.status_code == 200 and r.json()["auth"] is True and WRITE_KEY not in r.text and READ_KEY not in r.text


def test_a_read_key_chats_but_never_writes(live):
    assert _call(live, "POST", "/v1/chat/completions", READ_KEY, json=chat(kvrag={"chunks": chunk_json(THREE_CHUNKS)})).status_code == 200
    assert _call(live, "GET", "/v1/models", READ_KEY).status_code == 200
    assert _call(live, "GET", "/metrics", READ_KEY).status_code == 200
    for method, path, kw in ROUTES[3:]:
        r = _call(live, method, path, READ_KEY, **kw)
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "insufficient_permissions" and r.json()["error"]["type"] == "permission_error"
        assert READ_KEY not in r.text


def test_a_write_key_ingests_deletes_and_chats(live):
    r = _call(live, "POST", "/v1/chunks", WRITE_KEY, json={"chunks": chunk_json(THREE_CHUNKS)})
    assert r.status_code == 200, r.text
    assert _call(live, "POST", "/v1/chat/completions", WRITE_KEY, json=chat(kvrag={"chunk_ids": ["a", "b"]})).status_code == 200
    assert _call(live, "DELETE", "/v1/chunks/c", WRITE_KEY).json()["deleted"] is True
    assert _call(live, "POST", "/v1/chunks", "bearer-scheme-case", headers={"Authorization": f"bEaReR {WRITE_KEY}"},
                 json={"chunks": chunk_json(THREE_CHUNKS[2:])}).status_code == 200


def test_the_openai_client_sees_401_and_403_as_its_own_errors(live):
    openai = pytest.importorskip("openai")

    def client(key: str) -> "openai.OpenAI":
        return openai.OpenAI(base_url=live.url + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(trust_env=False))

    with pytest.raises(openai.AuthenticationError):
        client("sk-wrong").chat.completions.create(model="kvrag", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    reply = client(READ_KEY).chat.completions.create(model="kvrag", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                                     extra_body={"kvrag": {"retrieve": False}})
    assert reply.choices[0].message.content is not None
    with pytest.raises(openai.PermissionDeniedError):
        client(READ_KEY).post("/chunks", body={"chunks": chunk_json(THREE_CHUNKS[:1])}, cast_to=object)
    assert [m.id for m in client(WRITE_KEY).models.list()]


def test_keys_never_show_in_settings_logs_or_startup_notes(live, caplog):
    caplog.set_level(logging.DEBUG)
    _call(live, "POST", "/v1/chunks", READ_KEY, json={"chunks": chunk_json(THREE_CHUNKS[:1])})
    _call(live, "GET", "/v1/models", "sk-" + "x" * 40)
    shown = repr(KEYED) + str(KEYED) + caplog.text + " ".join(startup_notes(KEYED))
    assert WRITE_KEY not in shown and READ_KEY not in shown and "xxxxxxxx" not in caplog.text
    assert startup_notes(KEYED) == ["API keys: 1 read+write, 1 read-only; every route but /health needs "
                                    "`Authorization: Bearer <key>`"]


def test_binding_another_interface_without_a_key_warns_what_anyone_can_do():
    [note] = startup_notes(ServerSettings(host="0.0.0.0", allow_no_auth=True))  # refused without --allow-no-auth
    assert "NO API key" in note and "anyone" in note and "delete" in note and "--api-key" in note
    assert startup_notes(ServerSettings()) == []  # loopback, no keys: nothing to say
    assert "NO API key" not in " ".join(startup_notes(ServerSettings(host="0.0.0.0", read_keys=("k",))))


def test_key_ring_rights_and_routes():
    ring = KeyRing(["w"], ["r", "w"])  # a key given as both is a write key
    assert ring.right_of("w") == WRITE and ring.right_of("r") == READ and ring.right_of("x") is None
    assert ring.right_of("") is None and not KeyRing().enabled
    assert needed_right("GET", "/health") is None and needed_right("POST", "/v1/chunks") == WRITE
    assert needed_right("DELETE", "/v1/chunks/a/b") == WRITE and needed_right("POST", "/v1/chunksx") == READ
    assert needed_right("POST", "/v1/chat/completions") == READ and needed_right("GET", "/nowhere") == READ


def test_serve_options_and_environment(monkeypatch):
    monkeypatch.setenv("KVRAG_API_KEYS", " env-w1, ,env-w2 ")
    monkeypatch.setenv("KVRAG_READ_KEYS", "env-r")
    monkeypatch.setenv("KVRAG_INDEX", "chroma://10.0.0.5:8000/docs")  # read when the parser is built, as $KVRAG_STORE
    parse = build_parser().parse_args
    s = settings_from_args(parse(["serve"]))
    assert s.api_keys == ("env-w1", "env-w2") and s.read_keys == ("env-r",) and s.index == "chroma://10.0.0.5:8000/docs"
    s = settings_from_args(parse(["serve", "--api-key", "a", "--api-key", "b", "--read-key", "c", "--index", "chroma://h:1/x_y"]))
    assert s.api_keys == ("a", "b") and s.read_keys == ("c",) and s.index == "chroma://h:1/x_y" and s.authenticated
    with pytest.raises(ValueError, match="API key"):
        ServerSettings(api_keys=("two words",))
