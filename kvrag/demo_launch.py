"""Start the Streamlit demo as a child process (what a `kvrag demo` command calls)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

__all__ = ["app_path", "launch", "streamlit_command"]


def app_path() -> Path:
    """The demo script inside the installed package (works from a wheel as well as a clone)."""
    return Path(__file__).with_name("demo_app.py")


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
        "--server.maxUploadSize", "1",  # MB; the app checks each file again (kvrag.demo_upload)
        *(extra or []),
    ]


def launch(port: int = 8501, address: str = "127.0.0.1", headless: bool = True, extra: list[str] | None = None) -> int:
    """Run the demo until it exits (Ctrl-C stops it) and return Streamlit's exit code."""
    proc = subprocess.Popen(streamlit_command(port, address, headless, extra))
    try:
        return proc.wait()
    except KeyboardInterrupt:  # Streamlit got the same SIGINT: let it shut down cleanly
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
