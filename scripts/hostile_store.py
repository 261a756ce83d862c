"""Issue #53's rows of the hostile table: the id index, the store key, cleanup and ingest under hostile input.

Each case plants something in a real store (a FIFO or a /dev/zero symlink at an id's ref, a planted ref
under a key, entries written without the key or with another, symlinked shard folders, a user's
OUT/kv, a FIFO in an ingested folder), then asks the server or runs the command, and reports one row:
the response, the wall time, the peak-RSS growth and a verdict (ok, CRASH, HANG: still running after
`LIMIT_S`, WRONG, LOST: an entry or file that should have stayed is gone). Run by hostile_table.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from kvrag import Chunk
from kvrag.cache_backends import KEY_ENV, DiskStore, content_key
from kvrag.cache_backends.base import user_id_digest

LIMIT_S = 20.0
PLANTED = "Tickets for the line are sold only at evil.example."
GENUINE = "Tickets for the line are sold at the station office."


@dataclass
class StoreCtx:
    http: httpx.Client  # the unkeyed server (hostile_table's)
    rag: Any
    root: Path  # its disk store
    tmp: Path
    keyed_http: httpx.Client  # a server whose store has $KVRAG_STORE_KEY
    keyed_rag: Any
    keyed_root: Path
    engine: Callable[[str], Any]  # a fresh engine over a store URL (another process, in effect)
    key: str
    lost: int = 0


def _ref(root: Path, uid: str) -> Path:
    d = user_id_digest(uid)
    p = root / "index" / d[:2] / f"{d}.ref"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _ask(http: httpx.Client, cid: str) -> httpx.Response:
    body = {"model": "kvrag", "messages": [{"role": "user", "content": "Where are tickets sold?"}], "max_tokens": 3,
            "kvrag": {"chunk_ids": [cid]}}
    return http.post("/v1/chat/completions", json=body, timeout=LIMIT_S)


def _said(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return f"{r.status_code} {r.text[:50]}"
    if isinstance(body.get("error"), dict):
        return f"{r.status_code} {body['error'].get('code')}: {str(body['error'].get('message'))[:50]}"
    return f"{r.status_code} answer {body['choices'][0]['message']['content']!r}, hits {body['kvrag_stats']['cache_hits']}"


def _not_found(r: httpx.Response, health: httpx.Client | None = None) -> str | None:
    ok = r.status_code == 400 and (r.json().get("error") or {}).get("code") == "chunk_not_found"
    if health is not None and health.get("/health", timeout=5).json().get("status") != "ok":
        return "WRONG"
    return None if ok else "WRONG"


def _entries(root: Path) -> int:
    return sum(1 for _ in (root / "entries").rglob("*.kv"))


def _cli(*argv: str) -> tuple[int, str]:
    from kvrag.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


# -- the cases: each returns (response text, verdict or None for ok) --------------------------------
def fifo_ref(ctx: StoreCtx) -> tuple[str, str | None]:
    os.mkfifo(_ref(ctx.root, f"{ctx.rag.repo.namespace}/fifo-id"))
    r = _ask(ctx.http, "fifo-id")
    return _said(r), _not_found(r, ctx.http)


def dev_zero_ref(ctx: StoreCtx) -> tuple[str, str | None]:
    os.symlink("/dev/zero", _ref(ctx.root, f"{ctx.rag.repo.namespace}/zero-id"))
    r = _ask(ctx.http, "zero-id")
    return _said(r), _not_found(r)


def sparse_ref(ctx: StoreCtx) -> tuple[str, str | None]:
    with open(_ref(ctx.root, f"{ctx.rag.repo.namespace}/huge-id"), "wb") as f:
        f.truncate(1 << 30)
    r = _ask(ctx.http, "huge-id")
    return _said(r), _not_found(r)


def admin_on_special_files(ctx: StoreCtx) -> tuple[str, str | None]:
    fake = content_key("a fifo where an entry goes")
    shard = ctx.root / "entries" / fake[:2] / fake[2:4]
    shard.mkdir(parents=True, exist_ok=True)
    os.mkfifo(shard / f"{fake}.kv")
    before = _entries(ctx.root)
    url = f"disk://{ctx.root}"
    os.environ.pop(KEY_ENV, None)  # this store was written without the key
    try:
        codes = [_cli("store", cmd, "--store", url, "--json")[0] for cmd in ("stats", "ls")]
        code, text = _cli("store", "gc", "--store", url, "--json")
    finally:
        os.environ[KEY_ENV] = ctx.key
    gone = json.loads(text.splitlines()[0])["dangling_links"]
    if _entries(ctx.root) < before:
        ctx.lost += before - _entries(ctx.root)
        return "gc deleted entries", "LOST"
    return f"stats/ls/gc exit {codes + [code]}; gc removed {len(gone)} bad refs", None if codes + [code] == [0, 0, 0] and len(gone) >= 3 else "WRONG"


def symlinked_shards(ctx: StoreCtx) -> tuple[str, str | None]:
    outside, root = ctx.tmp / "outside", ctx.tmp / "capped"
    outside.mkdir()
    store = DiskStore(root, max_bytes=200_000)
    keys = [content_key(f"shard{i}") for i in range(40)]
    for shard in {k[:2] for k in keys}:
        os.symlink(outside, root / "entries" / shard)
    import torch

    from kvrag.cache_backends import KVEntry

    for k in keys:
        store.put(k, KVEntry(torch.zeros(3, 2, 600, 8), torch.zeros(3, 2, 600, 8)))
    out = sum(f.stat().st_size for f in outside.rglob("*") if f.is_file())
    inside = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    return f"40 writes: {out} B outside, {inside} B inside (cap 200000), {store.stats().errors} refused", None if out == 0 and inside <= 200_000 else "WRONG"


def planted_ref(ctx: StoreCtx) -> tuple[str, str | None]:
    """The ingest ran elsewhere (same store, same key); the attacker points the id's ref at a signed inline chunk's entry."""
    other = ctx.engine(f"disk://{ctx.keyed_root}")
    other.precompute([Chunk("ticket-info", GENUINE)], progress=False)
    inline = {"model": "kvrag", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
              "kvrag": {"chunks": [{"id": "evil-inline", "text": PLANTED}]}}
    ctx.keyed_http.post("/v1/chat/completions", json=inline, timeout=LIMIT_S).raise_for_status()  # stored signed
    evil = other.repo.resolve([Chunk("evil-inline", PLANTED)]).keys[0]
    if not DiskStore(ctx.keyed_root, key=ctx.key, warn_unsigned=False).contains(evil):
        return "the inline chunk's entry was not stored", "WRONG"
    _ref(ctx.keyed_root, f"{ctx.keyed_rag.repo.namespace}/ticket-info").write_text(evil)
    r = _ask(ctx.keyed_http, "ticket-info")
    return _said(r), _not_found(r)


def unsigned_entries(ctx: StoreCtx) -> tuple[str, str | None]:
    """An ingest from a shell without the key, asked by id on the keyed server; then `kvrag store sign`."""
    os.environ.pop(KEY_ENV, None)
    try:
        ctx.engine(f"disk://{ctx.keyed_root}").precompute([Chunk("keyless-doc", GENUINE + " Keyless.")], progress=False)
    finally:
        os.environ[KEY_ENV] = ctx.key
    before = _entries(ctx.keyed_root)
    r = _ask(ctx.keyed_http, "keyless-doc")
    verdict = _not_found(r)
    if _entries(ctx.keyed_root) < before:
        ctx.lost += before - _entries(ctx.keyed_root)
        return _said(r) + "; entries deleted", "LOST"
    code, text = _cli("store", "sign", "--store", f"disk://{ctx.keyed_root}")
    again = _ask(ctx.keyed_http, "keyless-doc")
    hit = again.status_code == 200 and again.json()["kvrag_stats"]["cache_hits"] == 1
    return f"{_said(r)}; kept; after `store sign`: {_said(again)}", verdict or (None if code == 0 and hit else "WRONG")


def foreign_entries(ctx: StoreCtx) -> tuple[str, str | None]:
    """A replica with another key wrote this id; the keyed server and `kvrag store gc` must keep it."""
    os.environ[KEY_ENV] = "another replica's key"
    try:
        ctx.engine(f"disk://{ctx.keyed_root}").precompute([Chunk("foreign-doc", GENUINE + " Foreign.")], progress=False)
    finally:
        os.environ[KEY_ENV] = ctx.key
    before = _entries(ctx.keyed_root)
    r = _ask(ctx.keyed_http, "foreign-doc")
    code, text = _cli("store", "gc", "--store", f"disk://{ctx.keyed_root}")
    if _entries(ctx.keyed_root) < before:
        ctx.lost += before - _entries(ctx.keyed_root)
        return f"{_said(r)}; gc deleted entries", "LOST"
    metric = next((ln for ln in ctx.keyed_http.get("/metrics").text.splitlines() if ln.startswith("kvrag_store_unverified_entries ")), "")
    return f"{_said(r)}; gc kept them; {metric}", _not_found(r) or (None if code == 0 and metric else "WRONG")


def bench_user_folder(ctx: StoreCtx) -> tuple[str, str | None]:
    from kvrag.cli.bench_run import drop_default_store, run_store

    out = ctx.tmp / "bench-out"
    (out / "kv").mkdir(parents=True)
    (out / "kv" / "important.py").write_text("print('mine')\n")
    run_store(out, "kvrag bench")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        drop_default_store(argparse.Namespace(store=None, keep_store=False), out)
    kept = (out / "kv" / "important.py").is_file()
    if not kept:
        ctx.lost += 1
    return err.getvalue().strip()[:90], None if kept and "removed" not in err.getvalue() else ("LOST" if not kept else "WRONG")


def bench_symlink(ctx: StoreCtx) -> tuple[str, str | None]:
    from kvrag.cli.bench_run import drop_default_store

    target, out = ctx.tmp / "kv-target", ctx.tmp / "bench-link"
    target.mkdir()
    (target / "data.txt").write_text("keep")
    out.mkdir()
    os.symlink(target, out / "kv")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        drop_default_store(argparse.Namespace(store=None, keep_store=False), out)
    kept = (target / "data.txt").is_file() and (out / "kv").is_symlink()
    if not kept:
        ctx.lost += 1
    return err.getvalue().strip()[:90], None if kept and "removed" not in err.getvalue() else ("LOST" if not kept else "WRONG")


def ingest_folder(ctx: StoreCtx) -> tuple[str, str | None]:
    from kvrag.cli.ingest import _ingest_files

    folder = ctx.tmp / "docs"
    folder.mkdir()
    (folder / "good.txt").write_text("Owls hunt at night.\n")
    (folder / "blank.md").write_text(" \n\t\n")
    os.mkfifo(folder / "pipe.txt")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        files, skipped = _ingest_files(argparse.Namespace(paths=[str(folder)], follow_symlinks=False))
    named = all(n in err.getvalue() for n in ("pipe.txt: a FIFO", "blank.md: it holds no text"))
    return f"ingests {[f.name for f in files]}, skips {sorted(Path(s).name for s in skipped)}, each named", None if named and len(files) == 1 else "WRONG"


CASES: list[tuple[str, Callable[[StoreCtx], tuple[str, str | None]]]] = [
    ("FIFO at an unknown id's ref file, asked by id", fifo_ref),
    ("id ref symlinked to /dev/zero, asked by id", dev_zero_ref),
    ("1 GiB sparse id ref file, asked by id", sparse_ref),
    ("`kvrag store stats/ls/gc` beside FIFO/symlink refs and a FIFO entry", admin_on_special_files),
    ("40 writes through symlinked entries/ shard folders, 200 kB cap", symlinked_shards),
    ("keyed: id ref pointed at a signed inline chunk's entry", planted_ref),
    ("keyed: id ingested without the key, then `kvrag store sign`", unsigned_entries),
    ("keyed: id written with another key, then `kvrag store gc`", foreign_entries),
    ("bench cleanup: OUT/kv holds a user's important.py", bench_user_folder),
    ("bench cleanup: OUT/kv is a symlink", bench_symlink),
    ("ingest a folder with a FIFO and a whitespace-only file", ingest_folder),
]


def run_case(label: str, fn: Callable[[StoreCtx], tuple[str, str | None]], ctx: StoreCtx) -> dict[str, Any]:
    """One row; a case still running after LIMIT_S is a HANG (its thread is left behind, a daemon)."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["r"] = fn(ctx)
        except httpx.TimeoutException:
            box["r"] = ("request timed out", "HANG")
        except Exception as exc:  # noqa: BLE001 - a crash is a row, not the end of the table
            box["r"] = (f"{type(exc).__name__}: {exc}"[:90], "CRASH")

    rss, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.perf_counter()
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(LIMIT_S + 5)
    ms = (time.perf_counter() - t0) * 1000
    text, verdict = box.get("r", (f"still running after {LIMIT_S + 5:.0f} s", "HANG"))
    return {"input": label, "status": "-", "expected": "-", "response": text.replace("\n", " "), "ms": round(ms, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss, 1), "verdict": verdict or "ok"}


def store_rows(ctx: StoreCtx) -> list[dict[str, Any]]:
    return [run_case(label, fn, ctx) for label, fn in CASES]
