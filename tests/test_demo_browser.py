"""The demo in a real headless Chromium, started as users start it: `kvrag demo` as a process (only a
free `--port` added), the page loaded, a question and a follow-up asked in the chat, two answers seen
with their reports.

Skipped unless a Chromium binary, the `playwright` package and the `kvrag` command are installed
(playwright drives the system Chromium; it downloads nothing). Shares $KVRAG_HOME with
tests/test_demo.py, so after it the app starts on an already ingested corpus.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "demo_screenshot.py"

pytestmark = pytest.mark.smollm


def _load_script():
    spec = importlib.util.spec_from_file_location("demo_screenshot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def screenshot_script():
    pytest.importorskip("streamlit")
    pytest.importorskip("playwright.sync_api", reason="pip install playwright to run the browser check")
    module = _load_script()
    if module.find_chromium() is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    if module.find_kvrag() is None:
        pytest.skip("no `kvrag` command (pip install -e '.[demo]')")
    return module


def test_kvrag_demo_holds_a_conversation_in_a_real_browser(screenshot_script, kvrag_home, tmp_path):
    from PIL import Image

    out = tmp_path / "demo.png"
    env = {"KVRAG_HOME": str(kvrag_home), "KVRAG_DEMO_DIR": str(kvrag_home / "demo")}
    shot = screenshot_script.capture(out, timeout=240, env=env)  # per step; generous for loaded CI machines
    assert Path(shot.command[0]).name == "kvrag" and shot.command[1:] == ["demo", "--port", shot.command[-1]]  # no other flag

    assert len(shot.answers) == 2 and all(a.strip() for a in shot.answers)
    assert len(shot.ttfts) == 2 and all(t.endswith(" ms") for t in shot.ttfts + shot.full_ttfts)
    assert len(shot.speedups) == 2 and all((s.endswith("×") and float(s[:-1]) > 0) or s == "same as Full" for s in shot.speedups)
    assert shot.picker == "default"  # the picker starts at the default, whatever calibration made it here
    assert shot.same and all(v in ("yes", "no") for v in shot.same)  # the quality beside every speed-up
    assert len(shot.methods) == 2 and all(m.startswith("Method: ") for m in shot.methods)
    assert len(shot.prefix) == 2 and shot.prefix[0].startswith("Prefix cache: no prefix-cache hit")
    assert shot.prefix[1].startswith(("Prefix cache: reused ", "Prefix cache: no prefix-cache hit"))
    assert shot.marks > 0 or not shot.recomputes  # kvlink and full reuse recompute no chunk token
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width >= 1000 and img.height >= 800
