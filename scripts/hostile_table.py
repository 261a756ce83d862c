"""Issue #37, "trust under hostile input": the hostile-input suite as a table whose figures are kept.

tests/test_server_hostile.py asserts each case; this script sends the same kinds of input to a real
`kvrag serve` (uvicorn in a thread, 127.0.0.1, a free port, a disk store in a temp folder) and prints
one row per input: the HTTP status, the start of the error message or answer, the wall time and the
growth of the process's peak RSS, and a verdict:
  ok     the server answered as expected (the status and error code written below, per input);
  CRASH  a 5xx not expected, or a dropped connection;
  WRONG  a wrong answer: another status than expected, a refused input that left state behind, or a
         registered chunk answering differently than before the input (e.g. after an inline chunk
         tried to rebind its id);
  LOST   a registered chunk no longer resolves, or the store no longer holds its KV entry.
  HANG   (the store rows) still running after its time limit.
After each input every registered chunk is asked about again and its store entry looked up. Then the
store rows of issue #53 (scripts/hostile_store.py): FIFO, /dev/zero and oversized id refs, the admin
commands beside special files, symlinked shard folders under a cap, a planted ref, unsigned and
foreign-key entries under a keyed server (a second server, with $KVRAG_STORE_KEY), benchmark cleanup
of a folder it did not make, and an ingest of a folder holding a FIFO and a blank file. Then the
tenant rows (scripts/hostile_tenants.py: a third server with a write and a read key over a real
`chroma run`): guesses at another key's inline secret through the caches, index entries that must not
refuse a question, a truncated entry and a lost link asked by id, a replace the index refuses
mid-request, an edited and a forged index entry behind a server whose index is signed with a store key
(never answered nor credited), `chroma run` frozen by SIGSTOP (/health within 1 s, a 503 within the 10 s
bound), the start-up refusals and `gc --unverified` beside another key's entries. Then issue 69's rows
(scripts/hostile_round4.py): planted, forged, nested, FIFO and symlinked calibration files; an old signed
index version replayed, a deleted entry re-added, a moved vector and five decoys under a keyed server;
Redis killed mid-replace (SPLIT: by id and by retrieval answering different versions afterwards).

    python scripts/hostile_table.py [--model tiny|bundled] [--out DIR]

tiny (default): a random 3-layer Llama and a byte-level tokenizer, built here (seconds, offline);
bundled: `KVRag.from_pretrained()`. --out DIR writes DIR/hostile.md and DIR/hostile.json.
Exit status 1 on any crash, wrong answer or lost entry.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

for _name, _value in [("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("KVRAG_MIN_RECOMPUTE", "0"), ("KVRAG_SHORT_CONTEXT", "0")]:
    os.environ.setdefault(_name, _value)  # short chunks answered from their cached KV, as in the tests

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from kvrag import KVRag, from_model  # noqa: E402
from kvrag.cache_backends import KEY_ENV  # noqa: E402
from kvrag.server import ServerSettings, create_app  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostile_store import StoreCtx, store_rows  # noqa: E402
from hostile_round4 import round4_rows  # noqa: E402
from hostile_tenants import tenant_rows  # noqa: E402

ORIGINAL = "The Brannoch Line opened to passengers on 4 March 1921 after years of delay."
HOSTILE = "The Brannoch Line opened on 9 September 1999."
SAME = "Owls hunt at night in the quiet forest near the old mill."
REGISTERED = {"rebind-a": ORIGINAL, "twin-x": SAME, "twin-y": SAME, "keep-c": "Volcanoes erupt lava, ash and gas from deep below."}
QUESTION = "When did the line open?"


def tiny_engine(store: str) -> KVRag:
    """A random 3-layer Llama and a byte-level ChatML tokenizer (tests/tiny.py, shortened)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({s: len(vocab) + i for i, s in enumerate(specials)})
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    return KVRag(from_model(model, tok), store=store, check=False)


class Holdable:
    """The engine, whose `complete` / `complete_chat` can be made to wait (to queue requests behind it); counts calls."""

    def __init__(self, rag: KVRag) -> None:
        self._rag, self.calls = rag, 0
        self.hold, self.entered, self.release = False, threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rag, name)

    def _held(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.hold:
            self.entered.set()
            self.release.wait(60)
        return call(*args, **kwargs)

    def complete(self, prompt: str, **kwargs: Any) -> Any:
        return self._held(self._rag.complete, prompt, **kwargs)

    def complete_chat(self, messages: Any, **kwargs: Any) -> Any:  # what the server calls for plain chat
        return self._held(self._rag.complete_chat, messages, **kwargs)


def start_server(app: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    """uvicorn serving `app` in a daemon thread on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"


@dataclass
class Ctx:
    rag: KVRag
    engine: Holdable
    http: httpx.Client
    url: str
    limit: int  # the server's max_request_tokens
    expected: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (answer, prompt tokens) before any input
    lost: set[str] = field(default_factory=set)
    note: str | None = None  # what the response column shows instead of the body
    bad: bool = False  # set by a case whose own check failed


def ask(question: str = QUESTION, **extra: Any) -> dict[str, Any]:
    return {"model": "kvrag", "messages": [{"role": "user", "content": question}], "max_tokens": 3, **extra}


def answer_by_id(ctx: Ctx, cid: str) -> tuple[str, int] | None:
    """(answer, prompt tokens) when `cid` answers from its cached KV, else None."""
    r = ctx.http.post("/v1/chat/completions", json=ask(kvrag={"chunk_ids": [cid]}))
    if r.status_code != 200 or r.json()["kvrag_stats"]["cache_hits"] != 1 or r.json()["kvrag_stats"]["cache_misses"] != 0:
        return None
    return r.json()["choices"][0]["message"]["content"], r.json()["kvrag_stats"]["prompt_tokens"]


def in_store(ctx: Ctx, cid: str) -> bool:
    try:
        return cid in ctx.rag.repo.chunks and ctx.rag.store.contains(ctx.rag.repo.lookup([cid], None).keys[0])
    except Exception:  # noqa: BLE001 (an id that no longer resolves)
        return False


def integrity(ctx: Ctx) -> str | None:
    """LOST / WRONG when a registered chunk vanished or answers differently (blame lands once)."""
    verdict = None
    for cid in [c for c in ctx.expected if c not in ctx.lost]:
        now = answer_by_id(ctx, cid) if in_store(ctx, cid) else None
        if now is None:
            ctx.lost.add(cid)
            verdict = "LOST"
        elif now != ctx.expected[cid]:
            ctx.expected[cid] = now
            verdict = verdict or "WRONG"
    return verdict


def not_kept(*ids: str) -> Callable[[Ctx, httpx.Response], str | None]:
    """A refused input must leave none of these ids registered."""
    return lambda ctx, r: "WRONG" if any(i in ctx.rag.repo.chunks for i in ids) else None


def post(path: str, body: dict[str, Any] | bytes | Callable[[Ctx], dict[str, Any]]) -> Callable[[Ctx], httpx.Response]:
    """Send `body` (raw bytes as they are, a callable's dict built from the context) to `path`."""
    def send(ctx: Ctx) -> httpx.Response:
        if isinstance(body, bytes):
            return ctx.http.post(path, content=body, headers={"content-type": "application/json"})
        return ctx.http.post(path, json=body(ctx) if callable(body) else body)
    return send


def chat(**extra: Any) -> Callable[[Ctx], httpx.Response]:
    return post("/v1/chat/completions", ask(**extra))


def queued_clients_leave(ctx: Ctx) -> httpx.Response:
    """One request holds the engine; four clients queue behind it and give up after 1 s: they must
    leave the queue at once and cost no engine call."""
    eng, done, calls = ctx.engine, {}, ctx.engine.calls
    eng.hold = True

    def send(timeout: float, key: str) -> None:
        with httpx.Client(base_url=ctx.url, timeout=timeout, trust_env=False) as c:
            try:
                done[key] = c.post("/v1/chat/completions", json=ask("Hello?"))
            except httpx.TransportError:
                pass
    first = threading.Thread(target=send, args=(60, "first"))
    first.start()
    eng.entered.wait(20)
    quitters = [threading.Thread(target=send, args=(1.0, f"q{i}")) for i in range(4)]
    for t in quitters:
        t.start()
    queued = 0
    for _ in range(8):  # they give up after 1 s: look while they wait
        time.sleep(0.05)
        queued = max(queued, ctx.http.get("/health").json()["queue"]["waiting"])
    for t in quitters:
        t.join(20)
    time.sleep(0.3)
    waiting = ctx.http.get("/health").json()["queue"]["waiting"]
    eng.hold = False
    eng.release.set()
    first.join(30)
    time.sleep(0.5)
    ran = eng.calls - calls
    ctx.note = f"{queued} queued, {5 - len(done)} timed out; waiting after: {waiting}; engine ran {ran} of 5"
    ctx.bad = not (queued == 4 and waiting == 0 and ran == 1 and len(done) == 1)
    if "first" not in done:
        raise httpx.RemoteProtocolError("the request holding the engine got no answer")
    return done["first"]


def delete_shared(ctx: Ctx) -> httpx.Response:
    ctx.expected.pop("twin-x")  # this id is meant to go; twin-y, sharing its KV, must stay
    return ctx.http.delete("/v1/chunks/twin-x")


@dataclass
class Case:
    label: str
    send: Callable[[Ctx], httpx.Response]
    status: int
    code: str | None = None  # the expected error.code
    check: Callable[[Ctx, httpx.Response], str | None] | None = None


CASES = [
    Case("inline chunk reusing a registered id", chat(kvrag={"chunks": [{"id": "rebind-a", "text": HOSTILE}]}), 200,
         check=lambda ctx, r: None if ctx.rag.repo.chunks["rebind-a"].text == ORIGINAL else "WRONG"),
    Case("inline chunk with a new id (kept nowhere)", chat(kvrag={"chunks": [{"id": "only-inline", "text": HOSTILE}]}), 200, check=not_kept("only-inline")),
    Case("chunk_ids naming an id only sent inline", chat(kvrag={"chunk_ids": ["only-inline"]}), 400, "chunk_not_found"),
    Case("seed 2**64", chat(seed=2**64), 400),
    Case("seed -(2**63)-1, streaming", chat(seed=-(2**63) - 1, stream=True), 400),
    Case("tools field", chat(tools=[{"type": "function", "function": {"name": "lookup", "parameters": {}}}]), 400, "unsupported"),
    Case("n=2", chat(n=2), 400, "unsupported"),
    Case("logit_bias", chat(logit_bias={"50256": -100}), 400, "unsupported"),
    Case("method param layer=10**9 (a3)", chat(kvrag={"chunk_ids": ["keep-c"], "method": "a3", "params": {"layer": 10**9}}), 400, "invalid_method"),
    Case("method param stable_layers=[99] (samkv)", chat(kvrag={"chunk_ids": ["keep-c"], "method": "samkv", "params": {"stable_layers": [99]}}), 400, "invalid_method"),
    Case("method param link_tokens='x' (kvlink)", chat(kvrag={"chunk_ids": ["keep-c"], "method": "kvlink", "params": {"link_tokens": "x"}}), 400, "invalid_method"),
    Case("max_tokens 10**6", chat(max_tokens=10**6), 400, "invalid_request"),
    Case("unknown model", post("/v1/chat/completions", {**ask(), "model": "gpt-4o"}), 404, "model_not_found"),
    Case("chunk id with newline", post("/v1/chunks", {"chunks": [{"id": "line\nbreak", "text": "Some text."}]}), 400, check=not_kept("line\nbreak")),
    Case("chunk id with a lone surrogate", post("/v1/chunks", json.dumps({"chunks": [{"id": "\ud800", "text": "Some text."}]}).encode()), 400, check=not_kept("\ud800")),
    Case("chunk id reused within one ingest", post("/v1/chunks", {"chunks": [{"id": "dup", "text": "A."}, {"id": "dup", "text": "B."}]}), 400, "duplicate_id", not_kept("dup")),
    Case("title over the token limit", post("/v1/chunks", lambda ctx: {"chunks": [{"id": "big-title", "text": "short", "title": " t" * ctx.limit}]}), 413, "too_many_tokens", not_kept("big-title")),
    Case("inline title over the token limit", post("/v1/chat/completions", lambda ctx: ask(kvrag={"chunks": [{"id": "big-inline", "text": "short", "title": " t" * ctx.limit}]})), 413, "too_many_tokens"),
    Case("chunk longer than the context, after a good one", post("/v1/chunks", lambda ctx: {"chunks": [{"id": "tides", "text": "A good chunk about tides."}, {"id": "too-long", "text": " x" * ctx.rag.lm.max_context}]}), 400, "context_length_exceeded", not_kept("tides", "too-long")),
    Case("blank chunk text", post("/v1/chunks", {"chunks": [{"id": "blank", "text": "   "}]}), 400, "invalid_request", not_kept("blank")),
    Case("5 chunks (limit 4)", post("/v1/chunks", {"chunks": [{"id": f"many-{i}", "text": "Some text."} for i in range(5)]}), 413, check=not_kept("many-0")),
    Case("oversized body (70 kB)", post("/v1/chunks", {"chunks": [{"id": "huge", "text": "x" * 70_000}]}), 413, check=not_kept("huge")),
    Case("malformed JSON", post("/v1/chat/completions", b'{"model": "kvrag", "messages": ['), 400),
    Case("lone surrogate in a message", post("/v1/chat/completions", json.dumps(ask("When \ud800 did it open?")).encode()), 400,
         "invalid_request", lambda ctx, r: None if "lone surrogate" in r.text else "WRONG"),
    Case("kvrag.top_k 10**9", chat(kvrag={"top_k": 10**9}), 400, "invalid_request"),
    Case("DELETE of an id another id shares", delete_shared, 200, check=lambda ctx, r: None if r.json().get("kv_entries_removed") == 0 else "LOST"),
    Case("DELETE of an unknown id", lambda ctx: ctx.http.delete("/v1/chunks/never-was"), 404),
    Case("client gone before its queued request starts", queued_clients_leave, 200, check=lambda ctx, r: "WRONG" if ctx.bad else None),
]


def snippet(r: httpx.Response | None, note: str | None) -> str:
    if note or r is None:
        return note or "(connection dropped)"
    try:
        body = r.json()
    except ValueError:
        return r.text[:60]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        text = str(body["error"].get("message"))
    elif isinstance(body, dict) and body.get("choices"):
        text = "answer: " + repr(body["choices"][0]["message"]["content"])
    else:
        text = json.dumps(body)
    return text.replace("\n", " ")[:60]


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KB on Linux


def error_code(r: httpx.Response) -> str | None:
    try:
        return (r.json().get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def judge(case: Case, ctx: Ctx, r: httpx.Response | None) -> str:
    if r is None or (r.status_code >= 500 and r.status_code != case.status):
        return "CRASH"
    if r.status_code != case.status:
        return "WRONG"
    if case.code and error_code(r) != case.code:
        return "WRONG"
    return (case.check(ctx, r) if case.check else None) or "ok"


def run_case(case: Case, ctx: Ctx) -> dict[str, Any]:
    ctx.note, rss, t0 = None, maxrss_mb(), time.perf_counter()
    try:
        r: httpx.Response | None = case.send(ctx)
    except httpx.TransportError:
        r = None
    ms = (time.perf_counter() - t0) * 1000
    grow = maxrss_mb() - rss
    verdict = judge(case, ctx, r)
    after = integrity(ctx)
    if after and verdict == "ok":
        verdict = after
    return {"input": case.label, "status": r.status_code if r is not None else "-", "expected": case.status,
            "response": snippet(r, ctx.note), "ms": round(ms, 1), "peak_rss_mb": round(grow, 1), "verdict": verdict}


def render(rows: list[dict[str, Any]], summary: str) -> str:
    lines = ["| input | status | response | ms | peak RSS +MB | verdict |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["input"], row["status"], row["response"], row["ms"], row["peak_rss_mb"], row["verdict"]]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines + ["", summary])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "bundled"], default="tiny")
    p.add_argument("--out", type=Path, default=None, help="write hostile.md and hostile.json here")
    args = p.parse_args(argv)
    # the mechanics of reuse under hostile input, not a model's calibrated choice (a random tiny model's
    # calibration would make every default request Full Attention, and no chunk would answer from its KV)
    os.environ.setdefault("KVRAG_CALIBRATE", "0")
    with tempfile.TemporaryDirectory(prefix="kvrag-hostile-") as tmp:
        store = f"disk://{tmp}/kv"
        rag = tiny_engine(store) if args.model == "tiny" else KVRag.from_pretrained(store=store, check=False)
        limit = 2 * rag.lm.max_context + 2000  # a chunk past the context is still within the token limit
        settings = ServerSettings(max_body_bytes=64 * 1024, max_chunks=4, max_request_tokens=limit, max_new_tokens=8,
                                  max_concurrency=1, max_queue=8)  # one slot: the queued-clients case queues behind it
        engine = Holdable(rag)
        server, thread, url = start_server(create_app(engine, settings))
        try:
            with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
                ctx = Ctx(rag, engine, http, url, limit)
                r = http.post("/v1/chunks", json={"chunks": [{"id": i, "text": t} for i, t in REGISTERED.items()]})
                r.raise_for_status()
                for cid in REGISTERED:
                    first = answer_by_id(ctx, cid)
                    if first is None:
                        raise RuntimeError(f"registered chunk {cid!r} does not answer from its cached KV before any input")
                    ctx.expected[cid] = first
                rows = [run_case(case, ctx) for case in CASES]
                rows += keyed_rows(rag, http, Path(tmp), settings, store_lost := [])
                more, tenants_lost = tenant_rows(Path(tmp), lambda url: KVRag(rag.lm, store=url, check=False), settings, start_server)
                rows += more
                store_lost.append(tenants_lost)
                more, round4_lost, split = round4_rows(Path(tmp), lambda url: KVRag(rag.lm, store=url, check=False), settings, start_server)
                rows += more
                store_lost.append(round4_lost)
        finally:
            server.should_exit = True
            thread.join(10)
    crashes, wrong = sum(row["verdict"] == "CRASH" for row in rows), sum(row["verdict"] == "WRONG" for row in rows)
    hangs, lost = sum(row["verdict"] == "HANG" for row in rows), len(ctx.lost) + sum(store_lost)
    split = sum(row["verdict"] == "SPLIT" for row in rows)
    summary = (f"inputs tried {len(rows)}, crashes {crashes}, hangs {hangs}, wrong answers {wrong}, lost entries {lost}, "
               f"split states {split}")
    table = render(rows, summary)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "hostile.md").write_text(table + "\n")
        (args.out / "hostile.json").write_text(json.dumps({"model": args.model, "rows": rows, "inputs": len(rows), "crashes": crashes,
                                                           "hangs": hangs, "wrong_answers": wrong, "lost_entries": lost,
                                                           "split_states": split}, indent=2) + "\n")
    return 1 if crashes or wrong or hangs or lost or split else 0


def keyed_rows(rag: KVRag, http: httpx.Client, tmp: Path, settings: ServerSettings, lost: list[int]) -> list[dict[str, Any]]:
    """Issue #53's store rows: a second server over a keyed store (same model), beside the first."""
    key = "hostile-table store key"
    os.environ[KEY_ENV] = key
    keyed_root = tmp / "keyed"
    keyed = KVRag(rag.lm, store=f"disk://{keyed_root}", check=False)
    server, thread, url = start_server(create_app(keyed, settings))
    try:
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as keyed_http:
            (tmp / "cases").mkdir()
            sctx = StoreCtx(http, rag, tmp / "kv", tmp / "cases", keyed_http, keyed, keyed_root,
                            lambda store: KVRag(rag.lm, store=store, check=False), key)
            rows = store_rows(sctx)
            lost.append(sctx.lost)
            return rows
    finally:
        os.environ.pop(KEY_ENV, None)
        server.should_exit = True
        thread.join(10)


if __name__ == "__main__":
    sys.exit(main())
