"""Start the Streamlit demo as a child process (what a `kvrag demo` command calls)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Callable, Sequence
from pathlib import Path

__all__ = ["app_path", "launch", "launch_env", "streamlit_command"]


def app_path() -> Path:
    """The demo script inside the installed package (works from a wheel as well as a clone)."""
    return Path(__file__).with_name("app.py")


def streamlit_command(port: int = 8501, address: str = "127.0.0.1", headless: bool = True, extra: list[str] | None = None) -> list[str]:
    """The `python -m streamlit run ...` argv: local address by default, no telemetry, 1 MB uploads."""
    if not 0 < int(port) < 65536:
        raise ValueError(f"port must be within 1..65535, got {port}")
    return [
        sys.executable, "-m", "streamlit", "run", str(app_path()),
        "--server.address", address,
        "--server.port", str(int(port)),
        "--server.headless", "true" if headless else "false",
        "--browser.gatherUsageStats", "false",
        "--server.maxUploadSize", "1",  # MB; the app checks each file again (kvrag.demo.upload)
        *(extra or []),
    ]


def launch_env(allow_store_hosts: Sequence[str] = (), base: dict[str, str] | None = None, index: str | None = None) -> dict[str, str]:
    """The demo's environment: `allow_store_hosts` (beyond loopback) become $KVRAG_DEMO_ALLOW_HOSTS;
    `index` (a shared chroma://host:port/collection) $KVRAG_INDEX."""
    from kvrag.demo.stores import ALLOW_HOSTS_ENV

    env = dict(os.environ if base is None else base)
    hosts = [h.strip() for h in allow_store_hosts if h and h.strip()]
    if any("," in h or any(c.isspace() for c in h) for h in hosts):
        raise ValueError(f"store hosts are single names or addresses, got {hosts}")
    if hosts:
        env[ALLOW_HOSTS_ENV] = ",".join(hosts)
    if index:
        from kvrag.ingest.index_url import parse_index_url

        parse_index_url(index)  # a clear error here, not a page that fails
        env["KVRAG_INDEX"] = index
    return env


def launch(
    port: int = 8501,
    address: str = "127.0.0.1",
    headless: bool = True,
    extra: list[str] | None = None,
    allow_store_hosts: Sequence[str] = (),
    index: str | None = None,
) -> int:
    """Run the demo until it exits (Ctrl-C stops it) and return Streamlit's exit code.

    SIGTERM or SIGHUP to this process (a service manager stopping it, a closed terminal) stops the Streamlit
    child too, so it never lives on holding the port. `allow_store_hosts`: hosts besides loopback whose Redis
    the page may open (`kvrag demo --allow-store-host`)."""
    proc = subprocess.Popen(streamlit_command(port, address, headless, extra), env=launch_env(allow_store_hosts, index=index))
    restore = _forward_stop_signals(proc)
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Streamlit got the same SIGINT: let it shut down cleanly
        return _stopped(proc)
    finally:
        restore()
        if proc.poll() is None:  # whatever ended the wait: never leave the child behind
            proc.terminate()
            _stopped(proc)


def _stopped(proc: subprocess.Popen, grace_s: float = 10) -> int:
    """Wait for the child to exit after being told to, then kill it."""
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _forward_stop_signals(proc: subprocess.Popen) -> Callable[[], None]:
    """Pass SIGTERM and SIGHUP on to `proc` (whose exit then ends `launch`); returns what restores the
    previous handlers. Only the main thread may set handlers: elsewhere nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def forward(signum: int, frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    wanted = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {sig: signal.signal(sig, forward) for sig in wanted}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
