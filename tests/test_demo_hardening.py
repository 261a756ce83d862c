"""Issue #18, the demo's part: bounded uploads and ingestion, store hosts, loopback serving, plain-text answers.

Everything here runs without the model (fakes and small AppTest scripts), so it is fast."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("streamlit")

from kvrag.demo import app as demo_app  # noqa: E402
from kvrag.demo import ingest, stores  # noqa: E402
from kvrag.demo.launch import launch_env  # noqa: E402
from kvrag.demo.upload import UploadError, validate_upload  # noqa: E402
from kvrag.types import Chunk  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _ByteTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


# -- 1. bounded ingestion --------------------------------------------------------------------------
def test_upload_of_a_run_without_spaces_is_capped_per_chunk(tmp_path):
    from kvrag.demo.upload import save_upload, upload_chunks

    import random

    rng = random.Random(0)
    up = validate_upload("blob.txt", "".join(rng.choice("abcdefgh") for _ in range(50_000)).encode())
    chunks = upload_chunks(save_upload(up, tmp_path), max_tokens=ingest.CHUNK_TOKENS, tokenizer=_ByteTokenizer())
    assert len(chunks) > 100 and all(len(c.text.encode()) <= ingest.CHUNK_TOKENS for c in chunks)


def test_upload_budget_caps_tokens_per_file_and_store_bytes():
    ingest.check_upload_budget(20_000, 0, 46_080)
    with pytest.raises(ingest.BudgetError, match="too long: 20,001 tokens"):
        ingest.check_upload_budget(20_001, 0, 46_080)
    # 1 MB of English is ~360k tokens: refused before anything is chunked or stored
    with pytest.raises(ingest.BudgetError, match="too long"):
        ingest.check_upload_budget(362_000, 0, 46_080)
    with pytest.raises(ingest.BudgetError, match="store is full"):
        ingest.check_upload_budget(10_000, 40_000, 46_080)  # 50k tokens x 46 KB = 2.3 GB


def test_kv_bytes_per_token_of_the_bundled_shape():
    import torch

    cfg = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576, head_dim=64)
    lm = SimpleNamespace(model=SimpleNamespace(config=cfg), dtype=torch.float32)
    assert ingest.kv_bytes_per_token(lm) == 46_080  # the README's 46 KB per token


class _FakeRag:
    """Records how many tokens each precompute call holds the model lock for, and lets a question in between."""

    def __init__(self):
        self.lm = SimpleNamespace(tokenizer=_ByteTokenizer(), lock=threading.RLock())
        self.batches: list[int] = []
        self.answered_between = 0

    def precompute(self, chunks, progress=False):
        with self.lm.lock:
            self.batches.append(sum(len(c.text.encode()) for c in chunks))
        # a question asked now gets the model (the lock is not held between batches)
        got = self.lm.lock.acquire(blocking=False)
        if got:
            self.answered_between += 1
            self.lm.lock.release()
        return SimpleNamespace(computed=len(chunks))


class _Bar:
    def __init__(self):
        self.values = []

    def progress(self, value, text=""):
        self.values.append(value)


def test_precompute_holds_the_model_for_bounded_batches_with_progress():
    rag, bar = _FakeRag(), _Bar()
    chunks = [Chunk(id=str(i), text=chr(65 + i % 26) * 250) for i in range(40)]  # 10k tokens in all
    assert ingest.precompute_with_progress(rag, chunks, bar, max_batch_tokens=1_000) == 40
    assert max(rag.batches) <= 1_000 and sum(rag.batches) == 10_000
    assert rag.answered_between == len(rag.batches) >= 10
    assert bar.values[-1] == 1.0 and bar.values == sorted(bar.values)


def test_a_second_session_does_not_wait_for_the_start_up_ingest(tmp_path, monkeypatch):
    registry = ingest._IngestRegistry()
    monkeypatch.setattr(ingest, "ingest_registry", lambda: registry)
    shown = []
    monkeypatch.setattr(ingest.st, "info", lambda msg: shown.append(msg))
    rag = SimpleNamespace(store=SimpleNamespace(url="memory://"), lm=SimpleNamespace(tokenizer=None))
    registry.lock.acquire()  # another session is ingesting
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (ingest.ensure_ingested(rag, None, tmp_path, ()), done.set()))
        t.start()
        assert done.wait(5), "ensure_ingested blocked behind another session's ingest"
        assert shown and "another session" in shown[0]
    finally:
        registry.lock.release()


# -- 2. store hosts and error text -----------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    ["redis://169.254.169.254:80/0", "redis://10.0.0.5:6379/0", "rediss://192.168.1.1:6379/0",
     "redis://metadata.google.internal:80/0", "tiered://?lower=redis://172.16.0.1:6379/0", "redis://[fe80::1]:6379/0"],
)
def test_store_urls_on_other_hosts_are_refused(url, tmp_path, monkeypatch):
    monkeypatch.delenv(stores.ALLOW_HOSTS_ENV, raising=False)
    with pytest.raises(ValueError, match="only opens stores on this machine"):
        stores.check_store_url(url, tmp_path)


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://127.8.9.1:1/0", "redis://[::1]:6379/0",
                                 "redis://localhost:6379/0", "redis://:pw@LOCALHOST:6379/0"])
def test_loopback_store_hosts_are_allowed(url, tmp_path, monkeypatch):
    monkeypatch.delenv(stores.ALLOW_HOSTS_ENV, raising=False)
    stores.check_store_url(url, tmp_path)


def test_a_host_allowed_at_launch_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv(stores.ALLOW_HOSTS_ENV, "cache.internal, 10.0.0.5")
    stores.check_store_url("redis://cache.internal:6379/0", tmp_path)
    stores.check_store_url("redis://10.0.0.5:6379/0", tmp_path)
    with pytest.raises(ValueError):
        stores.check_store_url("redis://10.0.0.6:6379/0", tmp_path)
    assert launch_env(["cache.internal", "10.0.0.5"], base={})[stores.ALLOW_HOSTS_ENV] == "cache.internal,10.0.0.5"
    assert stores.ALLOW_HOSTS_ENV not in launch_env([], base={})


def test_unknown_schemes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown store URL scheme"):
        stores.check_store_url("nosuch://x", tmp_path)


def test_a_failed_probe_does_not_repeat_what_the_server_said():
    class _Client:
        def ping(self):
            raise RuntimeError("-ERR SSH-2.0-OpenSSH_9.6 banner from the host")

    store = SimpleNamespace(client=_Client(), url="redis://:secret@127.0.0.1:22/0")
    with pytest.raises(stores.StoreUnreachable) as info:
        stores.check_store(store)
    msg = str(info.value)
    assert msg == "could not connect to the store at redis://:***@127.0.0.1:22/0"
    assert "SSH" not in msg and "secret" not in msg


_OPEN_SCRIPT = """
import streamlit as st
from kvrag.demo import app as demo_app

def boom(url):
    raise ConnectionError("Error 111 connecting: SSH-2.0-OpenSSH_9.6 banner")

import kvrag.cache_backends as cb
cb.open_store = boom
demo_app.open_engine.clear()
demo_app.open_or_stop(demo_app.Settings("reuse", 0.1, 3, 8, "redis://:pw@127.0.0.1:22/0"))
"""


def test_the_page_shows_a_generic_error_for_an_unreachable_store():
    import kvrag.cache_backends as cb
    from streamlit.testing.v1 import AppTest

    real = cb.open_store  # the script replaces it in this process: put it back for the tests after this one
    try:
        at = AppTest.from_string(_OPEN_SCRIPT, default_timeout=60).run()
    finally:
        cb.open_store = real
    assert not at.exception, [e.value for e in at.exception]
    errors = [e.value for e in at.error]
    assert errors == ["Cannot use the KV store 'redis://:***@127.0.0.1:22/0': could not open the store at redis://:***@127.0.0.1:22/0"]


# -- 3. loopback serving ---------------------------------------------------------------------------
def test_the_script_config_binds_loopback():
    import tomllib

    config = tomllib.loads((ROOT / "demos" / ".streamlit" / "config.toml").read_text())
    assert config["server"]["address"] == "127.0.0.1"


def test_the_script_refuses_to_serve_every_interface(monkeypatch):
    from streamlit import config
    from streamlit.testing.v1 import AppTest

    monkeypatch.setattr("runpy.run_module", lambda *a, **k: pytest.fail("the demo ran"))
    old = config.get_option("server.address")
    config.set_option("server.address", None)
    try:
        at = AppTest.from_file(str(ROOT / "demos" / "streamlit_app.py"), default_timeout=60).run()
    finally:
        config.set_option("server.address", old)
    assert [e for e in at.error if "every network interface" in e.value]


def test_the_page_warns_when_served_beyond_this_machine():
    from streamlit import config
    from streamlit.testing.v1 import AppTest

    old = config.get_option("server.address")
    for address, warned in (("0.0.0.0", True), ("127.0.0.1", False), ("::1", False)):
        config.set_option("server.address", address)
        try:
            at = AppTest.from_string("from kvrag.demo import app as demo_app\ndemo_app.warn_if_exposed()", default_timeout=60).run()
        finally:
            config.set_option("server.address", old)
        assert bool(at.warning) == warned, address


# -- 4. answers as plain text ----------------------------------------------------------------------
_ANSWER_SCRIPT = """
from kvrag.demo.render import show_answer, stream_answer
stream_answer(iter(["See [the docs](http://evil.example) ", "![x](http://evil.example/t.png) **now**"]))
show_answer("<b>[click](javascript:alert(1))</b>")
"""


def test_answers_are_plain_text_streamed_and_redrawn():
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_string(_ANSWER_SCRIPT, default_timeout=60).run()
    assert not at.exception
    assert [t.value for t in at.text] == [
        "See [the docs](http://evil.example) ![x](http://evil.example/t.png) **now**",
        "<b>[click](javascript:alert(1))</b>",
    ]
    assert not at.markdown


def test_the_app_streams_and_redraws_answers_as_plain_text():
    source = (ROOT / "kvrag" / "demo" / "app.py").read_text()
    assert "write_stream" not in source and "st.markdown(side.text" not in source


# -- 5. binary uploads -----------------------------------------------------------------------------
def test_uploads_with_many_control_characters_are_refused():
    with pytest.raises(UploadError, match="binary"):
        validate_upload("prog.txt", b"ELF" + bytes(range(1, 9)) * 200)
    assert validate_upload("ok.txt", "tab\there\r\nform\x0cfeed".encode()).text
