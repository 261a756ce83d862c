import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
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
def kvrag_home(tmp_path_factory):
    """One $KVRAG_HOME per test session for every test (gate verdicts land there, never in ~/.kvrag), and one
    model cache (the converted model), which the homes of subprocess tests share as users' homes do."""
    home = os.environ.get("KVRAG_TEST_HOME") or str(tmp_path_factory.mktemp("kvrag_home"))
    os.environ["KVRAG_HOME"] = home
    os.environ["KVRAG_MODEL_CACHE"] = os.environ.get("KVRAG_TEST_MODEL_CACHE") or str(Path(home) / "models")
    return Path(home)


@pytest.fixture(scope="session")
def smollm(kvrag_home):
    """The real bundled SmolLM2-135M-Instruct, loaded once per session."""
    from kvrag import load_model

    return load_model()
