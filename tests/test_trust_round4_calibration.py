"""Issue 69, finding 1: the calibration file was trusted. Its checksum was a plain hash, so an edited file
with a recomputed hash choosing `reuse` became the default of `kvrag methods` and `kvrag serve`; 200,000
nested brackets stopped `kvrag serve` at start (RecursionError); a FIFO at its path hung `kvrag methods`.
Now it is read as a regular file only (no symlink, no FIFO, bounded size and depth), its `chosen` must be a
setting it records as passed, with `$KVRAG_STORE_KEY` it carries a MAC under the key, and without one a file
others may write is refused. Anything refused is measured again (logged once); the engine still starts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvrag.check import calibration_file as cfile
from kvrag.check import calibration_store as store

FP = "fp-round4"
TESTS = Path(__file__).resolve().parent


def passed_result(method: str = "a3", ratio: float = 0.3) -> dict:
    """A calibration result as calibrate.run_calibration makes one: its choice among the rows that passed."""
    name = f"{method}@{ratio:g}" if method != "full" else "full"
    return {"chosen": {"method": method, "ratio": ratio, "why": "measured"},
            "settings": [{"setting": "reuse", "method": "reuse", "ratio": 0.15, "status": "failed", "extra": 1},
                         {"setting": name, "method": method, "ratio": ratio, "status": "passed", "ape": {"scale": 1.0}}]}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.delenv(cfile.KEY_ENV, raising=False)
    return tmp_path / "models" / "calibration"


def _plant(path: Path, result: dict, device: str = "cpu", mac: str | None = None, raw: bytes | None = None) -> None:
    """What someone who can write the model cache writes: a well-formed file with the plain checksum recomputed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"result": result, "sha256": store._checksum(result)}
    if mac is not None:
        entry["mac"] = mac
    data = {"versions": store.versions(), "fingerprint": FP, "source": "m", "devices": {device: entry}}
    path.write_bytes(raw if raw is not None else json.dumps(data).encode())
    os.chmod(path, 0o644)


def test_a_sound_file_is_read_back_and_extra_fields_do_not_matter(cache):
    assert store.write_result(FP, "cpu", passed_result()) is not None
    assert store.read_result(FP, "cpu") == passed_result()
    assert store.setting_of(store.read_result(FP, "cpu")).name == "a3@0.3"
    full = passed_result("full", 0.15)
    full["settings"] = [{"setting": "reuse", "status": "failed"}]
    assert store.write_result(FP, "cuda", full) is not None
    assert store.read_result(FP, "cuda") == full and store.read_result(FP, "cpu") == passed_result()  # both kept


def test_a_planted_choice_with_a_recomputed_hash_is_refused(cache, caplog):
    planted = passed_result()
    planted["chosen"] = {"method": "reuse", "ratio": 0.15, "why": "planted"}  # reuse failed in its own rows
    _plant(store.calibration_path(FP), planted)
    with caplog.at_level(logging.DEBUG, logger="kvrag.check.calibration_store"):
        assert store.read_result(FP, "cpu") is None
        assert store.read_result(FP, "cpu") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "passed" in warnings[0].getMessage()  # logged once
    unknown = passed_result()
    unknown["chosen"] = {"method": "epic", "ratio": 0.5, "why": "never measured"}
    _plant(store.calibration_path(FP), unknown)
    assert store.read_result(FP, "cpu") is None


@pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")
def test_without_a_key_a_file_others_may_write_is_refused(cache):
    path = store.calibration_path(FP)
    _plant(path, passed_result())
    assert store.read_result(FP, "cpu") is not None
    for mode in (0o664, 0o646, 0o666):
        os.chmod(path, mode)
        assert store.read_result(FP, "cpu") is None, oct(mode)
    os.chmod(path, 0o644)
    if os.geteuid() == 0:  # owned by another user: refused as well
        os.chown(path, 65534, 65534)
        assert store.read_result(FP, "cpu") is None


def test_with_a_key_only_a_file_signed_with_it_is_read(cache, monkeypatch, caplog):
    path = store.calibration_path(FP)
    _plant(path, passed_result())  # written before the key was set: no MAC
    monkeypatch.setenv(cfile.KEY_ENV, "calibration-key-A")
    with caplog.at_level(logging.WARNING, logger="kvrag.check.calibration_store"):
        assert store.read_result(FP, "cpu") is None
    assert "no MAC" in caplog.text and "calibrating cpu again" in caplog.text  # the clear log line
    assert store.write_result(FP, "cpu", passed_result()) is not None  # measured again: signed now
    data = json.loads(path.read_text())
    assert store.read_result(FP, "cpu") == passed_result() and len(data["devices"]["cpu"]["mac"]) == 64
    # an edit that keeps every plain check (a passed row of its own, the checksum recomputed) fails the MAC
    forged = passed_result("reuse", 0.15)
    data["devices"]["cpu"]["result"] = forged
    data["devices"]["cpu"]["sha256"] = store._checksum(forged)
    path.write_text(json.dumps(data))
    assert store.read_result(FP, "cpu") is None
    store.write_result(FP, "cpu", passed_result())
    monkeypatch.setenv(cfile.KEY_ENV, "calibration-key-B")  # another key's MAC is not this one's
    assert store.read_result(FP, "cpu") is None
    monkeypatch.setenv(cfile.KEY_ENV, "calibration-key-A")
    os.chmod(path, 0o666)  # with a key the MAC decides, not the mode
    assert store.read_result(FP, "cpu") == passed_result()


def test_nested_brackets_oversize_and_a_symlink_are_refused_without_raising(cache, tmp_path):
    path = store.calibration_path(FP)
    _plant(path, {}, raw=b"[" * 200_000 + b"]" * 200_000)
    assert store.read_result(FP, "cpu") is None  # RecursionError before
    _plant(path, {}, raw=b'{"devices": ' + b"[" * 200_000)
    assert store.read_result(FP, "cpu") is None
    assert store.results_for_source("m") == {}
    _plant(path, {}, raw=b" " * (cfile.MAX_BYTES + 1))
    assert store.read_result(FP, "cpu") is None
    real = tmp_path / "elsewhere.json"
    _plant(real, passed_result())
    path.unlink()
    path.symlink_to(real)
    assert store.read_result(FP, "cpu") is None
    path.unlink()
    assert store.write_result(FP, "cpu", passed_result()) is not None  # written whole in its place
    assert store.read_result(FP, "cpu") == passed_result()


def test_a_deep_file_a_fifo_and_a_dangling_sources_list_never_stop_kvrag_methods(cache, tmp_path):
    """`kvrag methods` in a process of its own: a FIFO at the calibration's path hung it; nested brackets in
    the sources list or the calibration raised RecursionError."""
    env = {**os.environ, "KVRAG_MODEL_CACHE": str(cache.parent), "KVRAG_CALIBRATE": "1"}
    env.pop(cfile.KEY_ENV, None)
    code = textwrap.dedent("""
        from kvrag.check.calibration_store import results_for_source, read_result
        print(results_for_source('m'), read_result(%r, 'cpu'))
    """ % FP)
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "sources.json").write_text(json.dumps({"m": FP}))
    os.mkfifo(store.calibration_path(FP))
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "{} None", run.stderr[-2000:]
    assert time.monotonic() - t0 < 30
    store.calibration_path(FP).unlink()
    (cache / "sources.json").write_bytes(b"[" * 200_000)
    run = subprocess.run([sys.executable, "-c", "import sys; from kvrag.cli import main; sys.exit(main(['methods']))"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "not calibrated yet" in run.stdout, run.stderr[-2000:]
