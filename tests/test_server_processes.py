"""Issue #19 scale-out: two server *processes* over one Redis store. A chunk ingested through one is
answered by id through the other, from the shared store's KV (cache hits, nothing recomputed)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kvrag.client import ask_via_server, health, ingest_via_server  # noqa: E402
from conftest import SHORT_CONTEXT_ENV  # noqa: E402
from test_backends import REDIS, RedisServer, free_port  # noqa: E402
from tiny import THREE_CHUNKS, THREE_Q  # noqa: E402

SERVE = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from kvrag import KVRag, from_model
    from kvrag.server.runner import serve
    from kvrag.server.settings import ServerSettings
    from tiny import tiny_model, tiny_tokenizer

    rag = KVRag(from_model(tiny_model("llama"), tiny_tokenizer()), store={store!r})
    serve(ServerSettings(port={port}, max_new_tokens=8), rag=rag)
    """
)


def _start(store: str, home: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = SERVE.format(tests=str(Path(__file__).parent), store=store, port=port)
    env = {"KVRAG_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "KVRAG_CALIBRATE": os.environ.get("KVRAG_CALIBRATE", "0"),
           **{name: os.environ[name] for name in SHORT_CONTEXT_ENV}}  # the reuse path, as in this process
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            health(url)
            return
        except Exception:
            time.sleep(0.5)
    raise AssertionError(f"server at {url} did not come up in {seconds} s")


@pytest.mark.skipif(REDIS is None, reason="redis-server is not installed (apt-get install redis-server)")
def test_two_server_processes_share_one_redis_store(tmp_path):
    pytest.importorskip("redis")
    redis = RedisServer()
    redis.start()
    procs = []
    try:
        for i in range(2):
            procs.append(_start(redis.url, tmp_path / f"home{i}"))
        for proc, url in procs:
            _wait(proc, url)
        (_, one), (_, two) = procs
        assert ingest_via_server(one, THREE_CHUNKS)["computed"] == 3
        text, stats = ask_via_server(two, THREE_Q, ["a", "b", "c"], max_new_tokens=3)
        assert stats.cache_hits == 3 and stats.cache_misses == 0 and stats.chunk_prefill_tokens == 0
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=30)
        redis.stop()
