"""Where a model's calibration is kept: one JSON file per model fingerprint beside the converted models
($KVRAG_MODEL_CACHE/calibration, shared by every $KVRAG_HOME of the user), one entry per device type.

Nothing here imports torch, so `kvrag methods` reads it at once. A file is written whole to a temporary
name and renamed (a reader sees the old or the new file), and read back only if it is whole: valid JSON,
this kvrag's calibration version, set, default layout and libraries, the fingerprint it is named by, an entry whose
checksum matches and whose fields make sense, whose chosen setting is one it records as passed, and (with
`$KVRAG_STORE_KEY` set) whose MAC under the key matches. It is read only as a regular file of bounded size
and JSON depth, and without a key only when no one but its owner (this user) may write it
(kvrag.check.calibration_file). Anything else is no result, logged once: the engine calibrates again.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from kvrag.check import calibration_file as cfile
from kvrag.defaults import Ape, DefaultSetting, model_cache_dir
from kvrag.version import __version__

log = logging.getLogger(__name__)

# Bump when what calibration measures (or how it chooses) changes: results kept by an older one are re-run.
CALIBRATION_VERSION = "3"  # 2: the rule keeps Full's right answers; APE settings among the candidates; 3: kvlink with the adapter
# The settings a calibration may choose; kvlink only with the link adapter it was measured with (`adapter` in the result).
CHOOSABLE = ("full", "reuse", "fusionrag", "cacheblend", "epic", "a3", "kvlink")
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


def setting_of(result: dict[str, Any], adapter: str | None = None) -> DefaultSetting:
    """The default a calibration result chose (ValueError where it names none a calibration may choose).

    `adapter`: the digest of the engine's link adapter ("" for none). Where the result chose kvlink with an
    adapter other than the engine's, the engine gets the best setting that needs no adapter (`fallback`).
    None: as chosen (what `kvrag methods` shows for an engine with the shipped adapter)."""
    chosen = result["chosen"]
    if chosen.get("method") == "kvlink" and adapter is not None and adapter != adapter_of(result):
        chosen = result["fallback"]
    return _setting(chosen)


def adapter_of(result: dict[str, Any]) -> str:
    """The digest of the link adapter a calibration measured kvlink with ('' where none)."""
    record = result.get("adapter")
    return str(record.get("digest", "")) if isinstance(record, dict) else ""


def _setting(chosen: dict[str, Any]) -> DefaultSetting:
    method, ratio, why = chosen["method"], chosen["ratio"], chosen["why"]
    if method not in CHOOSABLE or not isinstance(why, str):
        raise ValueError(f"calibration chose an unknown setting: {method!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"calibration chose a ratio out of range: {ratio!r}")
    ape = chosen.get("ape")
    if ape is not None:  # APE's temperature and scale (kvrag.check.ape_search); Ape checks their range
        if not isinstance(ape, dict) or set(ape) != {"temperature", "scale"}:
            raise ValueError(f"calibration chose a malformed APE setting: {ape!r}")
        ape = Ape(ape["temperature"], ape["scale"])
    return DefaultSetting(method, float(ratio), "calibrated", why, ape)


def _passed(result: dict[str, Any], setting: DefaultSetting) -> bool:
    """Whether the result records its chosen setting among the candidates that passed (Full Attention needs
    none): a `chosen` naming an unknown, failed or unmeasured setting is refused. A row matches by its
    setting's name or by its method and ratio; fields it has besides these do not matter."""
    if setting.method == "full":
        return True
    for row in result["settings"]:
        if not isinstance(row, dict) or row.get("status") != "passed":
            continue
        if row.get("setting") == setting.name:
            return True
        ratio = row.get("ratio")
        if (row.get("method") == setting.method and isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                and float(ratio) == setting.ratio):
            return True
    return False


def _valid(result: Any) -> bool:
    try:
        setting = setting_of(result)
        rows = result["settings"]
        ok = (isinstance(rows, list) and all(isinstance(r, dict) and isinstance(r.get("setting"), str) for r in rows)
              and _passed(result, setting))
        if setting.method == "kvlink":  # chosen with an adapter: the choice without one must be sound too, and need none
            fallback = _setting(result["fallback"])
            ok = ok and bool(adapter_of(result)) and fallback.method != "kvlink" and _passed(result, fallback)
        return ok
    except (KeyError, TypeError, ValueError, AttributeError):
        return False


def _why_not(data: Any, fingerprint: str, device: str, secret: bytes | None) -> str | None:
    """Why this file's entry for `device` is not this model's current calibration, or None where it is."""
    if not isinstance(data, dict) or data.get("versions") != versions() or data.get("fingerprint") != fingerprint:
        return "stale"  # another kvrag, set, layout or library: measured again, as always
    devices = data.get("devices")
    entry = devices.get(device) if isinstance(devices, dict) else None
    if not isinstance(entry, dict):
        return "stale"
    result = entry.get("result")
    if not isinstance(result, dict) or entry.get("sha256") != _checksum(result):
        return "its checksum does not match: damaged or edited"
    if secret is not None:
        mac = entry.get("mac")
        if not isinstance(mac, str):
            return "it carries no MAC under $KVRAG_STORE_KEY (written without the key)"
        want = cfile.file_mac(secret, fingerprint, device, data["versions"], result)
        if not hmac.compare_digest(mac.encode("utf-8", "surrogatepass"), want.encode()):
            return "its MAC under $KVRAG_STORE_KEY is wrong: edited, or signed with another key"
    if not _valid(result):
        return "its chosen setting is not one it records as passed, or its fields make no sense"
    return None


def read_result(fingerprint: str, device: str) -> dict[str, Any] | None:
    """The kept calibration of this model on this device type, or None (none, stale, not whole, not
    signed by the store key when there is one, not safely readable: see kvrag.check.calibration_file).
    Never raises: a file that cannot be trusted is measured again (logged once), the engine still starts."""
    path = calibration_path(fingerprint)
    secret = cfile.store_key()
    try:
        data = cfile.read_json(path, strict=secret is None)
    except FileNotFoundError:
        return None
    except (cfile.Refused, OSError, ValueError, RecursionError, MemoryError) as exc:
        cfile.tell_once(path, str(exc) or type(exc).__name__)
        return None
    try:
        why = _why_not(data, fingerprint, device, secret)
    except Exception as exc:  # noqa: BLE001 (whatever a hostile file holds: measured again)
        why = f"unreadable ({type(exc).__name__})"
    if why is None:
        return data["devices"][device]["result"]
    if why != "stale":
        cfile.tell_once(path, why, f"calibrating {device} again (the new result is {'signed' if secret else 'kept'})")
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
        secret = cfile.store_key()
        try:  # other device types' entries are kept only where this reader would trust them
            old = cfile.read_json(path, strict=secret is None)
            if old.get("versions") == versions() and old.get("fingerprint") == fingerprint and isinstance(old.get("devices"), dict):
                data = {**old, "devices": {d: e for d, e in old["devices"].items()
                                           if d != device and _why_not(old, fingerprint, d, secret) is None}}
        except (OSError, ValueError, AttributeError, RecursionError, TypeError, KeyError):
            pass
        data.update(versions=versions(), fingerprint=fingerprint, source=source)
        entry: dict[str, Any] = {"result": result, "sha256": _checksum(result)}
        if secret is not None:
            entry["mac"] = cfile.file_mac(secret, fingerprint, device, data["versions"], result)
        data.setdefault("devices", {})[device] = entry
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
        known = cfile.read_json(_sources_path(), strict=cfile.store_key() is None)
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError, RecursionError):
        known = {}
    known[source] = fingerprint
    _write_json(_sources_path(), known)


def results_for_source(source: str) -> dict[str, dict[str, Any]]:
    """The calibrations last kept for a model source (its name as the engine loaded it), per device
    type, current ones only: {} where there is none."""
    try:
        strict = cfile.store_key() is None
        fingerprint = cfile.read_json(_sources_path(), strict)[source]
        data = cfile.read_json(calibration_path(fingerprint), strict)
        devices = data.get("devices", {}) if isinstance(data, dict) else {}
        devices = devices if isinstance(devices, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}
    found = {}
    for device in devices:
        result = read_result(fingerprint, device)
        if result is not None:
            found[device] = result
    return found

