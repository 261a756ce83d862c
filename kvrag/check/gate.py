"""The engine's gate: the checks' verdict kept per model fingerprint and device type under $KVRAG_HOME/checks, run once and reused until the engine code, the libraries or the settings change."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvrag.check.checks import run_checks
from kvrag.check.report import CheckReport
from kvrag.defaults import kvrag_home
from kvrag.model.loading import LoadedModel, context_limits, text_config
from kvrag.version import __version__

log = logging.getLogger(__name__)

# Bump when what the gate checks (or how) changes: verdicts cached by an older gate are re-run.
CHECK_VERSION = "2"  # 2: tolerances scale with the model's own measured noise


@functools.lru_cache(maxsize=1)
def _engine_digest() -> str:
    """A hash of the engine code the checks exercise: editing it invalidates every cached verdict."""
    import importlib

    h = hashlib.sha256()
    for name in ("kvrag.model.cache", "kvrag.check.checks", "kvrag.check.noise", "kvrag.engine", "kvrag.fuse.stitch", "kvrag.kv.layout", "kvrag.model.loading", "kvrag.kv.precompute", "kvrag.model.rope"):
        try:
            h.update(Path(importlib.import_module(name).__file__ or "").read_bytes())
        except OSError:
            h.update(name.encode())
    return h.hexdigest()[:16]


def _versions() -> dict[str, str]:
    import transformers


    return {
        "check": CHECK_VERSION,
        "kvrag": __version__,
        "engine": _engine_digest(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }


def verdict_path(fingerprint: str, home: str | os.PathLike | None = None) -> Path:
    return Path(home or kvrag_home()).expanduser() / "checks" / f"{fingerprint}.json"


def _settings(lm: LoadedModel) -> dict[str, Any]:
    """What shapes the verdict beyond the fingerprint (which covers weights, shapes, rope and dtype)."""
    cfg = text_config(lm.model)
    return {
        "attn_implementation": str(getattr(lm.model.config, "_attn_implementation", None)),
        "context_limits": {k: v[0] for k, v in context_limits(lm.model).items()},
        "layer_types": sorted(set(getattr(cfg, "layer_types", None) or [])),
    }


def _read_verdict(path: Path, lm: LoadedModel) -> CheckReport | None:
    try:
        data = json.loads(path.read_text())
        if data.get("versions") != _versions():
            return None
        found = data.get("verdicts", {}).get(lm.device.type)
        if not found or found.get("settings") != _settings(lm):
            return None
        return CheckReport.from_dict(found["report"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_verdict(path: Path, report: CheckReport, lm: LoadedModel) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data: dict[str, Any] = {}
        try:
            old = json.loads(path.read_text())
            if old.get("versions") == _versions():
                data = old
        except (OSError, ValueError):
            pass
        data["versions"] = _versions()
        data["fingerprint"] = report.fingerprint
        data.setdefault("verdicts", {})[report.device] = {"settings": _settings(lm), "report": report.to_dict()}
        fd, tmp = tempfile.mkstemp(prefix=".check-", suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
    except OSError as exc:
        log.warning("could not keep the model check verdict at %s: %s", path, exc)


def gate(lm: LoadedModel, home: str | os.PathLike | None = None, *, refresh: bool = False) -> CheckReport:
    """The engine's gate: the cached verdict for this fingerprint and device type, or run the checks
    once and cache it; raises UnsupportedModelError (naming the failing checks) if they fail."""
    path = verdict_path(lm.fingerprint, home)
    report = None if refresh else _read_verdict(path, lm)
    if report is None:
        report = run_checks(lm)
        _write_verdict(path, report, lm)
        log.info("model check for %s: %s in %.2f s", lm.source, "passed" if report.passed else "FAILED", report.seconds)
    return report.raise_if_failed()
