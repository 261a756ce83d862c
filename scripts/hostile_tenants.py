"""The hostile table's rows for several tenants on one server (run by hostile_table.py).

A server with a write key and a read key over a disk store and a real `chroma run` index, the same tiny
engine: one tenant's inline secret guessed by another through the caches, a salt given twice, index
entries no one should be refused for (no text, 60k characters, two chunks that do not fit together), a
truncated `.kv` entry and a lost id link asked by id, a replace the index refuses mid-request, an edited and
a forged index entry under a keyed server (a second one, on its own collection of the same `chroma run`,
signing with a store key), the index server frozen by SIGSTOP, and the start-up refusals and store
commands of the same probe. Each case returns (what it saw, verdict) and is
run by hostile_store.run_case: ok, CRASH, HANG, WRONG (a leak, a wrong answer, a refusal that should not
be, or none where one should be), LOST.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from hostile_store import run_case
from index_soak import ChromaProcess
from soak_faults import free_port

WRITE, READ = "sk-hostile-tenant-write", "sk-hostile-tenant-read"
SECRET = "Layoff list: Dana Okafor, salary 91400."
GUESSES = {"wrong-first": "Layoff list: Mia Ruiz, salary 10200.", "right": SECRET, "wrong-after": "Layoff list: Tom Baker, salary 55100."}
QUESTION = "Who is on the list?"
OWL = {"id": "owl", "text": "Owls hunt at night in the quiet forest.", "title": "Owls"}


@dataclass
class TenantCtx:
    url: str
    rag: Any  # the server's engine (a Stopping wrapper: see `stopped_index_replace`)
    index: Any
    chroma: ChromaProcess
    root: Path  # the disk store
    tmp: Path
    keyed_url: str = ""  # a second server whose index signs and verifies entries with KEYED_INDEX_KEY
    keyed_index: Any = None
    lost: int = 0

    def post(self, path: str, body: dict, key: str = WRITE) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=20, trust_env=False)


class Stopping:
    """The engine, whose precompute can stop the index server once it is done (Chroma gone mid-request)."""

    def __init__(self, rag: Any) -> None:
        self._rag, self.chroma = rag, None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def precompute(self, *args: Any, **kwargs: Any) -> Any:
        report = self._rag.precompute(*args, **kwargs)
        if self.chroma is not None:
            self.chroma.kill9()
            self.chroma = None
        return report


def _inline(text: str, method: str | None = None, **extra: Any) -> dict:
    ctx = {"chunks": [{"id": "memo", "text": text}], **({"method": method} if method else {})}
    return {"model": "kvrag", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 1, "kvrag": ctx, **extra}


def _ask(question: str = "When do owls hunt at night?", **kvrag: Any) -> dict:
    return {"model": "kvrag", "messages": [{"role": "user", "content": question}], "max_tokens": 2, **({"kvrag": kvrag} if kvrag else {})}


def _probe(ctx: TenantCtx, method: str | None, **extra: Any) -> dict[str, tuple[int, int]]:
    out = {}
    for name, text in GUESSES.items():
        s = ctx.post("/v1/chat/completions", _inline(text, method, **extra), key=READ).json()["kvrag_stats"]
        out[name] = (s["prefix_hit_tokens"], s["cache_hits"])
    return out


def _timed_guesses(ctx: TenantCtx, method: str | None, rounds: int = 7) -> tuple[float, float]:
    """Median wall time at the reader's client of the right guess and a wrong one, interleaved."""
    times: dict[str, list[float]] = {"right": [], "wrong-after": []}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            ctx.post("/v1/chat/completions", _inline(GUESSES[name], method), key=READ)
            times[name].append(time.perf_counter() - t0)
    return statistics.median(times["right"]), statistics.median(times["wrong-after"])


def guessed_secret(method: str | None) -> Callable[[TenantCtx], tuple[str, str | None]]:
    def case(ctx: TenantCtx) -> tuple[str, str | None]:
        for _ in range(2):
            ctx.post("/v1/chat/completions", _inline(SECRET, method))  # the victim, with the write key
        seen = _probe(ctx, method)
        fresh = _probe(ctx, method, cache_salt=f"fresh-{uuid.uuid4().hex}")
        same = seen == fresh and seen["right"] == seen["wrong-after"]
        right, wrong = _timed_guesses(ctx, method)
        # what the reader sees of the time: a right guess no sooner than a wrong one, beyond noise
        close = right >= wrong - max(0.2 * wrong, 0.005)
        return (f"(prefix hit, chunk hits) right {seen['right']}, wrong {seen['wrong-after']}, fresh cache {fresh['right']}; "
                f"wall p50 right {right * 1e3:.0f} ms, wrong {wrong * 1e3:.0f} ms"), None if same and close else "WRONG"
    return case


def salt_twice(ctx: TenantCtx) -> tuple[str, str | None]:
    r = ctx.post("/v1/chat/completions", {**_inline("x"), "cache_salt": "a", "kvrag": {"chunks": [{"id": "m", "text": "x"}], "cache_salt": "b"}}, key=READ)
    return f"{r.status_code} {r.json().get('error', {}).get('param')}", None if r.status_code == 400 else "WRONG"


def _plant(ctx: TenantCtx, chunk_id: str, text: str, title: str = "") -> None:
    coll = ctx.index._collection
    vector = coll.get(ids=["owl"], include=["embeddings"])["embeddings"][0]
    coll.upsert(ids=[chunk_id], embeddings=[list(vector)], documents=[text], metadatas=[{"title": title}])


def bad_entry(text: str, title: str = "") -> Callable[[TenantCtx], tuple[str, str | None]]:
    def case(ctx: TenantCtx) -> tuple[str, str | None]:
        _plant(ctx, "garbage", text, title)
        try:
            r = ctx.post("/v1/chat/completions", _ask(), key=READ)
        finally:
            ctx.index._collection.delete(ids=["garbage"])
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:70]}", "WRONG"
        dropped = [d["id"] for d in r.json().get("kvrag_dropped", [])]
        # a title the layout leaves out of the prompt (the default's chunk template has no {title}) costs no room
        fits = bool(text) and len(text) < 1000 and "{title}" not in ctx.rag.layout.options.chunk_template
        return f"200, kvrag_dropped {dropped}", None if dropped == ([] if fits else ["garbage"]) else "WRONG"
    return case


def long_pair(ctx: TenantCtx) -> tuple[str, str | None]:
    room = ctx.rag.lm.max_context // 2 + 200
    longs = [{"id": f"long-{i}", "text": f"Owls{i} hunt at night. " + "owl " * (room // 4)} for i in range(2)]
    ctx.post("/v1/chunks", {"chunks": longs})
    try:
        r = ctx.post("/v1/chat/completions", _ask(), key=READ)
    finally:
        for c in longs:  # the later cases retrieve without them
            httpx.delete(f"{ctx.url}/v1/chunks/{c['id']}", headers={"Authorization": f"Bearer {WRITE}"}, timeout=20, trust_env=False)
    if r.status_code != 200:
        return f"{r.status_code} {r.text[:70]}", "WRONG"
    dropped = [d["id"] for d in r.json().get("kvrag_dropped", [])]
    return f"200, answered from {len(r.json()['kvrag_sources'])}, dropped {dropped}", None if len(dropped) == 1 else "WRONG"


def truncated_entry(ctx: TenantCtx) -> tuple[str, str | None]:
    fig = {"id": "fig", "text": "Fig trees are pollinated by tiny wasps.", "title": "Figs"}
    ctx.post("/v1/chunks", {"chunks": [fig]})
    repo = ctx.rag.repo
    key = repo.chunk_key(repo.layout.chunk_ids(repo.chunks["fig"]))
    [path] = list(ctx.root.rglob(f"{key}*.kv"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    repo.chunks.pop("fig")  # as a replica that never saw the id asks it
    first = ctx.post("/v1/chat/completions", _ask("What pollinates figs?", chunk_ids=["fig"]), key=READ)
    again = ctx.post("/v1/chat/completions", _ask("What pollinates figs?", chunk_ids=["fig"]), key=READ)
    ok = first.status_code == again.status_code == 200 and again.json()["kvrag_stats"]["cache_hits"] == 1
    if not ok:
        ctx.lost += 1
    return f"{first.status_code} then {again.status_code} (hits {again.json().get('kvrag_stats', {}).get('cache_hits')})", None if ok else "LOST"


def lost_link(ctx: TenantCtx) -> tuple[str, str | None]:
    plum = {"id": "plum", "text": "Plum trees flower early in spring.", "title": "Plums"}
    ctx.post("/v1/chunks", {"chunks": [plum]})
    repo = ctx.rag.repo
    ctx.rag.store.unlink([f"{repo.namespace}/plum"])  # the store lost the link (a Redis FLUSHALL, an eviction)
    repo.chunks.pop("plum")  # and this replica never saw the id
    r = ctx.post("/v1/chat/completions", _ask("When do plums flower?", chunk_ids=["plum"]), key=READ)
    if r.status_code != 200:
        ctx.lost += 1
    return f"{r.status_code}", None if r.status_code == 200 else "LOST"


def stopped_index_replace(ctx: TenantCtx) -> tuple[str, str | None]:
    old = {"id": "kiwi", "text": "Kiwis are flightless birds.", "title": "Kiwis"}
    new = {**old, "text": "Kiwi fruit grows on woody vines in New Zealand, with a fuzzy brown skin."}
    ctx.post("/v1/chunks", {"chunks": [old]})
    tokens = lambda c: ctx.post("/v1/chat/completions", _ask(chunks=[c]), key=READ).json()["usage"]["prompt_tokens"]  # noqa: E731
    want = tokens(old)
    ctx.rag.chroma = ctx.chroma
    r = ctx.post("/v1/chunks", {"chunks": [new], "replace": True})
    ctx.chroma.start()
    by_id = ctx.post("/v1/chat/completions", _ask(chunk_ids=["kiwi"]), key=READ).json()["usage"]["prompt_tokens"]
    whole = r.status_code == 503 and by_id == want and [c.text for c in ctx.index.get(["kiwi"])] == [old["text"]]
    return f"{r.status_code} {r.json().get('error', {}).get('code')}; by id: the old text {by_id == want}", None if whole else "WRONG"


KEYED_INDEX_KEY = "hostile-tenant store key"
BRIDGE = {"id": "bridge", "text": "The Quillon Bridge opened in 1887, built by the city.", "title": "Quillon Bridge",
          "source": "/srv/docs/bridges.md", "source_name": "bridges.md"}
FORGED = "The Quillon Bridge opened in 1492, built by pirates."


def _unverified(ctx: TenantCtx) -> float:
    text = httpx.get(ctx.keyed_url + "/metrics", headers={"Authorization": f"Bearer {READ}"}, timeout=20, trust_env=False).text
    return float(next(x for x in text.splitlines() if x.startswith("kvrag_index_unverified_entries ")).split()[1])


def forged_index(edit: Callable[[Any, list[float]], str]) -> Callable[[TenantCtx], tuple[str, str | None]]:
    """An index entry edited or added straight in Chroma, behind a keyed server: never answered nor credited."""
    def case(ctx: TenantCtx) -> tuple[str, str | None]:
        post = lambda path, body, key=WRITE: httpx.post(ctx.keyed_url + path, json=body, headers={"Authorization": f"Bearer {key}"},  # noqa: E731
                                                         timeout=20, trust_env=False)
        post("/v1/chunks", {"chunks": [BRIDGE, OWL], "replace": True}).raise_for_status()
        coll = ctx.keyed_index._collection
        vector = list(coll.get(ids=["bridge"], include=["embeddings"])["embeddings"][0])
        forged_id = edit(coll, vector)
        before = _unverified(ctx)
        r = post("/v1/chat/completions", _ask("When did the Quillon Bridge open?", cite=True), key=READ)
        try:
            coll.delete(ids=[forged_id])
        finally:
            post("/v1/chunks", {"chunks": [BRIDGE], "replace": True})  # the genuine entry back, signed
        if r.status_code != 200:
            return f"{r.status_code} {r.text[:70]}", "WRONG"
        ids = [x["id"] for x in r.json()["kvrag_sources"]]
        text, counted = r.json()["choices"][0]["message"]["content"], _unverified(ctx) - before
        served = forged_id in ids or "quillon.md" in text or FORGED in text
        return f"200, sources {ids}, unverified +{counted:g}", None if not served and counted >= 1 and "owl" in ids else "WRONG"
    return case


def _edited(coll: Any, vector: list[float]) -> str:
    coll.update(ids=["bridge"], documents=[FORGED], embeddings=[vector])
    return "bridge"


def _added(coll: Any, vector: list[float]) -> str:
    coll.upsert(ids=["quillon"], embeddings=[vector], documents=[FORGED], metadatas=[{"title": "Quillon Bridge", "source_name": "quillon.md"}])
    return "quillon"


def frozen_index(ctx: TenantCtx) -> tuple[str, str | None]:
    """`chroma run` frozen by SIGSTOP: /health within 1 s (the last known state), a retrieving request a 503
    within the 10 s bound (plus a margin), and answers again once it is resumed."""
    from kvrag.ingest.index_url import HTTP_TIMEOUT_S

    get = lambda path: httpx.get(ctx.url + path, timeout=20, trust_env=False)  # noqa: E731
    ctx.chroma.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        get("/health").raise_for_status()
        health_s, t0 = time.monotonic() - t0, time.monotonic()
        r = ctx.post("/v1/chat/completions", _ask(), key=READ)
        ask_s = time.monotonic() - t0
    finally:
        ctx.chroma.signal(signal.SIGCONT)
    code = r.json().get("error", {}).get("code")
    deadline, back = time.monotonic() + 10, 0
    while back != 200 and time.monotonic() < deadline:  # the calls left waiting on the frozen server finish first
        back = ctx.post("/v1/chat/completions", _ask(), key=READ).status_code
        time.sleep(0 if back == 200 else 0.2)
    ok = health_s < 1.0 and code == "index_unavailable" and ask_s < HTTP_TIMEOUT_S + 3 and back == 200
    return f"/health {health_s:.2f} s; {r.status_code} {code} in {ask_s:.1f} s; resumed: {back}", None if ok else "WRONG"


def refused_at_start(ctx: TenantCtx) -> tuple[str, str | None]:
    from kvrag.server import ServerSettings

    refused = []
    for kwargs in ({"api_keys": ("sk-clé",)}, {"host": "0.0.0.0"}):
        try:
            ServerSettings(**kwargs)
        except ValueError:
            refused.append(next(iter(kwargs)))
    from kvrag.cli.serve import _keys

    os.environ["KVRAG_HOSTILE_KEYS"] = " , "
    try:
        _keys(None, "KVRAG_HOSTILE_KEYS")
    except ValueError:
        refused.append("' , '")
    finally:
        os.environ.pop("KVRAG_HOSTILE_KEYS")
    return f"refused: {refused}", None if len(refused) == 3 else "WRONG"


def gc_foreign(ctx: TenantCtx) -> tuple[str, str | None]:
    import torch

    from kvrag.cache_backends import KEY_ENV, DiskStore, KVEntry, content_key
    from kvrag.cache_backends.admin import gc, open_admin

    root = ctx.tmp / "keyed-gc"
    entry = KVEntry(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), meta={}, token_ids=torch.tensor([1, 2]))
    DiskStore(root, key="key B").put(content_key("b"), entry)  # another replica's genuine data, under its own key
    DiskStore(root, key="").put(content_key("bare"), entry)  # written without a key
    saved = os.environ.pop(KEY_ENV, None)
    os.environ[KEY_ENV] = "key A"
    try:
        plan = gc(open_admin(f"disk://{root}"), unverified=True)
    finally:
        os.environ.pop(KEY_ENV)
        if saved is not None:
            os.environ[KEY_ENV] = saved
    kept = DiskStore(root, key="key B").get(content_key("b")) is not None
    if not kept:
        ctx.lost += 1
    return f"deleted {len(plan['bad_entries'])} unsigned, kept {len(plan['unverified_kept'])} of another key", None if kept else "LOST"


CASES: list[tuple[str, Callable[[TenantCtx], tuple[str, str | None]]]] = [
    ("read key guesses a write key's inline secret (Full Attention: prefix cache)", guessed_secret("full")),
    ("read key guesses a write key's inline secret (reuse: chunk KV)", guessed_secret(None)),
    ("cache_salt top-level and in kvrag, different", salt_twice),
    ("index entry with no text, retrieved", bad_entry("")),
    ("index entry of 60k characters, retrieved", bad_entry("x " * 30_000)),
    ("index entry with a 20k-character title, retrieved", bad_entry("short", "T" * 20_000)),
    ("two long chunks that do not fit together, retrieved", long_pair),
    ("truncated .kv entry, asked by id by a replica that never saw it", truncated_entry),
    ("store lost an id's link (index holds it), asked by id", lost_link),
    ("replace while `chroma run` is killed mid-request", stopped_index_replace),
    ("keyed server: an index entry's text edited in Chroma (col.update)", forged_index(_edited)),
    ("keyed server: a forged index entry crediting quillon.md", forged_index(_added)),
    ("`chroma run` frozen (SIGSTOP): /health, a retrieving request", frozen_index),
    ("start-up: non-ASCII key, open 0.0.0.0, KVRAG_API_KEYS=' , '", refused_at_start),
    ("`gc --unverified` under key A beside key B's entry", gc_foreign),
]


def tenant_rows(tmp: Path, engine: Callable[[str], Any], settings: Any, start_server: Callable[[Any], Any]) -> tuple[list[dict[str, Any]], int]:
    """The rows, and the entries lost: a keyed server (write + read key) over a disk store and a real
    `chroma run`, on its own port (`start_server`: hostile_table's), beside hostile_table's."""
    import dataclasses

    from kvrag.ingest.retrieval import ChunkIndex
    from kvrag.server import create_app

    chroma = ChromaProcess(tmp / "tenant-chroma", free_port())
    chroma.start()
    root = tmp / "tenant-kv"
    rag = Stopping(engine(f"disk://{root}"))
    index = ChunkIndex(url=chroma.url)
    keyed = dataclasses.replace(settings, api_keys=(WRITE,), read_keys=(READ,), max_request_tokens=200_000)
    server, thread, url = start_server(create_app(rag, keyed, index))
    signed = ChunkIndex(url=f"chroma://127.0.0.1:{chroma.port}/kvrag_keyed", key=KEYED_INDEX_KEY)
    server2, thread2, url2 = start_server(create_app(engine(f"disk://{tmp / 'tenant-kv-keyed'}"), keyed, signed))
    try:
        ctx = TenantCtx(url, rag, index, chroma, root, tmp, url2, signed)
        ctx.post("/v1/chunks", {"chunks": [OWL]}).raise_for_status()
        rows = [run_case(label, fn, ctx) for label, fn in CASES]  # type: ignore[arg-type]
        return rows, ctx.lost
    finally:
        for s, t in ((server, thread), (server2, thread2)):
            s.should_exit = True
            t.join(10)
        chroma.signal(signal.SIGCONT)
        chroma.kill9()
