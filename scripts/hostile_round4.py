"""The hostile table's rows for issue 69 (run by hostile_table.py): the calibration file, index replay and
steering under a store key, and Redis killed mid-replace.

Calibration: a planted choice with a recomputed plain hash, the same file writable by others, a forged file
under a key, 200,000 nested brackets, a FIFO and a symlink at its path; each must be refused (None) without
raising or hanging. Index (a keyed server over a real `chroma run`, a memory store): an old signed version
re-added after a replace, a deleted entry re-added, a signed entry's vector moved onto the question, five
unsigned decoys at the question's vector; none may be answered, and the decoys' slots must be filled by good
entries. Redis (where redis-server is installed): killed with SIGKILL, a replace through the server, Redis
back empty; by id and by retrieval must answer one version (else SPLIT). Each case returns (what it saw,
verdict) and is run by hostile_store.run_case.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from hostile_store import run_case
from index_soak import ChromaProcess
from soak_faults import RedisProcess, free_port

KEY = "hostile-round4-key"
Q = "When did the Quillon Bridge open?"
OLD = {"id": "bridge", "text": "The Quillon Bridge opened in 1893, built by the city.", "title": "Quillon Bridge"}
NEW = {**OLD, "text": "The Quillon Bridge opened in 1911, rebuilt by the city."}
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}
FACTS = [{"id": f"f{i}", "text": f"Quillon Bridge fact {i}: it has {i + 2} arches over the river.", "title": f"Fact {i}"} for i in range(6)]


@dataclass
class Round4Ctx:
    url: str  # a keyed server over `index`
    index: Any
    engine: Callable[[str], Any]
    settings: Any
    start_server: Callable[[Any], Any]
    tmp: Path
    lost: int = 0
    split: int = 0

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=60, trust_env=False)

    def delete(self, path: str) -> httpx.Response:
        return httpx.delete(self.url + path, timeout=60, trust_env=False)

    def sources(self, top_k: int | None = None) -> list[str]:
        body = {"model": "kvrag", "messages": [{"role": "user", "content": Q}], "max_tokens": 2}
        if top_k:
            body["kvrag"] = {"top_k": top_k}
        r = self.post("/v1/chat/completions", body)
        r.raise_for_status()
        return [s["id"] for s in r.json()["kvrag_sources"]]


# -- the calibration file ------------------------------------------------------------------------------------
def _calibration(setup: Callable[[Path], None], keyed: bool = False) -> Callable[[Round4Ctx], tuple[str, str | None]]:
    def case(ctx: Round4Ctx) -> tuple[str, str | None]:
        from kvrag.check import calibration_store as store

        saved = {n: os.environ.get(n) for n in ("KVRAG_MODEL_CACHE", "KVRAG_STORE_KEY")}
        os.environ["KVRAG_MODEL_CACHE"] = tempfile.mkdtemp(dir=ctx.tmp)
        os.environ.pop("KVRAG_STORE_KEY", None)
        if keyed:
            os.environ["KVRAG_STORE_KEY"] = KEY
        try:
            path = store.calibration_path("fp4")
            path.parent.mkdir(parents=True)
            setup(path)
            got = store.read_result("fp4", "cpu")
            store.results_for_source("m")
            return f"read_result -> {None if got is None else got['chosen']}", None if got is None else "WRONG"
        finally:
            for n, v in saved.items():
                os.environ.pop(n, None) if v is None else os.environ.__setitem__(n, v)
    return case


def _planted(path: Path, mode: int = 0o644, sign: bool = False) -> None:
    from kvrag.check import calibration_store as store

    result = {"chosen": {"method": "reuse", "ratio": 0.15, "why": "planted"},
              "settings": [{"setting": "reuse", "method": "reuse", "ratio": 0.15, "status": "passed" if sign else "failed"}]}
    path.write_text(json.dumps({"versions": store.versions(), "fingerprint": "fp4", "devices": {
        "cpu": {"result": result, "sha256": store._checksum(result), "mac": "0" * 64}}}))
    os.chmod(path, mode)
    (path.parent / "sources.json").write_text(json.dumps({"m": "fp4"}))


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _nested(path: Path) -> None:
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    (path.parent / "sources.json").write_bytes(b"{" * 200_000)


def _symlink(path: Path) -> None:
    real = path.parent / "real.json"
    _planted(real)
    path.symlink_to(real)


# -- the index under a key -----------------------------------------------------------------------------------
def _raw(index: Any, chunk_id: str) -> dict:
    got = index._collection.get(ids=[chunk_id], include=["documents", "metadatas", "embeddings"])
    return {"ids": got["ids"], "documents": got["documents"], "metadatas": got["metadatas"],
            "embeddings": [[float(x) for x in got["embeddings"][0]]]}


def replay(ctx: Round4Ctx) -> tuple[str, str | None]:
    ctx.post("/v1/chunks", {"chunks": [OLD, OWL], "replace": True}).raise_for_status()
    old = _raw(ctx.index, "bridge")
    ctx.post("/v1/chunks", {"chunks": [NEW], "replace": True}).raise_for_status()
    ctx.index._collection.upsert(**old)
    ids = ctx.sources()
    ctx.post("/v1/chunks", {"chunks": [NEW], "replace": True}).raise_for_status()
    back = ctx.sources()
    return f"after replay: sources {ids}; re-posted: {back}", None if "bridge" not in ids and "bridge" in back else "WRONG"


def resurrect(ctx: Round4Ctx) -> tuple[str, str | None]:
    ctx.post("/v1/chunks", {"chunks": [OLD, OWL], "replace": True}).raise_for_status()
    old = _raw(ctx.index, "bridge")
    ctx.delete("/v1/chunks/bridge").raise_for_status()
    ctx.index._collection.upsert(**old)
    ids = ctx.sources()
    by_id = ctx.post("/v1/chat/completions", {"model": "kvrag", "messages": [{"role": "user", "content": Q}], "max_tokens": 2,
                                              "kvrag": {"chunk_ids": ["bridge"]}}).status_code
    ctx.index._collection.delete(ids=["bridge"])
    return f"sources {ids}, by id {by_id}", None if "bridge" not in ids and by_id == 400 else "WRONG"


def moved(ctx: Round4Ctx) -> tuple[str, str | None]:
    from kvrag.ingest.retrieval import query_vector

    ctx.post("/v1/chunks", {"chunks": [NEW, OWL], "replace": True}).raise_for_status()
    owl = _raw(ctx.index, "owl")
    owl["embeddings"] = [list(query_vector(Q))]
    ctx.index._collection.upsert(**owl)
    ids = ctx.sources()
    ctx.post("/v1/chunks", {"chunks": [OWL], "replace": True})
    return f"sources {ids}", None if ids and ids[0] == "bridge" and "owl" not in ids else "WRONG"


def decoys(ctx: Round4Ctx) -> tuple[str, str | None]:
    from kvrag.ingest.retrieval import query_vector

    for part in (FACTS[:3], FACTS[3:]):
        ctx.post("/v1/chunks", {"chunks": part, "replace": True}).raise_for_status()
    ids_d = [f"decoy{i}" for i in range(5)]
    ctx.index._collection.upsert(ids=ids_d, embeddings=[list(query_vector(Q))] * 5, documents=[f"Opened in 14{i}2." for i in range(5)],
                                 metadatas=[{"title": "Quillon Bridge", "source_name": "decoy.md"}] * 5)
    ids = ctx.sources(top_k=4)
    ctx.index._collection.delete(ids=ids_d)
    good = [i for i in ids if not i.startswith("decoy")]
    return f"sources {ids}", None if len(good) == 4 == len(ids) else "WRONG"


# -- Redis killed mid-replace --------------------------------------------------------------------------------
def redis_killed(ctx: Round4Ctx) -> tuple[str, str | None]:
    if shutil.which("redis-server") is None:
        return "redis-server not installed: not run", None
    from kvrag.ingest.retrieval import ChunkIndex

    redis = RedisProcess()
    redis.start()
    server, thread, url = ctx.start_server(__import__("kvrag.server", fromlist=["create_app"]).create_app(
        ctx.engine(redis.url), ctx.settings, ChunkIndex(path=ctx.tmp / "redis-index", key="")))
    post = lambda body: httpx.post(url + "/v1/chunks", json=body, timeout=60, trust_env=False)  # noqa: E731

    def tokens(**kv: Any) -> int | None:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "kvrag", "messages": [{"role": "user", "content": "What?"}],
                                                           "max_tokens": 1, "kvrag": kv}, timeout=60, trust_env=False)
        return r.json()["usage"]["prompt_tokens"] if r.status_code == 200 else None
    try:
        post({"chunks": [OLD]}).raise_for_status()
        old_t, new_t = tokens(chunks=[OLD]), tokens(chunks=[NEW])
        redis.kill9()
        status = post({"chunks": [NEW], "replace": True}).status_code
        redis.start()
        by_id = None
        for _ in range(40):
            by_id = tokens(chunk_ids=["bridge"])
            if by_id is not None:
                break
            threading.Event().wait(0.5)
        if by_id is None:
            ctx.lost += 1
        one = by_id == old_t
        ctx.split += 0 if one else 1
        return (f"POST {status}; by id {by_id} tokens (old {old_t}, new {new_t}); index: old",
                None if status == 503 and one else ("SPLIT" if by_id == new_t else "WRONG"))
    finally:
        server.should_exit = True
        thread.join(10)
        redis.kill9()


CASES: list[tuple[str, Callable[[Round4Ctx], tuple[str, str | None]]]] = [
    ("calibration: planted `reuse`, plain hash recomputed", _calibration(_planted)),
    ("calibration: a sound-looking file writable by others (no key)", _calibration(lambda p: _planted(p, 0o666, sign=True))),
    ("calibration: a forged file under a key (wrong MAC)", _calibration(lambda p: _planted(p, sign=True), keyed=True)),
    ("calibration: 200,000 nested brackets", _calibration(_nested)),
    ("calibration: a FIFO at its path", _calibration(_fifo)),
    ("calibration: a symlink at its path", _calibration(_symlink)),
    ("keyed index: an old signed version replayed after a replace", replay),
    ("keyed index: a deleted entry re-added", resurrect),
    ("keyed index: a signed entry's vector moved onto the question", moved),
    ("keyed index: five unsigned decoys at the question's vector", decoys),
    ("Redis killed (SIGKILL) mid-replace, back empty", redis_killed),
]


def round4_rows(tmp: Path, engine: Callable[[str], Any], settings: Any, start_server: Callable[[Any], Any]) -> tuple[list[dict[str, Any]], int, int]:
    """The rows, the entries lost and the split states: a keyed server over a memory store and a real `chroma run`."""
    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.server import create_app

    chroma = ChromaProcess(tmp / "round4-chroma", free_port())
    chroma.start()
    index = ChunkIndex(url=f"chroma://127.0.0.1:{chroma.port}/kvrag_round4", key=KEY)
    saved = os.environ.get("KVRAG_STORE_KEY")
    os.environ["KVRAG_STORE_KEY"] = KEY  # the memory store's links signed with the same key
    try:
        server, thread, url = start_server(create_app(engine("memory://"), settings, index))
    finally:
        os.environ.pop("KVRAG_STORE_KEY", None) if saved is None else os.environ.__setitem__("KVRAG_STORE_KEY", saved)
    try:
        ctx = Round4Ctx(url, index, engine, settings, start_server, tmp)
        rows = [run_case(label, fn, ctx) for label, fn in CASES]  # type: ignore[arg-type]
        return rows, ctx.lost, ctx.split
    finally:
        server.should_exit = True
        thread.join(10)
        chroma.kill9()
