"""Real-browser check of the Streamlit demo: start `kvrag demo`, hold a two-turn conversation, save a screenshot.

    python scripts/demo_screenshot.py                 # writes docs/demo.png
    python scripts/demo_screenshot.py --out /tmp/demo.png --timeout 300
    python scripts/demo_screenshot.py --top-k 8 --follow-up "Tell me more about it."   # docs/demo.png as committed

The app is started as users start it, `kvrag demo` (the console script; only `--port` is added, a
free port), so it binds 127.0.0.1 with $KVRAG_HOME/$KVRAG_DEMO_DIR as in the environment. The
browser asks the sample question, then a follow-up that only the conversation explains ("its"), and
waits for both answers with their reports (TTFT, Full Attention's, the speed-up with the agreement,
the prefix-cache line). Needs a Chromium binary (Debian: `apt-get install chromium`) and the
`playwright` package, which drives that system binary (no browser download); the browser runs
headless with networking extras off. Exits non-zero, with the app's log, if the page never shows
both answers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
QUESTION = "In what year did the Brannoch Line open?"  # the sample question the page offers
FOLLOW_UP = "Who was its chief engineer?"  # "its": retrieval needs the first question too
SPEEDUP_TEXT = "Speed-up in TTFT"
VIEWPORT = {"width": 1500, "height": 1250}
# what `kvrag demo` cannot be told on its command line, as Streamlit reads it from the environment
STREAMLIT_ENV = {"STREAMLIT_SERVER_FILE_WATCHER_TYPE": "none", "STREAMLIT_CLIENT_TOOLBAR_MODE": "minimal"}


@dataclass
class Shot:
    """What the browser saw: where the screenshot is and, per answer, the figures read off the page."""

    path: Path
    answers: list[str]  # the assistant's answers, in order
    ttfts: list[str]  # the method's time to first token, per answer ("812 ms")
    full_ttfts: list[str]  # Full Attention's over the same conversation
    speedups: list[str]  # "3.4×", or "same as Full" where the context was read whole
    same: list[str]  # "yes" / "no": agreement with Full Attention
    methods: list[str]  # "Method: fusionrag (recompute 15%)" or "Method: read whole (short context)"
    prefix: list[str]  # "Prefix cache: reused 612 of 640 prompt tokens from the previous turn. ..."
    marks: int  # highlighted runs of recomputed tokens on the page
    seconds: float
    command: list[str] = field(default_factory=list)  # how the app was started
    steps: dict[str, float] = field(default_factory=dict)  # seconds each step took: where a slow run spent its time
    picker: str = ""  # the method picker's setting as the page opened ("default")

    @property
    def recomputes(self) -> bool:
        """Whether the first answer recomputed a chosen share of chunk tokens, so the page must highlight
        some (read whole, kvlink and full reuse highlight none)."""
        return bool(self.methods) and "(recompute" in self.methods[0]


def find_chromium() -> str | None:
    """$CHROMIUM, else the first Chromium/Chrome on PATH."""
    env = os.environ.get("CHROMIUM")
    if env and Path(env).is_file():
        return env
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def find_kvrag() -> str | None:
    """The `kvrag` console script of this Python (beside it), else the first on PATH."""
    beside = Path(sys.executable).with_name("kvrag")
    return str(beside) if beside.is_file() else shutil.which("kvrag")


def demo_command(port: int) -> list[str]:
    """What a user types, `kvrag demo`, with a free port so a check never collides with a running demo."""
    exe = find_kvrag()
    if exe is None:
        raise FileNotFoundError("no `kvrag` command found: pip install -e '.[demo]'")
    return [exe, "demo", "--port", str(int(port))]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_serving(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Poll Streamlit's health endpoint until it answers "ok" (or the server died / time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`kvrag demo` exited with code {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.read().strip() == b"ok":
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the app did not serve {url} within {timeout:.0f}s")


FRESH = '[data-testid="stElementContainer"]:not([data-stale="true"])'  # this run's elements, not the last run's left on screen
_ANSWERED = """([n, question]) => {
  if (document.querySelector('[data-testid="stStatusWidget"]')?.innerText?.match(/Running|Stop/)) return false;
  const fresh = [...document.querySelectorAll('%s [data-testid="stMetric"]')].filter(m => m.innerText.includes("%s"));
  const asked = [...document.querySelectorAll('[data-testid="stChatMessage"]')].some(m => m.innerText.includes(question));
  return fresh.length === n && asked;
}""" % (FRESH, SPEEDUP_TEXT)


def _idle(page, ms: int) -> None:
    """Wait until Streamlit's "running" indicator has gone: the script run is over."""
    page.wait_for_function(
        "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')?.innerText?.match(/Running|Stop/)",
        timeout=ms,
    )


def _metric_values(page, label: str) -> list[str]:
    metrics = page.locator(f'{FRESH} [data-testid="stMetric"]').filter(has_text=label)
    return [t.strip() for t in metrics.locator('[data-testid="stMetricValue"]').all_inner_texts()]


def _captions(page, start: str) -> list[str]:
    texts = page.locator(f'{FRESH} [data-testid="stCaptionContainer"]').all_inner_texts()
    return [" ".join(t.split()) for t in texts if t.strip().startswith(start)]


def drive(url: str, out: Path, chromium: str, timeout: float, top_k: int | None = None,
          questions: tuple[str, str] = (QUESTION, FOLLOW_UP)) -> Shot:
    """Load the page, ask the question and the follow-up in the chat, wait for both answers and their
    reports, open the first answer's chunks, and take a full-page screenshot."""
    from playwright.sync_api import sync_playwright

    t0 = time.monotonic()
    steps: dict[str, float] = {}

    def step(name: str) -> None:
        steps[name] = round(time.monotonic() - t0 - sum(steps.values()), 1)

    ms = int(timeout * 1000)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url, wait_until="domcontentloaded", timeout=ms)
            box = page.locator('[data-testid="stChatInput"] textarea')
            box.wait_for(state="visible", timeout=ms)  # shown once the corpus is ingested
            _idle(page, ms)
            step("page ready")
            if top_k is not None:  # the slider's keys: Home is 1, each ArrowRight one more
                thumb = page.locator('[data-testid="stSlider"]').filter(has_text="top-k").get_by_role("slider")
                thumb.focus()
                thumb.press("Home")
                for _ in range(top_k - 1):
                    thumb.press("ArrowRight")
                page.wait_for_timeout(300)
                _idle(page, ms)
            for n, question in enumerate(questions, start=1):
                box.fill(question)
                box.press("Enter")
                # the run is over, the question is on the page, and n answers show their speed-up (which
                # comes once Full Attention's reference is in)
                page.wait_for_function(_ANSWERED, arg=[n, question], timeout=ms)
                step(f"answer {n}")
            # the first answer's chunks open (what its method recomputed), the follow-up's closed (its caption
            # above them says where their KV came from): one picture of both, not too tall
            chunk_lists = page.locator('[data-testid="stExpander"]').filter(has_text="Retrieved chunks")
            for i, want_open in ((0, True), (chunk_lists.count() - 1, False)):
                details = chunk_lists.nth(i).locator("details")
                if (details.get_attribute("open") is not None) != want_open:
                    chunk_lists.nth(i).locator("summary").click()
                    page.wait_for_timeout(300)
            page.wait_for_timeout(500)
            # the page scrolls inside Streamlit's main section: a viewport as tall as its content shows it all
            height = page.evaluate("() => Math.max(...[...document.querySelectorAll('section, div')].map(e => e.scrollHeight))")
            page.set_viewport_size({"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], min(int(height) + 40, 12000))})
            page.wait_for_timeout(800)  # let the last frame paint
            assistant = page.locator('[data-testid="stChatMessage"]').filter(
                has=page.locator('[data-testid="stChatMessageAvatarAssistant"]')
            )
            texts = [m.locator(f'{FRESH} [data-testid="stText"]').first.inner_text() for m in assistant.all()]
            shot = Shot(
                path=out,
                answers=texts,
                ttfts=_metric_values(page, "Time to first token"),
                full_ttfts=_metric_values(page, "Full Attention TTFT"),
                speedups=_metric_values(page, SPEEDUP_TEXT),
                same=_metric_values(page, "Same answer as Full"),
                methods=_captions(page, "Method:"),
                prefix=_captions(page, "Prefix cache:"),
                marks=page.locator("mark").count(),
                seconds=0.0,
                picker=_picker(page),
            )
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    step("screenshot")
    shot.seconds, shot.steps = time.monotonic() - t0, steps
    return shot


def _picker(page: Any) -> str:
    """The method picker's shown value (the page's first select box): its text, or its input's value."""
    try:
        seen = page.evaluate(
            "() => { const b = document.querySelector('[data-testid=\"stSelectbox\"]');"
            " if (!b) return ''; return b.innerText + '\\n' + [...b.querySelectorAll('input')]"
            ".map(i => i.value || i.getAttribute('aria-label') || '').join('\\n'); }")
    except Exception as exc:  # noqa: BLE001 (a page without it: the check says so)
        return f"(unreadable: {exc})"
    texts = [t.strip() for t in str(seen).splitlines()]
    return next((t for t in texts if t and t != "Method" and not t.startswith("Selected")), "|".join(texts))


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to `kvrag demo` and the Streamlit it started (their own process group), as a user stops it."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def check(shot: Shot) -> None:
    """Raise unless the page showed two answers, each with its TTFT, Full Attention's, the speed-up with
    the agreement beside it and the prefix-cache line (and highlights where the method recomputed)."""
    counts = {name: len(getattr(shot, name)) for name in ("answers", "ttfts", "full_ttfts", "speedups", "same", "methods", "prefix")}
    if set(counts.values()) != {2}:
        raise RuntimeError(f"the page lacks two answers with their reports: {counts}: {shot}")
    if not all(t.endswith(" ms") for t in shot.ttfts + shot.full_ttfts) or not all(
            s.endswith("×") or s == "same as Full" for s in shot.speedups):
        raise RuntimeError(f"the page lacks the timings: {shot}")
    if shot.marks == 0 and shot.recomputes:
        raise RuntimeError(f"the page lacks the highlights of the recomputed tokens: {shot}")


def capture(out: Path = DEFAULT_OUT, timeout: float = 300.0, port: int | None = None, env: dict[str, str] | None = None,
            top_k: int | None = None, follow_up: str = FOLLOW_UP) -> Shot:
    """Start `kvrag demo`, drive the browser, stop the app; raise with the app's log if anything failed."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no Chromium found: apt-get install chromium (or set $CHROMIUM)")
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        command = demo_command(port)
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **STREAMLIT_ENV, **(env or {})},
            start_new_session=True,  # its own process group: `stop` reaches the Streamlit child too
        )
        try:
            t0 = time.monotonic()
            wait_until_serving(url, proc, timeout=min(timeout, 120))
            started = round(time.monotonic() - t0, 1)
            shot = drive(url, out, chromium, timeout, top_k, (QUESTION, follow_up))
            shot.steps, shot.command = {"server up": started, **shot.steps}, command
            check(shot)
        except BaseException as exc:
            log.seek(0)
            tail = log.read()[-4000:]
            raise RuntimeError(f"demo check failed: {exc}\n--- app log ---\n{tail}") from exc
        finally:
            stop(proc)
    return shot


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="screenshot file (default docs/demo.png)")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the page at each step")
    p.add_argument("--top-k", type=int, default=None, help="move the top-k slider first (default: the page's default)")
    p.add_argument("--follow-up", default=FOLLOW_UP, help=f"the second question (default {FOLLOW_UP!r})")
    args = p.parse_args(argv)
    try:
        shot = capture(args.out, timeout=args.timeout, port=args.port, top_k=args.top_k, follow_up=args.follow_up)
    except (RuntimeError, FileNotFoundError, ImportError) as exc:
        print(f"demo_screenshot: {exc}", file=sys.stderr)
        return 1
    for n in range(2):
        print(f"answer {n + 1}: {shot.methods[n]} | TTFT {shot.ttfts[n]} vs Full {shot.full_ttfts[n]} = {shot.speedups[n]}, "
              f"same answer as Full: {shot.same[n]} | {shot.prefix[n]}")
    print(f"saved {shot.path}: {shot.marks} highlighted runs; seconds per step {shot.steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
