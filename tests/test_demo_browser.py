"""The demo in a real headless Chromium: load, click Ask, see both timings and highlighted tokens.

Skipped unless a Chromium binary and the `playwright` package are installed (playwright drives
the system Chromium; it downloads nothing). Shares $KVRAG_HOME with tests/test_demo.py, so after
it the app starts on an already ingested corpus.
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
    return module


def test_demo_in_a_real_browser(screenshot_script, kvrag_home, tmp_path):
    from PIL import Image

    out = tmp_path / "demo.png"
    env = {"KVRAG_HOME": str(kvrag_home), "KVRAG_DEMO_DIR": str(kvrag_home / "demo")}
    shot = screenshot_script.capture(out, timeout=240, env=env)  # per step; generous for loaded CI machines
    assert len(shot.ttfts) == 2 and all(t.endswith(" ms") for t in shot.ttfts)
    assert shot.speedup.endswith("×") and float(shot.speedup[:-1]) > 0
    assert shot.method and (shot.marks > 0 or not shot.recomputes)  # kvlink (the tuned default) recomputes no chunk token
    with Image.open(out) as img:
        assert img.format == "PNG" and img.width >= 1000 and img.height >= 800
