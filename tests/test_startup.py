"""What starting kvrag costs (issue #36): `import kvrag` and the command line's parser load no torch,
and the server loads no LangChain. Each is checked in a fresh interpreter, so nothing this test session
imported counts."""

import subprocess
import sys
from pathlib import Path

import pytest


def loaded_after(code: str) -> set[str]:
    """Top-level packages a fresh interpreter holds after running `code`."""
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_kvrag_and_the_parser_load_no_torch():
    mods = loaded_after("import kvrag\nfrom kvrag.cli.app import _parser\n_parser()")
    assert "kvrag" in mods and not mods & {"torch", "transformers", "chromadb", "numpy"}


def test_help_answers_without_torch():
    code = "import sys\nfrom kvrag.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    assert "torch" not in loaded_after(code)


def test_the_engine_still_loads_on_first_use():
    assert "torch" in loaded_after("import kvrag\nkvrag.KVRag")


def test_the_server_answers_a_chat_with_langchain_unimportable():
    """`kvrag serve` without langchain-core installed: every LangChain import fails in this interpreter,
    and the server still builds a multi-message chat prompt and answers."""
    pytest.importorskip("fastapi")
    code = f"""
import importlib.abc, sys
class NoLangChain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0].startswith("langchain"):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NoLangChain())
sys.path.insert(0, {str(Path(__file__).parent)!r})
from fastapi.testclient import TestClient
from kvrag import KVRag, from_model
from kvrag.server.app import create_app
from kvrag.server.settings import ServerSettings
from tiny import tiny_model, tiny_tokenizer
rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False)
chat = {{"model": "kvrag", "max_tokens": 2, "messages": [{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "hi"}}]}}
print(TestClient(create_app(rag, ServerSettings())).post("/v1/chat/completions", json=chat).status_code)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.split()[-1:] == ["200"], out.stderr[-2000:]


def test_an_answer_draws_no_deprecation_warning_from_transformers():
    """transformers 5.24 deprecates `past_key_values` (removed in 5.40): kvrag passes `cache=` where the
    model takes it (kvrag.model.cache.cache_arg), so an answer warns of nothing."""
    import warnings

    from kvrag import KVRag, from_model
    from tiny import THREE_CHUNKS, THREE_Q, tiny_model, tiny_tokenizer

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store="memory://", check=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for method in ("full", "cacheblend"):
            rag.answer(THREE_Q, chunks=THREE_CHUNKS, method=method, max_new_tokens=3)
    assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]
