"""A disk store that a tool makes for one run and removes afterwards, and nothing else.

Why: `kvrag bench` (and `bench speed`, `eval suite`) removed whatever was at OUT/kv with `rmtree` when
they finished, whether or not the run had made it: a user's files there went with it, and with OUT/kv
a symlink the message said "removed" while nothing was. Now a run marks the folder it creates
(`mark_created`: a marker file, written only into a folder it has just made or marked before), and
`remove_created` removes only a marked folder, file by file through the store's own walk (entries,
temp files, id refs: names the store makes, regular files only, no symlink followed), then the
empty folders; whatever else is there stays and is reported, and a symlink is never followed.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

MARKER = ".kvrag-created-store"
_HEX = set("0123456789abcdef")


def _marked(root: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(root / MARKER).st_mode) and not root.is_symlink()
    except OSError:
        return False


def mark_created(root: str | os.PathLike, by: str) -> bool:
    """Make `root` a new store folder marked as made by `by` (e.g. "kvrag bench"); True when it is one
    (made now, or marked by an earlier run: a stopped run's store to resume from). False, marking
    nothing, when something else is there already (a folder of the user's, a symlink, a file)."""
    root = Path(root)
    if os.path.lexists(root):
        return _marked(root)
    root.mkdir(parents=True)
    with open(root / MARKER, "x", encoding="utf-8") as f:
        json.dump({"created_by": by, "pid": os.getpid(), "time": time.time()}, f)
    return True


@dataclass
class Removal:
    """What `remove_created` did: files and bytes removed, what it left (and why it left everything, if so)."""

    removed_files: int = 0
    removed_bytes: int = 0
    left: list[str] = field(default_factory=list)  # paths under the folder that are not the store's
    refused: str | None = None  # why nothing was removed: a symlink, no marker, not there


def _unlink_regular(path: str, out: Removal) -> None:
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            os.unlink(path)
            out.removed_files += 1
            out.removed_bytes += st.st_size
    except FileNotFoundError:
        pass


def _own_refs(index: Path) -> list[str]:
    """Ref files (`<xx>/<64 hex>.ref`, regular) under index/, shard folders not followed through a symlink."""
    out = []
    try:
        shards = list(os.scandir(index))
    except FileNotFoundError:
        return out
    for d in shards:
        if len(d.name) == 2 and set(d.name) <= _HEX and d.is_dir(follow_symlinks=False):
            out += [f.path for f in os.scandir(d.path)
                    if f.name.endswith(".ref") and len(f.name) == 68 and set(f.name[:64]) <= _HEX and f.is_file(follow_symlinks=False)]
    return out


def remove_created(root: str | os.PathLike) -> Removal:
    """Remove a store folder `mark_created` made (see the module docstring); anything not the store's
    is left where it is and listed in `left`."""
    from .disk import DiskStore  # the store's own walk

    root = Path(root)
    out = Removal()
    if root.is_symlink():
        out.refused = "it is a symlink (not followed)"
        return out
    if not root.is_dir():
        out.refused = "it is not there" if not os.path.lexists(root) else "it is not a folder"
        return out
    if not _marked(root):
        out.refused = f"this run did not create it (no {MARKER} in it)"
        return out
    store = DiskStore(root, max_bytes=None, clean_temp=False, warn_unsigned=False)
    for e in store._walk() + store._walk(temp=True):
        _unlink_regular(e.path, out)
    for path in _own_refs(root / "index"):
        _unlink_regular(path, out)
    for top in ("entries", "index"):  # empty shard folders, deepest first; rmdir never follows a symlink
        for dirpath, dirnames, _ in sorted(os.walk(root / top, followlinks=False), key=lambda w: -len(w[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        names = filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        out.left += [os.path.join(dirpath, n) for n in names if not (dirpath == str(root) and n == MARKER)]
    if out.left:  # the marker stays: a later run into the same folder removes its own store again
        return out
    _unlink_regular(str(root / MARKER), out)
    try:
        os.rmdir(root)
    except OSError as exc:
        out.left.append(f"{root} ({exc.strerror or exc})")
    return out
