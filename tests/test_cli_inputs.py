"""Issue #18 through the CLI: clear errors for bad input, an ingest that could not store says so, and
`kvrag remove` takes a document out of the index and the store."""

import socket

import pytest

from kvrag.cli.app import main
from kvrag.types import Chunk


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_mistyped_method_parameter_is_an_error_not_a_traceback(capsys):
    assert main(["ask", "Why?", "--method", "a3", "--param", "layr=2"]) == 2
    err = capsys.readouterr().err
    assert "layr" in err and "Traceback" not in err


def test_top_k_zero_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["ask", "Why?", "-k", "0"])
    assert info.value.code == 2 and "at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("value, says", [("-1", "at least 0"), ("9", "at most 8"), ("two", "a whole number")])
def test_a_bad_draft_count_is_refused_by_the_parser(capsys, value, says):
    with pytest.raises(SystemExit) as info:
        main(["ask", "Why?", "--draft-tokens", value])
    assert info.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.smollm
def test_parameters_without_a_method_are_checked_against_the_engines_default(tmp_path, capsys, smollm):
    from kvrag.defaults import kvrag_home
    from kvrag.ingest.retrieval import ChunkIndex

    ChunkIndex(kvrag_home() / "chroma", collection="cli_params").add([Chunk("p", "Owls hunt at night.")])  # past the index check
    store = ["--store", f"disk://{tmp_path / 'kv'}", "--device", "cpu", "--collection", "cli_params"]
    assert main(["ask", "Why?", *store, "--param", "layr=2"]) == 2  # neither cacheblend nor kvlink (over a tuned adapter) has `layr`
    err = capsys.readouterr().err
    assert "layr" in err and "Traceback" not in err


def test_link_adapter_option_takes_auto_links_none_or_a_file(tmp_path, capsys):
    from kvrag.cli.app import _parser
    from kvrag.cli.serve import settings_from_args

    assert _parser().parse_args(["ask", "Why?"]).link_adapter == "auto"
    assert _parser().parse_args(["ask", "Why?", "--link-adapter", "none"]).link_adapter is None
    assert _parser().parse_args(["ingest", "x", "--link-adapter", "links"]).link_adapter == "links"
    with pytest.raises(SystemExit) as info:
        main(["ask", "Why?", "--link-adapter", str(tmp_path / "missing.safetensors")])
    assert info.value.code == 2 and "no such file" in capsys.readouterr().err
    settings = settings_from_args(_parser().parse_args(["serve", "--link-adapter", "none"]))
    assert settings.link_adapter is None and settings.method is None  # None: the engine's default method


@pytest.mark.smollm
def test_ingest_refuses_binary_text_files_and_reports_kv_it_could_not_store(tmp_path, capsys, smollm):
    binary = tmp_path / "program.txt"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    common = ["--collection", "cli_inputs", "--device", "cpu"]
    assert main(["ingest", *common, "--store", f"disk://{tmp_path / 'kv'}", str(binary)]) == 2
    assert "program.txt" in capsys.readouterr().err

    doc = tmp_path / "notes.md"
    doc.write_text("The Brannoch Line is a mountain railway that opened in 1893.\n", encoding="utf-8")
    down = f"redis://127.0.0.1:{_closed_port()}/0?connect_timeout=0.2&socket_timeout=0.2"
    assert main(["ingest", *common, "--store", down, str(doc)]) == 1
    assert "was not stored" in capsys.readouterr().err

    store = f"disk://{tmp_path / 'kv'}"
    assert main(["ingest", *common, "--store", store, str(doc)]) == 0
    capsys.readouterr()
    assert main(["remove", *common, "--store", store, str(doc)]) == 0
    assert "1 chunks removed from the index" in capsys.readouterr().out  # what was removed: the command's result
    assert main(["remove", *common, "--store", store, str(doc)]) == 1  # nothing left to remove


@pytest.mark.smollm
def test_remove_while_the_stores_id_index_cannot_be_read_changes_nothing(tmp_path, capsys, smollm):
    """`kvrag remove` is whole or not at all: with the store's Redis frozen the ids' links cannot be dropped,
    so nothing is (the index keeps the document); once Redis is back the same command removes it."""
    import os
    import signal

    from test_backends import REDIS, RedisServer

    if REDIS is None:
        pytest.skip("redis-server is not installed")
    doc = tmp_path / "notes.md"
    doc.write_text("The Brannoch Line is a mountain railway that opened in 1893.\n", encoding="utf-8")
    common = ["--collection", "cli_remove", "--device", "cpu"]
    redis = RedisServer()
    redis.start()
    try:
        store = f"{redis.url}?connect_timeout=0.3&socket_timeout=0.3"
        assert main(["ingest", *common, "--store", store, str(doc)]) == 0
        capsys.readouterr()
        os.kill(redis.proc.pid, signal.SIGSTOP)  # unreachable (reads time out), its data kept
        try:
            assert main(["remove", *common, "--store", store, str(doc)]) == 1
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        assert "nothing was removed" in capsys.readouterr().err
        assert main(["remove", *common, "--store", store, str(doc)]) == 0  # the document was still there to remove
        assert "1 KV entries deleted" in capsys.readouterr().out
    finally:
        redis.stop()
