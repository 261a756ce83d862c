"""The default an engine gives a request that names no method: its model's calibration (kvrag.check.calibrate),
run once per model fingerprint and device type, kept on disk for every later process
(kvrag.check.calibration_store) and in memory for this one. `calibrate=False` on the engine, or
$KVRAG_CALIBRATE=0 for a deployment, keeps the fixed DEFAULT_METHOD at DEFAULT_RATIO instead."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from kvrag.check.calibration_store import read_result, setting_of, write_result
from kvrag.defaults import FIXED_DEFAULT, DEFAULT_RATIO, DefaultSetting
from kvrag.model.loading import LoadedModel

log = logging.getLogger(__name__)

_LOCK = threading.Lock()  # one calibration at a time in a process; callers waiting on it then read its result
_CHOSEN: dict[tuple[str, str, str], DefaultSetting] = {}  # (model fingerprint, device type, link adapter digest or '')


def calibration_enabled(option: bool | None = None) -> bool:
    """The engine's `calibrate` option, else $KVRAG_CALIBRATE (1 or 0), else on."""
    if option is not None:
        return bool(option)
    env = os.environ.get("KVRAG_CALIBRATE", "").strip().lower()
    if env in ("", "1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"KVRAG_CALIBRATE must be 1 or 0, got {env!r}")


def default_for(lm: LoadedModel, calibrate: bool | None = None, *, wait: bool = True, adapter: Any = None) -> DefaultSetting | None:
    """The default setting for this model: calibrated (kept result, else a run now), or the fixed one when
    calibration is off. `wait=False` never runs nor waits for a calibration: None where none is kept yet
    (what /health asks). `adapter`: the engine's link adapter where it reads the base chunk KV (else None):
    a calibration run here measures kvlink with it, and a kept result that chose kvlink with another
    adapter gives the best setting that needs none."""
    if not calibration_enabled(calibrate):
        return FIXED_DEFAULT
    digest = adapter.digest() if adapter is not None else ""
    key = (lm.fingerprint, lm.device.type, digest)
    if key in _CHOSEN:
        return _CHOSEN[key]
    if not _LOCK.acquire(blocking=wait):
        return None  # another thread is calibrating this process's model right now
    try:
        if key not in _CHOSEN:
            result = read_result(lm.fingerprint, lm.device.type)
            if result is None:
                if not wait:
                    return None
                _CHOSEN[key] = _calibrated(lm, adapter)
            else:
                _CHOSEN[key] = setting_of(result, digest)
        return _CHOSEN[key]
    finally:
        _LOCK.release()


def _calibrated(lm: LoadedModel, adapter: Any = None) -> DefaultSetting:
    try:
        setting, _ = calibrate_model(lm, progress=log.info, adapter=adapter)
        return setting
    except Exception as exc:  # noqa: BLE001 (a calibration that cannot run must not stop answers)
        log.warning("calibrating %s failed (%s): requests that name no method get Full Attention", lm.source, exc)
        return DefaultSetting("full", DEFAULT_RATIO, "calibrated", f"calibration failed ({type(exc).__name__}): Full Attention")


def calibrate_model(lm: LoadedModel, progress: Callable[[str], None] | None = None,
                    adapter: Any = None) -> tuple[DefaultSetting, dict[str, Any]]:
    """Run the calibration afresh (`kvrag check-model --calibrate`), keep it, and make it this process's default
    (for engines with this link adapter, or with none: `default_for`)."""
    from kvrag.check.calibrate import run_calibration

    log.info("calibrating the default setting for %s on %s (once per model; kept beside the converted models)", lm.source, lm.device.type)
    result = run_calibration(lm, progress=progress, adapter=adapter)
    write_result(lm.fingerprint, lm.device.type, result, source=str(lm.source))
    digest = adapter.digest() if adapter is not None else ""
    for key in [k for k in _CHOSEN if k[:2] == (lm.fingerprint, lm.device.type)]:
        del _CHOSEN[key]  # every engine of this model reads the new result
    setting = setting_of(result, digest)
    _CHOSEN[(lm.fingerprint, lm.device.type, digest)] = setting
    log.info("default for %s: %s", lm.source, setting.note())
    return setting, result


def forget_in_process() -> None:
    """Drop this process's memory of chosen defaults (tests: a second process is simulated this way)."""
    _CHOSEN.clear()
