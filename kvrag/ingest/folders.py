"""Walking a folder for documents without leaving it: symlinks that lead out are not followed unless asked."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Collection, NamedTuple

__all__ = ["SkippedPath", "walk_folder"]


class SkippedPath(NamedTuple):
    """A path a folder walk left out: a symlink not followed (`symlink`), a file of a type not ingested
    (`unsupported`), or what could not be read or is no regular file (a FIFO, a socket, a device)."""

    path: Path
    reason: str
    symlink: bool
    unsupported: bool = False


def _special(mode: int) -> str:
    """What a path that is no regular file or folder is, in words."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _what(real: str) -> str:
    try:
        return _special(os.stat(real).st_mode)
    except OSError:
        return "missing (a broken link)"


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def walk_folder(
    folder: Path, suffixes: Collection[str], follow_symlinks: bool = False, skipped: list[SkippedPath] | None = None
) -> list[Path]:
    """Regular files below `folder` whose suffix (lower-cased) is in `suffixes`, recursively, in a
    stable order; hidden entries skipped.

    A symlink whose target is outside `folder` (a file or a folder) is not followed unless
    `follow_symlinks`; it is added to `skipped` with the reason. A link to a folder inside `folder` is
    not followed either (its files are found where they are); with `follow_symlinks` every link is
    followed, each real folder walked once. A FIFO, socket or device with a supported suffix (never
    opened: a FIFO would block), and every file of an unsupported type, are added to `skipped` too,
    so the caller can name everything it leaves out.
    """
    root = os.path.realpath(folder)
    found: list[Path] = []
    walked = {root}

    def note(path: Path, why: str, symlink: bool = False, unsupported: bool = False) -> None:
        if skipped is not None:
            skipped.append(SkippedPath(path, why, symlink, unsupported))

    def walk(d: Path) -> None:
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            note(d, f"cannot be listed ({e.strerror or e})")
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            path = Path(e.path)
            supported = path.suffix.lower() in suffixes
            try:
                if e.is_symlink():
                    real = os.path.realpath(path)
                    is_dir = os.path.isdir(real)
                    if not follow_symlinks:
                        if not _inside(real, root) and (is_dir or supported):
                            note(path, f"a symlink to {real}, outside {folder} (not followed without --follow-symlinks)", symlink=True)
                        elif supported and not is_dir and os.path.isfile(real):
                            found.append(path)
                        elif supported and not is_dir:
                            note(path, f"a symlink to {real}, which is {_what(real)}")
                        elif not is_dir:
                            note(path, "unsupported type", unsupported=True)
                        continue
                    if is_dir:
                        if real not in walked:
                            walked.add(real)
                            walk(path)
                    elif supported and os.path.isfile(real):
                        found.append(path)
                    elif supported:
                        note(path, f"a symlink to {real}, which is {_what(real)}")
                    else:
                        note(path, "unsupported type", unsupported=True)
                elif e.is_dir(follow_symlinks=False):
                    real = os.path.realpath(path)
                    if real not in walked:
                        walked.add(real)
                        walk(path)
                elif supported and e.is_file(follow_symlinks=False):
                    found.append(path)
                elif supported:
                    note(path, f"{_special(e.stat(follow_symlinks=False).st_mode)}, not a regular file")
                else:
                    note(path, "unsupported type", unsupported=True)
            except OSError as exc:
                note(path, f"cannot be read ({exc.strerror or exc})")
    walk(folder)
    return sorted(found)
