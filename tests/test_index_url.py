"""Index URLs (issue #52): `chroma://host:port/collection` parsed with clear errors, and carried to the
demo; no server needed."""

from __future__ import annotations

import pytest

from kvrag.ingest.index_url import IndexURL, parse_index_url


def test_a_chroma_url_names_host_port_and_collection():
    assert parse_index_url("chroma://10.0.0.5:8001/docs") == IndexURL("10.0.0.5", 8001, "docs")
    assert parse_index_url("chroma://index.internal") == IndexURL("index.internal", 8000, None)  # `chroma run`'s port
    assert parse_index_url("CHROMA://h:9/") == IndexURL("h", 9, None)


@pytest.mark.parametrize("url,words", [
    ("http://h:8000/x", "expected chroma://"), ("/srv/chroma", "expected chroma://"), ("chroma://:8000/x", "names no host"),
    ("chroma://h:99999/x", "port"), ("chroma://h:1/a/b", "one collection"), ("chroma://u:secret@h:1/x", "no user"),
])
def test_anything_else_is_a_clear_error_that_never_echoes_a_password(url, words):
    with pytest.raises(ValueError, match=words) as err:
        parse_index_url(url)
    assert "secret" not in str(err.value)


def test_the_demo_carries_its_index_to_the_page():
    from kvrag.demo.launch import launch_env

    assert launch_env(base={}, index="chroma://127.0.0.1:8000/demo_docs")["KVRAG_INDEX"] == "chroma://127.0.0.1:8000/demo_docs"
    assert "KVRAG_INDEX" not in launch_env(base={})
    with pytest.raises(ValueError, match="chroma://"):
        launch_env(base={}, index="redis://127.0.0.1:6379/0")
