"""Real-browser check of the Streamlit demo: start it, ask the pre-filled question, save a screenshot.

    python scripts/demo_screenshot.py                 # writes docs/demo.png
    python scripts/demo_screenshot.py --out /tmp/demo.png --timeout 300

Needs a Chromium binary (Debian: `apt-get install chromium`) and the `playwright` package,
which drives that system binary (no browser download). The app runs on 127.0.0.1 on a free
port with $KVRAG_HOME/$KVRAG_DEMO_DIR as in the environment; the browser runs headless with
networking extras off. Exits non-zero, with the app's log, if the page never shows an answer.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvrag.demo.launch import streamlit_command
from kvrag.options import RATIO_FREE

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "demo.png"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SPEEDUP_TEXT = "Speed-up in TTFT"


@dataclass
class Shot:
    """What the browser saw: where the screenshot is and the figures read off the page."""

    path: Path
    ttfts: list[str]
    speedup: str
    marks: int
    seconds: float
    steps: dict[str, float]  # seconds each step took: where a slow run spent its time
    method: str = ""  # the fast side's method, read off the speed-up's label

    @property
    def recomputes(self) -> bool:
        """Whether the method recomputes chunk tokens, so the page must highlight some (kvlink and
        full reuse recompute none)."""
        return self.method not in RATIO_FREE


def find_chromium() -> str | None:
    """$CHROMIUM, else the first Chromium/Chrome on PATH."""
    env = os.environ.get("CHROMIUM")
    if env and Path(env).is_file():
        return env
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll Streamlit's health endpoint until it answers "ok" (or the server died / time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the app did not serve {url} within {timeout:.0f}s")


def drive(url: str, out: Path, chromium: str, timeout: float) -> Shot:
    """Load the page, click Ask, wait for both answers and the speed-up, and take a full-page screenshot."""
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    steps: dict[str, float] = {}

    def step(name: str) -> None:
        steps[name] = round(time.monotonic() - t0 - sum(steps.values()), 1)

    ms = int(timeout * 1000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1250})
            page.goto(url, wait_until="domcontentloaded", timeout=ms)
            ask = page.get_by_role("button", name="Ask")
            ask.wait_for(state="visible", timeout=ms)  # shown once the corpus is ingested
            step("page ready")
            ask.click()
            page.get_by_text(SPEEDUP_TEXT).first.wait_for(state="visible", timeout=ms)
            step("answers")
            page.get_by_text("Retrieved chunks").first.wait_for(state="visible", timeout=ms)
            # the run is over when Streamlit's "running" indicator goes away
            page.wait_for_function(
                "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')?.innerText?.match(/Running|Stop/)",
                timeout=ms,
            )
            page.wait_for_timeout(500)  # let the last frame paint
            ttfts = page.locator('[data-testid="stMetric"]').filter(has_text="Time to first token").locator(
                '[data-testid="stMetricValue"]'
            ).all_inner_texts()
            speedup = page.locator('[data-testid="stMetric"]').filter(has_text=SPEEDUP_TEXT).locator(
                '[data-testid="stMetricValue"]'
            ).first.inner_text()
            label = page.locator('[data-testid="stMetric"]').filter(has_text=SPEEDUP_TEXT).locator(
                '[data-testid="stMetricLabel"]'
            ).first.inner_text()
            method = label.rpartition("÷")[2].strip(" )")
            marks = page.locator("mark").count()
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    step("screenshot")
    return Shot(out, [t.strip() for t in ttfts], speedup.strip(), marks, time.monotonic() - t0, steps, method)


def capture(out: Path = DEFAULT_OUT, timeout: float = 300.0, port: int | None = None, env: dict[str, str] | None = None) -> Shot:
    """Start the app, drive the browser, stop the app; raise with the app's log if anything failed."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium found: apt-get install chromium (or set $CHROMIUM)")
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            streamlit_command(port=port, extra=["--server.fileWatcherType", "none", "--client.toolbarMode", "minimal"]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        try:
            t0 = time.monotonic()
            wait_until_serving(url, proc, timeout=min(timeout, 120))
            started = round(time.monotonic() - t0, 1)
            shot = drive(url, out, chromium, timeout)
            shot.steps = {"server up": started, **shot.steps}
        except BaseException as exc:
            log.seek(0)
            tail = log.read()[-4000:]
            raise RuntimeError(f"demo check failed: {exc}\n--- app log ---\n{tail}") from exc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if len(shot.ttfts) != 2 or not shot.speedup.endswith("×") or (shot.marks == 0 and shot.recomputes):
        raise RuntimeError(f"the page lacks the timings or highlights: {shot}")
    return shot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="screenshot file (default docs/demo.png)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the page at each step")
    args = p.parse_args(argv)
    try:
        shot = capture(args.out, timeout=args.timeout, port=args.port)
    except (RuntimeError, FileNotFoundError, ImportError) as exc:
        print(f"demo_screenshot: {exc}", file=sys.stderr)
        return 1
    print(f"saved {shot.path}: TTFT {' / '.join(shot.ttfts)}, speed-up {shot.speedup}, {shot.marks} highlighted runs ({shot.method}); seconds per step {shot.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
