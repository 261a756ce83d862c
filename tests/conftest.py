import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import home_guard  # noqa: E402

# The user's own kvrag folders, named and snapshot before anything of the suite runs (collection included):
# the `kvrag_home` fixture fails the suite if any of them changed by its end (issue 70, item 8).
_TEST_PLACES = (os.environ.get("KVRAG_TEST_HOME"), os.environ.get("KVRAG_TEST_MODEL_CACHE"))
_USER_PLACES = home_guard.user_places(os.environ, _TEST_PLACES)
_GUARD = os.environ.get(home_guard.OFF_ENV) != "0"
_BEFORE = home_guard.snapshot(_USER_PLACES, _TEST_PLACES) if _GUARD else {}
_LOOK = [home_guard.signature(_USER_PLACES) if _GUARD else {}]  # the last cheap look (after the last test)
_SEEN_AFTER: list[str] = []  # tests after which a cheap look found a change
# The suite's $KVRAG_HOME is set here, on import, not in a fixture: test modules that build an engine at import
# (tests/test_langchain.py) run the gate during collection, which writes its verdict under $KVRAG_HOME/checks;
# with the home set only by a session fixture, that verdict went to the user's ~/.kvrag.
_OWN_HOME = not os.environ.get("KVRAG_TEST_HOME")
_HOME = os.environ.get("KVRAG_TEST_HOME") or tempfile.mkdtemp(prefix="kvrag-test-home-")
if _OWN_HOME:  # at exit, so a run that collects only (or is interrupted) leaves no home behind either
    atexit.register(shutil.rmtree, _HOME, True)
os.environ["KVRAG_HOME"] = _HOME
os.environ["KVRAG_MODEL_CACHE"] = os.environ.get("KVRAG_TEST_MODEL_CACHE") or str(Path(_HOME) / "models")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
# Tests of the reuse machinery use short chunks, some written to one pattern; the read-whole policies
# (kvrag.options.DEFAULT_MIN_RECOMPUTE, DEFAULT_SHORT_CONTEXT, DEFAULT_RECORDS_WHOLE) would answer them with
# Full Attention. Off for the session (subprocesses inherit it); the tests of the shipped defaults turn
# them back on with the `shipped_defaults` fixture.
SHORT_CONTEXT_ENV = ("KVRAG_MIN_RECOMPUTE", "KVRAG_SHORT_CONTEXT", "KVRAG_RECORDS_WHOLE")
for _name in SHORT_CONTEXT_ENV:
    os.environ[_name] = "0"
# A request that names no method gets its model's calibrated setting (kvrag.check.calibrate), measured on the
# first such request: two minutes for the bundled model, a few seconds for each tiny one. The suite keeps the
# fixed default (DEFAULT_METHOD at DEFAULT_RATIO) that its tests were written against; tests/test_calibrate.py
# turns calibration on with the `calibrated_defaults` fixture.
os.environ["KVRAG_CALIBRATE"] = "0"
# Every engine keeps finished turns' KV (kvrag.kv.prefix_cache, 1 GiB each by default); the suite keeps many
# engines alive in one process (module fixtures), so each gets a small bound here.
os.environ.setdefault("KVRAG_PREFIX_CACHE_MB", "64")


@pytest.fixture
def shipped_defaults(monkeypatch):
    """The read-whole policies as users get them (no KVRAG_MIN_RECOMPUTE, KVRAG_SHORT_CONTEXT, KVRAG_RECORDS_WHOLE)."""
    for name in SHORT_CONTEXT_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def calibrated_defaults(monkeypatch):
    """Calibration per model as users get it (no KVRAG_CALIBRATE)."""
    monkeypatch.delenv("KVRAG_CALIBRATE", raising=False)


@pytest.fixture(scope="session", autouse=True)
def kvrag_home():
    """One $KVRAG_HOME per test session for every test (gate verdicts land there, never in ~/.kvrag), and one
    model cache (the converted model), which the homes of subprocess tests share as users' homes do. Both are
    set on import (above); at the end of the session the user's own folders are compared with their snapshot
    from before collection, and any change fails the run, naming the paths."""
    yield Path(_HOME)
    failure = home_guard.verdict(_USER_PLACES, _BEFORE, _TEST_PLACES, _SEEN_AFTER) if _GUARD else None
    if failure:
        pytest.fail(failure, pytrace=False)


@pytest.fixture(autouse=True)
def _user_folders_watched(request):
    """After each test, a cheap look at the user's kvrag folders (home_guard.signature): the session's verdict
    then names the test after which a change was first seen."""
    yield
    if _GUARD:
        look = home_guard.signature(_USER_PLACES)
        if look != _LOOK[0]:
            _SEEN_AFTER.append(request.node.nodeid)
            _LOOK[0] = look


@pytest.fixture(scope="session")
def smollm(kvrag_home):
    """The real bundled SmolLM2-135M-Instruct, loaded once per session."""
    from kvrag import load_model

    return load_model()
