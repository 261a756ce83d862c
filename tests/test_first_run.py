"""What a newcomer meets first: `kvrag ask` with nothing ingested fails before it loads (or converts) a
model, and a second $KVRAG_HOME reuses the converted model instead of writing its own copy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ASK_IN_A_FRESH_PROCESS = """
import sys
from kvrag.cli.app import main
code = main(["ask", "When did the Brannoch Line open?"])
print("exit", code, "torch loaded" if "torch" in sys.modules else "no torch")
"""


def test_ask_with_nothing_ingested_fails_before_any_model_or_torch_loads(tmp_path):
    home = tmp_path / "home"
    env = {**os.environ, "KVRAG_HOME": str(home), "KVRAG_MODEL_CACHE": str(tmp_path / "models")}
    out = subprocess.run([sys.executable, "-c", ASK_IN_A_FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert "exit 2 no torch" in out.stdout, out.stdout + out.stderr
    assert "nothing has been ingested yet" in out.stderr and "loading model" not in out.stderr
    assert not (tmp_path / "models").exists() and not home.exists()  # nothing converted, nothing written


def test_an_empty_collection_counts_as_nothing_ingested(tmp_path):
    from kvrag.ingest.retrieval import ChunkIndex, indexed_count
    from kvrag.types import Chunk

    assert indexed_count(tmp_path / "none") == 0 and not (tmp_path / "none").exists()
    index = ChunkIndex(tmp_path / "chroma")
    assert indexed_count(tmp_path / "chroma") == 0
    index.add([Chunk("a", "Owls hunt at night.")])
    assert indexed_count(tmp_path / "chroma") == 1 and indexed_count(tmp_path / "chroma", "other_collection") == 0


@pytest.mark.smollm
def test_a_second_home_reuses_the_converted_model(smollm, tmp_path, monkeypatch):
    """The converted copy lives in the user's model cache, keyed by the GGUF's hash: a new $KVRAG_HOME
    loads it (no second de-quantisation, no second 517 MB write)."""
    from kvrag import load_model
    from kvrag.defaults import model_cache_dir
    from kvrag.model.loading import _converted_gguf_dir, bundled_gguf_path

    converted = _converted_gguf_dir(bundled_gguf_path())  # the session's: `smollm` converted it
    assert (converted / "config.json").exists() and converted.parent == model_cache_dir()
    before = {p: p.stat().st_mtime_ns for p in converted.iterdir()}
    for name in ("first", "second"):
        monkeypatch.setenv("KVRAG_HOME", str(tmp_path / name))
        assert _converted_gguf_dir(bundled_gguf_path()) == converted
        lm = load_model()
        assert lm.fingerprint == smollm.fingerprint
        assert not (tmp_path / name / "models").exists()
    assert {p: p.stat().st_mtime_ns for p in converted.iterdir()} == before  # read, never rewritten


def test_a_copy_converted_under_an_old_home_is_still_used(tmp_path, monkeypatch):
    """Before the shared cache, the copy lived in $KVRAG_HOME/models: it is found there rather than converted again."""
    from kvrag.model.loading import _converted_gguf_dir

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVRAG_MODEL_CACHE", str(tmp_path / "cache"))
    shared = _converted_gguf_dir(gguf)
    assert shared.parent == tmp_path / "cache"
    legacy = tmp_path / "home" / "models" / shared.name
    legacy.mkdir(parents=True)
    (legacy / "config.json").write_text("{}")
    assert _converted_gguf_dir(gguf) == legacy
    shared.mkdir(parents=True)
    (shared / "config.json").write_text("{}")
    assert _converted_gguf_dir(gguf) == shared  # the shared one wins once it exists
    assert Path(os.environ["KVRAG_MODEL_CACHE"]) == tmp_path / "cache"
