"""The Streamlit demo: upload checks and highlighting as plain functions, then the real app in AppTest."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("streamlit")

from kvrag.demo import app as demo_app  # noqa: E402
from kvrag.demo.launch import app_path, streamlit_command  # noqa: E402
from kvrag.demo.upload import (  # noqa: E402
    MAX_UPLOAD_BYTES,
    UploadError,
    load_uploads,
    save_upload,
    upload_chunks,
    validate_upload,
)

APP = str(Path(demo_app.__file__))
APP_TIMEOUT = 180


# -- uploads --------------------------------------------------------------------------------------
def test_valid_upload_is_decoded_and_hashed():
    data = "# Notes\nThe Quern Bridge opened in 1911.\n".encode()
    up = validate_upload("My Notes.MD", data)
    assert up.text.startswith("# Notes") and up.suffix == ".md"
    assert up.digest == hashlib.sha256(data).hexdigest()
    assert up.file_name == f"{up.digest}.md"


def test_utf8_bom_is_accepted():
    assert validate_upload("a.txt", "\ufeffhello".encode("utf-8")).text == "hello"


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("big.txt", b"a" * (MAX_UPLOAD_BYTES + 1), "too big"),
        ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "not UTF-8"),
        ("empty.md", b"  \n\t\n", "empty"),
        ("nul.txt", b"abc\x00def", "binary"),
        ("script.py", b"print('hi')", ".txt and .md"),
        ("page.html", b"<b>x</b>", ".txt and .md"),
    ],
)
def test_bad_uploads_are_refused_with_a_clear_message(name, data, message):
    with pytest.raises(UploadError, match=message):
        validate_upload(name, data)


def test_size_is_checked_before_decoding():
    # Not UTF-8 *and* too big: the size error comes first, without decoding a huge payload.
    with pytest.raises(UploadError, match="too big"):
        validate_upload("x.txt", b"\xff" * 11, max_bytes=10)


def test_saved_upload_is_inside_the_folder_and_named_by_hash(tmp_path):
    folder = tmp_path / "uploads"
    data = b"The Quern Bridge opened in 1911."
    up = validate_upload("../../../etc/evil name.txt", data)
    path = save_upload(up, folder)
    assert path.parent == folder.resolve()
    assert path.name == hashlib.sha256(data).hexdigest() + ".txt"
    assert path.read_text(encoding="utf-8") == data.decode()
    assert save_upload(up, folder) == path  # idempotent
    assert [p.name for p in folder.iterdir()] == [path.name]  # no temp files left behind


def test_upload_chunks_have_stable_ids_and_no_hash_titles(tmp_path):
    up = validate_upload("n.md", b"Intro line about bridges.\n\n# Quern Bridge\nIt opened in 1911.\n")
    path = save_upload(up, tmp_path)
    chunks = upload_chunks(path)
    assert [c.title for c in chunks] == ["", "Quern Bridge"]
    assert all(up.digest not in c.title for c in chunks)
    assert [c.id for c in load_uploads(tmp_path)] == [c.id for c in chunks]
    assert load_uploads(tmp_path / "missing") == []


# -- page helpers ---------------------------------------------------------------------------------
class _CharTokenizer:
    """One token per UTF-8 byte, decoded like a byte-level BPE: a split character decodes to U+FFFD."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def test_token_pieces_keep_multibyte_characters_whole():
    ids = list("a\u00e9<".encode())  # 'é' is two byte tokens
    assert demo_app.token_pieces(_CharTokenizer(), ids) == [(0, 1, "a"), (1, 3, "\u00e9"), (3, 4, "<")]


def test_highlight_escapes_text_and_marks_selected_positions():
    text = "<script>alert(1)</script> ok"
    pieces = demo_app.token_pieces(_CharTokenizer(), list(text.encode()))
    out = demo_app.highlight_html(pieces, start=100, selected={100, 101}, kept=None)
    body = out[out.index(">") + 1 : -len("</div>")]
    assert body == "<mark>&lt;s</mark>cript&gt;alert(1)&lt;/script&gt; ok"


def test_highlight_strikes_tokens_a_sparse_method_dropped():
    pieces = [(0, 1, "a"), (1, 2, "b"), (2, 3, "c")]
    out = demo_app.highlight_html(pieces, start=10, selected={10}, kept={10, 11})
    assert "<mark>a</mark>b<s" in out and ">c</s>" in out


def test_redact_and_labels():
    assert demo_app.redact_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert demo_app.redact_url("disk:///tmp/kv") == "disk:///tmp/kv"
    assert demo_app.plain_label("**bold** [x](javascript:y) <img>") == "bold x (javascript:y) img"
    assert "full" not in demo_app.method_names() and "reuse" in demo_app.method_names()


def test_store_url_must_keep_disk_stores_inside_the_demo_folder(tmp_path):
    folder = tmp_path / "demo"
    for ok in (f"disk://{folder}/kv", f"disk://{folder}/kv?max_bytes=1000", "memory://", "redis://127.0.0.1:6379/0",
               f"tiered://?lower=disk://{folder}/kv"):
        demo_app.check_store_url(ok, folder)
    for bad in ("disk:///etc/kv", f"disk://{folder}/../elsewhere", "tiered://?lower=disk:///tmp/x"):
        with pytest.raises(ValueError, match="inside the demo folder"):
            demo_app.check_store_url(bad, folder)


def test_launch_command():
    cmd = streamlit_command(port=8765)
    assert cmd[1:5] == ["-m", "streamlit", "run", str(app_path())]
    assert Path(cmd[4]).is_file()
    for flag, value in [
        ("--server.address", "127.0.0.1"),
        ("--server.port", "8765"),
        ("--server.headless", "true"),
        ("--browser.gatherUsageStats", "false"),
    ]:
        assert cmd[cmd.index(flag) + 1] == value
    with pytest.raises(ValueError):
        streamlit_command(port=0)


# -- the app itself -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(kvrag_home, tmp_path_factory):
    """The app after its first run (model loaded, sample corpus ingested into $KVRAG_HOME/demo)."""
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=APP_TIMEOUT)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _errors(at) -> list[str]:
    return [e.value for e in at.error]


@pytest.mark.smollm
def test_app_starts_with_the_sample_corpus(app, kvrag_home):
    assert not _errors(app)
    assert app.text_input(key="question").value  # prefilled with a sample question
    assert (kvrag_home / "demo" / "chroma").is_dir() and (kvrag_home / "demo" / "kv").is_dir()
    assert any("disk://" in c.value and "demo" in c.value for c in app.sidebar.code)


@pytest.mark.smollm
def test_the_method_defaults_to_the_engines_default(app):
    from kvrag.options import DEFAULT_METHOD

    assert app.selectbox(key="method").value == DEFAULT_METHOD  # the base weights' default: no tuned adapter by default


@pytest.mark.smollm
def test_ask_streams_both_answers_with_ttft_and_speedup(app):
    app.selectbox(key="method").set_value("cacheblend")  # a method that recomputes: its tokens are highlighted
    app.text_input(key="question").set_value("In what year did the Brannoch Line open?")
    app.button(key="ask").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert not _errors(app)
    metrics = {m.label: m.value for m in app.metric}
    ttfts = [m.value for m in app.metric if m.label == "Time to first token"]
    assert len(ttfts) == 2 and all(v.endswith(" ms") and float(v[:-3]) > 0 for v in ttfts)
    speedup = next(v for k, v in metrics.items() if k.startswith("Speed-up in TTFT (Full"))
    assert speedup.endswith("×") and float(speedup[:-1]) > 0
    assert int(metrics["Cache hits"]) > 0

    last = app.session_state["last_result"]
    texts = [s["text"] for s in last["sides"]]
    assert [s["method"] for s in last["sides"]] == ["cacheblend", "full"]
    assert all(t.strip() for t in texts)
    shown = [t.value for t in app.text]  # plain text, not Markdown (issue #18)
    assert all(any(t.strip() in v for v in shown) for t in texts)
    # the retrieved chunks, with the recomputed tokens highlighted (15% of them, in total)
    views = last["chunks"]
    assert views and sum(v["recomputed"] for v in views) == round(0.15 * sum(v["tokens"] for v in views))
    assert any("<mark>" in m.value for m in app.markdown)

    # a rerun (another widget changed) still shows the last answer, without recomputing it
    app.slider(key="max_new").set_value(16).run()
    assert [m.label for m in app.metric].count("Time to first token") == 2


@pytest.mark.smollm
def test_uploads_refused_and_accepted(app, kvrag_home):
    uploads = kvrag_home / "demo" / "uploads"
    before = set(uploads.iterdir()) if uploads.exists() else set()  # KVRAG_TEST_HOME may be reused
    app.file_uploader(key="uploads").set_value(
        [
            ("huge.txt", b"x" * (MAX_UPLOAD_BYTES + 1), "text/plain"),
            ("latin.md", "caf\u00e9".encode("latin-1"), "text/markdown"),
            ("empty.txt", b"", "text/plain"),
        ]
    ).run()
    errors = " | ".join(_errors(app))
    assert "too big" in errors and "not UTF-8" in errors and "empty" in errors
    assert (set(uploads.iterdir()) if uploads.exists() else set()) == before

    good = b"# The Quern Bridge\nThe Quern Bridge over the river Tull opened in 1911.\n"
    app.file_uploader(key="uploads").set_value(("../../notes.md", good, "text/markdown")).run()
    assert not app.exception and not _errors(app)
    assert any("added 1 chunk(s)" in s.value for s in app.success)
    assert {p.name for p in set(uploads.iterdir()) - before} <= {hashlib.sha256(good).hexdigest() + ".md"}
    assert (uploads / (hashlib.sha256(good).hexdigest() + ".md")).read_bytes() == good
    app.file_uploader(key="uploads").clear().run()


@pytest.mark.smollm
def test_unreachable_store_is_a_clear_error(app):
    good = app.text_input(key="store_url").value
    app.text_input(key="store_url").set_value("redis://127.0.0.1:1/0").run()
    assert not app.exception
    assert any("Cannot use the KV store" in e and "redis://127.0.0.1:1/0" in e for e in _errors(app))
    app.text_input(key="store_url").set_value("nosuch://x").run()
    assert any("unknown store URL scheme" in e for e in _errors(app))
    app.text_input(key="store_url").set_value("disk:///tmp/not-the-demo-folder").run()
    assert any("inside the demo folder" in e for e in _errors(app))
    app.text_input(key="store_url").set_value(good).run()
    assert not _errors(app)
