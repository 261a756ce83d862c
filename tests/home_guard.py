"""The suite's guard on the user's own kvrag folders (issue 70, item 8): what a test run may never touch.

A test once wrote a gate verdict into the user's ~/.kvrag/checks: a test module built an engine at import,
during collection, before the session fixture gave the suite its own $KVRAG_HOME. tests/conftest.py now sets
that home when it is imported, and snapshots these folders then too (before collection), so the comparison at
the end of the session catches a write made at any point of the run, collection included.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

# (st_mtime_ns, st_size) per path under a guarded folder; a folder that does not exist is an empty snapshot
Snapshot = dict[str, tuple[int, int]]
OFF_ENV = "KVRAG_TEST_HOME_GUARD"  # "0": no guard (a kvrag of your own writing to ~/.kvrag while the suite runs)


def user_places(env: Mapping[str, str], test_places: Iterable[str | None] = ()) -> list[Path]:
    """The user's kvrag folders as `env` (the environment before conftest changes it) names them: ~/.kvrag,
    $KVRAG_HOME, and the model cache ($KVRAG_MODEL_CACHE, else $XDG_CACHE_HOME or ~/.cache, /kvrag/models, as
    kvrag.defaults.model_cache_dir). Folders the suite is told to use (KVRAG_TEST_HOME, KVRAG_TEST_MODEL_CACHE)
    are the user's choice to share and are left out."""
    home = Path(env.get("HOME") or Path.home()).expanduser()
    cache = env.get("KVRAG_MODEL_CACHE") or Path(env.get("XDG_CACHE_HOME") or home / ".cache") / "kvrag" / "models"
    places = [home / ".kvrag", Path(cache)]
    if env.get("KVRAG_HOME"):
        places.append(Path(env["KVRAG_HOME"]))
    allowed = [_real(Path(p)) for p in test_places if p]
    out: list[Path] = []
    for p in places:
        real = _real(p.expanduser())
        if real not in out and not any(real.is_relative_to(a) for a in allowed):
            out.append(real)
    return out


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def snapshot(places: Iterable[Path], skip: Iterable[str | None] = ()) -> Snapshot:
    """Every folder and file under `places` (symlinks not followed) with its modification time and size;
    folders in `skip` (the suite's own, should one lie inside a guarded folder) are not looked into."""
    seen: Snapshot = {}
    skipped = {str(_real(Path(s))) for s in skip if s}
    for root in places:
        if not root.exists():
            continue
        for folder, dirs, files in os.walk(root, followlinks=False):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in skipped]
            for name in [*dirs, *files, ""]:
                path = os.path.join(folder, name) if name else folder
                try:
                    st = os.lstat(path)
                except OSError:  # gone between the listing and the look: not ours to judge here
                    continue
                seen[path] = (st.st_mtime_ns, st.st_size)
    return seen


def changes(before: Snapshot, after: Snapshot) -> list[str]:
    """What differs, one line per path: created, deleted or modified."""
    lines = [f"created  {p}" for p in sorted(after.keys() - before.keys())]
    lines += [f"deleted  {p}" for p in sorted(before.keys() - after.keys())]
    lines += [f"modified {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return lines


def signature(places: Iterable[Path]) -> Snapshot:
    """A cheap look, taken after every test: the guarded folders and the folders directly in them (a file made,
    replaced or deleted in a folder changes that folder's time), so a change can be pinned to the test after which
    it was first seen. The snapshot at the end is what decides; this only names where to look."""
    seen: Snapshot = {}
    for root in places:
        for path in [root, *(root.iterdir() if root.is_dir() else ())]:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            seen[str(path)] = (st.st_mtime_ns, st.st_size)
    return seen


def verdict(places: list[Path], before: Snapshot, skip: Iterable[str | None] = (), seen_after: Iterable[str] = ()) -> str | None:
    """None when nothing under `places` changed since `before`; else the failure message, naming the paths (and the
    tests after which a change was first seen, `seen_after`)."""
    found = changes(before, snapshot(places, skip))
    if not found:
        return None
    shown = "\n  ".join(found[:30]) + (f"\n  ... and {len(found) - 30} more" if len(found) > 30 else "")
    tests = list(dict.fromkeys(seen_after))
    where = ("\nfirst seen after: " + ", ".join(tests[:10])) if tests else ""
    return (f"the test run changed the user's own kvrag folders ({', '.join(map(str, places))}); tests must write only "
            f"under their own $KVRAG_HOME ({os.environ.get('KVRAG_HOME')}) and temporary folders:\n  {shown}{where}\n"
            f"(if a kvrag of your own, not the suite, wrote there during the run, rerun, or set {OFF_ENV}=0)")
