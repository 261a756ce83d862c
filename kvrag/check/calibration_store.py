"""Where a model's calibration is kept: one JSON file per model fingerprint beside the converted models
($KVRAG_MODEL_CACHE/calibration, shared by every $KVRAG_HOME of the user), one entry per device type.

Nothing here imports torch, so `kvrag methods` reads it at once. A file is written whole to a temporary
name and renamed (a reader sees the old or the new file), and read back only if it is whole: valid JSON,
this kvrag's calibration version, set, default layout and libraries, the fingerprint it is named by, an entry whose
checksum matches and whose fields make sense. Anything else is no result: the engine calibrates again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from kvrag.defaults import DefaultSetting, model_cache_dir
from kvrag.version import __version__

log = logging.getLogger(__name__)

# Bump when what calibration measures (or how it chooses) changes: results kept by an older one are re-run.
CALIBRATION_VERSION = "1"
# The settings a calibration may choose (kvlink needs an adapter: never a calibrated default).
CHOOSABLE = ("full", "reuse", "fusionrag", "cacheblend", "epic", "a3")
SET_PATH = Path(__file__).with_name("calibration_set.json")


@functools.lru_cache(maxsize=1)
def set_digest() -> str:
    """A hash of the shipped calibration set: another set means another calibration."""
    return hashlib.sha256(SET_PATH.read_bytes()).hexdigest()[:16]


def _version_of(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def versions() -> dict[str, str]:
    """What a kept result depends on besides the model: read without importing torch."""
    from kvrag.kv.layout import LAYOUT_VERSION  # the default prompt layout the settings were measured over

    return {"calibration": CALIBRATION_VERSION, "kvrag": __version__, "set": set_digest(), "layout": LAYOUT_VERSION,
            "torch": _version_of("torch"), "transformers": _version_of("transformers")}


def calibration_dir() -> Path:
    return model_cache_dir() / "calibration"


def calibration_path(fingerprint: str) -> Path:
    if not fingerprint or not all(c.isalnum() or c in "-_" for c in fingerprint):
        raise ValueError(f"not a model fingerprint: {fingerprint!r}")  # file names come from hashes only
    return calibration_dir() / f"{fingerprint}.json"


def _checksum(result: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(result, sort_keys=True).encode()).hexdigest()


def setting_of(result: dict[str, Any]) -> DefaultSetting:
    """The default a calibration result chose (ValueError where it names none a calibration may choose)."""
    chosen = result["chosen"]
    method, ratio, why = chosen["method"], chosen["ratio"], chosen["why"]
    if method not in CHOOSABLE or not isinstance(why, str):
        raise ValueError(f"calibration chose an unknown setting: {method!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"calibration chose a ratio out of range: {ratio!r}")
    return DefaultSetting(method, float(ratio), "calibrated", why)


def _valid(result: Any) -> bool:
    try:
        setting_of(result)
        rows = result["settings"]
        return isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r.get("setting"), str) for r in rows)
    except (KeyError, TypeError, ValueError):
        return False


def read_result(fingerprint: str, device: str) -> dict[str, Any] | None:
    """The kept calibration of this model on this device type, or None (none, stale or not whole)."""
    try:
        data = json.loads(calibration_path(fingerprint).read_text(encoding="utf-8"))
        if data.get("versions") != versions() or data.get("fingerprint") != fingerprint:
            return None
        entry = data["devices"][device]
        result = entry["result"]
        if entry.get("sha256") != _checksum(result) or not _valid(result):
            log.warning("the calibration kept for %s on %s is damaged: calibrating again", fingerprint, device)
            return None
        return result
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("the calibration kept for %s is unreadable (%s): calibrating again", fingerprint, exc)
        return None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".calibration-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_result(fingerprint: str, device: str, result: dict[str, Any], source: str = "") -> Path | None:
    """Keep a calibration result (other device types' entries of the same versions stay); returns the
    file, or None where it could not be written (logged: the engine still uses the result)."""
    path = calibration_path(fingerprint)
    try:
        data: dict[str, Any] = {}
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if old.get("versions") == versions() and old.get("fingerprint") == fingerprint and isinstance(old.get("devices"), dict):
                data = old
        except (OSError, ValueError, AttributeError):
            pass
        data.update(versions=versions(), fingerprint=fingerprint, source=source)
        data.setdefault("devices", {})[device] = {"result": result, "sha256": _checksum(result)}
        _write_json(path, data)
        if source:
            _remember_source(source, fingerprint)
        return path
    except OSError as exc:
        log.warning("could not keep the calibration at %s: %s", path, exc)
        return None


def _sources_path() -> Path:
    return calibration_dir() / "sources.json"


def _remember_source(source: str, fingerprint: str) -> None:
    """Which fingerprint a model source was last calibrated as, so `kvrag methods` finds it unloaded."""
    try:
        known = json.loads(_sources_path().read_text(encoding="utf-8"))
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known[source] = fingerprint
    _write_json(_sources_path(), known)


def results_for_source(source: str) -> dict[str, dict[str, Any]]:
    """The calibrations last kept for a model source (its name as the engine loaded it), per device
    type, current ones only: {} where there is none."""
    try:
        fingerprint = json.loads(_sources_path().read_text(encoding="utf-8"))[source]
        data = json.loads(calibration_path(fingerprint).read_text(encoding="utf-8"))
        devices = data.get("devices", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    found = {}
    for device in devices:
        result = read_result(fingerprint, device)
        if result is not None:
            found[device] = result
    return found

