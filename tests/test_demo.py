"""The Streamlit demo: upload checks, highlighting and the answer's describing lines as plain functions,
then the real app (a chat) in AppTest."""

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
    names = demo_app.method_names()
    assert names[0] == "default" and "full" not in names and "reuse" in names  # the picker starts at the default


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


def test_the_lines_say_what_happened():
    whole = {"full_reason": "560 chunk tokens <= short_context=768: answered with Full Attention", "prefix_hit_tokens": 0}
    assert demo_app.method_line("fusionrag", 0.15, whole) == "read whole (short context)"
    records = {"full_reason": "the chunks are records of one kind (records_whole): answered with Full Attention"}
    assert demo_app.method_line("fusionrag", 0.15, records) == "read whole (records of one kind)"
    assert demo_app.method_line("fusionrag", 0.15, {}) == "fusionrag (recompute 15%)"
    assert demo_app.method_line("reuse", 0.15, {}) == "reuse"
    assert demo_app.prefix_line({"prefix_hit_tokens": 612, "prompt_tokens": 640, "turns": 3}) == (
        "reused 612 of 640 prompt tokens from the previous turn")
    assert demo_app.prefix_line({"prefix_hit_tokens": 0, "prompt_tokens": 640, "turns": 3}) == "no prefix-cache hit"
    view = demo_app.ChunkView("1. x", "<div>x</div>", 10, 0)
    assert demo_app.chunks_caption("fusionrag", whole, [view]).startswith("Read whole: fusionrag's reuse did not apply (560")
    assert "recomputed none" in demo_app.chunks_caption("reuse", {"prefix_hit_tokens": 0}, [view])


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


QUESTION = "In what year did the Brannoch Line open?"
FOLLOW_UP = "Who was its chief engineer?"  # "its": only the conversation says which line


def _texts(at) -> list[str]:
    return [t.value for t in at.text]


def _captions(at) -> list[str]:
    return [c.value for c in at.caption]


def _turns(at) -> list[dict]:
    return at.session_state["conversation"] if "conversation" in at.session_state else []


def _ask(at, question: str) -> None:
    at.chat_input(key="question").set_value(question).run()
    assert not at.exception, [e.value for e in at.exception]
    assert not _errors(at)


def _new_conversation(at) -> None:
    at.button(key="new_conversation").click().run()
    assert not at.exception and _turns(at) == []


@pytest.mark.smollm
def test_app_starts_with_the_sample_corpus(app, kvrag_home):
    assert not _errors(app)
    sample = demo_app.sample_questions()[0]["question"]
    assert sample in app.chat_input(key="question").proto.placeholder  # the sample question is offered
    assert app.button(key="suggestion").label.endswith(sample)
    assert (kvrag_home / "chroma").is_dir() and (kvrag_home / "kv").is_dir()  # the index and store `kvrag ingest` fills
    assert any(c.value.startswith(f"disk://{(kvrag_home / 'kv').resolve()}") for c in app.sidebar.code)


@pytest.mark.smollm
def test_the_method_defaults_to_the_engines_default(app):
    from kvrag.options import DEFAULT_METHOD

    assert app.selectbox(key="method").value == "default"  # the picker starts at the default, whatever it is here
    caption = next(c.value for c in app.sidebar.caption if c.value.startswith("the default here: "))
    assert caption.startswith(f"the default here: {DEFAULT_METHOD}@0.15 (fixed")  # calibration is off in the suite


def _check_reply_metrics(at, answers: int) -> None:
    """Each answer's TTFT, Full Attention's, the speed-up, and beside it the agreement and the KL."""
    values = lambda label: [m.value for m in at.metric if m.label == label]  # noqa: E731
    for label in ("Time to first token", "Full Attention TTFT"):
        assert len(values(label)) == answers and all(v.endswith(" ms") and float(v[:-3]) > 0 for v in values(label))
    speedups = values("Speed-up in TTFT")
    assert len(speedups) == answers and all(v.endswith("×") and float(v[:-1]) > 0 for v in speedups)
    assert len(values("Same answer as Full")) == answers and all(v in ("yes", "no") for v in values("Same answer as Full"))
    kls = values("First-token KL")
    assert len(kls) == answers and all(float(v) >= 0 for v in kls)


@pytest.mark.smollm
def test_a_two_turn_conversation_reuses_the_first_turn(app):
    """Turn one: the method's answer streamed, Full Attention beside it, the recomputed tokens
    highlighted. Turn two (a follow-up that needs the first question) reads turn one's KV from the
    prefix cache, and says so."""
    _new_conversation(app)
    app.selectbox(key="method").set_value("cacheblend")  # a method that recomputes: its tokens are highlighted
    app.slider(key="top_k").set_value(3).run()  # the line's own chunks, whichever follow-up retrieves them
    _ask(app, QUESTION)
    turns = _turns(app)
    assert [t["role"] for t in turns] == ["user", "assistant"] and turns[0]["content"] == QUESTION
    first = turns[1]["reply"]
    assert first["method"] == "cacheblend" and first["stats"]["prefix_hit_tokens"] == 0 and first["stats"]["turns"] == 1
    assert not first["stats"]["full_reason"]
    assert first["text"].strip() and first["full_text"].strip()
    assert first["text"] in _texts(app) and first["full_text"] in _texts(app)  # plain text, not Markdown (issue #18)
    _check_reply_metrics(app, 1)
    assert [m.proto.help for m in app.metric if m.label == "Speed-up in TTFT"] == [
        "Full Attention's TTFT ÷ this answer's (cacheblend); from the chunks' stored KV"]  # which cache it came from
    captions = _captions(app)
    assert "Method: cacheblend (recompute 15%)" in captions
    assert any(c.startswith("Prefix cache: no prefix-cache hit.") for c in captions)
    views = first["chunks"]  # 15% of the chunk tokens recomputed, and highlighted
    assert views and sum(v["recomputed"] for v in views) == round(0.15 * sum(v["tokens"] for v in views))
    assert any("<mark>" in m.value for m in app.markdown)
    assert all("Brannoch" in v["label"] for v in views)
    # one count of store lookups per answer beside it; the sidebar's are cumulative, and say so
    assert first["stats"]["cache_hits"] + first["stats"]["cache_misses"] == len(views)  # each chunk looked up once
    assert any(f"chunk KV store lookups for this answer: {first['stats']['cache_hits']} hits" in c for c in captions)
    store = next(c.value for c in app.sidebar.caption if c.value.startswith("Cumulative store lookups since the server started"))
    assert int(store.split(": ")[1].split(" hits")[0]) >= first["stats"]["cache_hits"]

    _ask(app, FOLLOW_UP)
    turns = _turns(app)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    assert [t["content"] for t in turns[:3]] == [QUESTION, first["text"], FOLLOW_UP]  # the conversation is kept
    second = turns[3]["reply"]
    stats = second["stats"]
    assert stats["turns"] == 3 and second["chunk_ids"] == first["chunk_ids"]  # retrieved with the first question too
    assert stats["prefix_hit_tokens"] > first["stats"]["prompt_tokens"] - 1 and stats["recomputed_tokens"] == 0
    assert f"reused {stats['prefix_hit_tokens']} of {stats['prompt_tokens']} prompt tokens from the previous turn" in " ".join(_captions(app))
    assert any("came from the previous turn" in c for c in _captions(app))
    assert all("KV from the prefix cache" in v["label"] and v["recomputed"] == 0 for v in second["chunks"])
    assert second["full_stats"]["prefix_hit_tokens"] == 0  # the reference re-reads everything
    _check_reply_metrics(app, 2)
    assert all(t["content"] in _texts(app) for t in turns)  # both questions and answers, as plain text

    # a rerun (another widget changed) redraws the conversation without recomputing it
    app.slider(key="max_new").set_value(16).run()
    assert _turns(app) == turns
    _check_reply_metrics(app, 2)

    _new_conversation(app)
    assert not [m for m in app.metric if m.label == "Time to first token"] and QUESTION not in _texts(app)
    app.slider(key="max_new").set_value(demo_app.DEFAULT_MAX_NEW_TOKENS)
    app.slider(key="top_k").set_value(demo_app.DEFAULT_K).run()


@pytest.mark.smollm
def test_an_answer_read_whole_says_so(app, monkeypatch):
    """A short context is read whole with Full Attention by policy: the page says "read whole", not
    "cacheblend (recompute 15%)", and highlights no chunk token."""
    monkeypatch.setenv("KVRAG_SHORT_CONTEXT", "100000")  # every context is short (the tests turn the policy off)
    _new_conversation(app)
    app.selectbox(key="method").set_value("cacheblend")
    _ask(app, QUESTION)
    reply = _turns(app)[1]["reply"]
    assert "short_context=100000" in reply["stats"]["full_reason"]
    captions = _captions(app)
    assert "Method: read whole (short context)" in captions and "Method: cacheblend (recompute 15%)" not in captions
    assert any(c.startswith("Read whole: cacheblend's reuse did not apply") for c in captions)
    speed = [m for m in app.metric if m.label == "Speed-up in TTFT"]  # read whole: the same work as Full, no ratio
    assert [m.value for m in speed] == ["same as Full"] and "read whole" in speed[0].proto.help
    assert all(v["recomputed"] == 0 and "read whole" in v["label"] for v in reply["chunks"])
    assert not any("<mark>" in m.value for m in app.markdown)
    _new_conversation(app)


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
