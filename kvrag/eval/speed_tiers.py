"""Which store tier a speed row's KV comes from: hot, warm, cold, and cold from the device.

`kvrag bench speed` times reuse from each tier of the CUDA default stack (GPU | pinned host | disk;
memory | host | disk on the CPU, the same shape): before each timed prefill the tiers above the one
asked for are emptied, so every chunk comes from that tier and is promoted on the way up, as after a
restart. "device" is "cold" with the entry files' cached pages dropped as well
(`posix_fadvise(DONTNEED)`), so the read comes from the device. A tier that cannot be arranged (no
such tier in the store, an upper tier that cannot be emptied, a filesystem whose files live in RAM)
is left out with a note. Each row names the tier asked for, its store, and the tiers that served the
prefill: an upper tier smaller than the context serves part of it, and the row says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from kvrag.cache_backends import DEFAULT_MEMORY_BYTES, default_disk_url, default_store_url

TIERS = ("hot", "warm", "cold", "device")
TIER_WORDS = {
    "hot": "hot",
    "warm": "warm",
    "cold": "cold, page cache warm",
    "device": "cold, from the device",
}
RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


def parse_tiers(spec: str, store_given: bool) -> tuple[str, ...]:
    """`--tiers`: auto (every tier on the default stack, none with a store of one's own), none, or a
    comma-separated list of hot, warm, cold, device."""
    spec = spec.strip().lower()
    if spec == "auto":
        return () if store_given else TIERS
    if spec in ("", "none"):
        return ()
    out = tuple(dict.fromkeys(t.strip() for t in spec.split(",") if t.strip()))
    unknown = [t for t in out if t not in TIERS]
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}: choose from {', '.join(TIERS)}, auto or none")
    return out


def tier_stack_url(root: str | Path, device: str | torch.device) -> str:
    """The CUDA default stack over `root` (cache_backends.default_store_url); on the CPU the same shape,
    memory | host | disk, so every tier a GPU user reads from is timed here too."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return default_store_url(root, dev)
    return f"tiered://?tiers=memory://?max_bytes={DEFAULT_MEMORY_BYTES}|host://|{default_disk_url(root)}"


def filesystem(path: str | Path) -> str | None:
    """The filesystem type holding `path` (Linux: /proc/self/mounts), None where unknown."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = str(Path(path).resolve()), -1, None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), parts[2]
    return kind


@dataclass
class TierPlan:
    """Where each tier asked for sits in the store: its level, its store's name, and why others cannot be timed."""

    levels: dict[str, int] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def plan_tiers(store: Any, asked: Sequence[str]) -> TierPlan:
    """Which of `asked` this store can serve a prefill from (see the module docstring)."""
    plan = TierPlan()
    tiers, names = list(getattr(store, "tiers", []) or []), list(getattr(store, "names", []) or [])
    if not asked:
        return plan
    if len(tiers) < 2:
        plan.notes.append(f"store {getattr(store, 'url', store)} has no tiers: per-tier rows left out")
        return plan
    n = len(tiers)
    where = {"hot": 0, "warm": 1 if n >= 3 else None, "cold": n - 1, "device": n - 1}
    for tier in asked:
        level = where[tier]
        if level is None:
            plan.notes.append(f"{tier}: the store has no middle tier")
            continue
        stuck = [names[i] for i in range(level) if not callable(getattr(tiers[i], "clear", None))]
        if stuck:
            plan.notes.append(f"{tier}: tier(s) {', '.join(stuck)} above it cannot be emptied")
            continue
        if tier == "device":
            bottom = tiers[-1]
            if not callable(getattr(bottom, "drop_page_cache", None)) or not hasattr(os, "posix_fadvise"):
                plan.notes.append(f"device: the {names[-1]} tier's cached pages cannot be dropped here")
                continue
            fs = filesystem(getattr(bottom, "root", "."))
            if fs in RAM_FILESYSTEMS:
                plan.notes.append(f"device: the store's files are on {fs} (in RAM): there is no device to read from")
                continue
        plan.levels[tier], plan.names[tier] = level, names[level]
    return plan


def arrange(store: Any, plan: TierPlan, tier: str | None) -> None:
    """Before a timed prefill: empty the tiers above `tier`'s (untimed); for "device" drop the files'
    cached pages too. None: leave the store as it is."""
    if tier is None:
        return
    level = plan.levels[tier]
    for t in store.tiers[:level]:
        t.clear()
    if tier == "device":
        store.tiers[-1].drop_page_cache()


def served(tiers: Mapping[str, int]) -> str:
    """How a prefill's chunks were served, e.g. "disk" or "gpu 30 + host 34" ("–": nothing loaded)."""
    items = [(k, v) for k, v in tiers.items() if v]
    if not items:
        return "–"
    if len(items) == 1:
        return items[0][0]
    return " + ".join(f"{k} {v}" for k, v in items)


def kv_from(row: Mapping[str, Any]) -> str:
    """The markdown's "KV from" cell: the tier asked for and its store, and what served the prefill
    when that differs (an upper tier too small for the context)."""
    if row.get("method") == "full":
        return "– (computed)"
    if row.get("full_reason"):
        return f"– (read whole: {row['full_reason']})"
    got = served(row.get("served") or {})
    tier = row.get("tier")
    if tier is None:
        return got
    store = row.get("store") or "?"
    text = f"{store} ({TIER_WORDS.get(tier, tier)})"
    return text if got in (store, "–") else f"{text}; served {got}"
