"""A real `chroma run` server on loopback and a free port, over a temp folder, which a test can kill and
restart on the same folder and port (as tests start their own Redis: test_backends.RedisServer).

Started through chromadb's own CLI entry point with this interpreter, so it is the chromadb the suite
imports and needs no `chroma` on PATH (a fresh CI machine has it wherever pip put the package)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from test_backends import free_port

CLI = "import sys; from chromadb.cli.cli import app; sys.argv[0] = 'chroma'; sys.exit(app())"


class ChromaServer:
    """`chroma run --path DIR --host 127.0.0.1 --port PORT`; `url(collection)` is kvrag's index URL for it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, collection: str = "kvrag_chunks") -> str:
        return f"chroma://127.0.0.1:{self.port}/{collection}"

    def start(self, seconds: float = 60) -> "ChromaServer":
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLI, "run", "--path", str(self.path), "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chroma run exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"chroma run did not listen on {self.port} within {seconds} s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    stop = kill
