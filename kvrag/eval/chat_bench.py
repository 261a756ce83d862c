"""`kvrag bench chat`: two-turn conversations whose follow-up refers back ("it", "its", "she").

For each conversation and method: turn one; then turn two over the same chunks three ways: with the
exact prefix cache (it continues turn one's KV and reads only its new tokens), without it (the whole
conversation read again, as the method reads it), and with Full Attention over the same conversation
(the reference: no cache). Reported per context kind and method: turn-two TTFT of each, the speed-up
of the cache (no cache / cache, per conversation, median), whether turn two's answer with the cache
is token-identical to the one without, contains the gold, agrees with Full's.

Context kinds: "10 passages" (the conversation's document among nq10_dev passages, ~1.3k tokens: the
default reuses) and "short" (its document and two others: read whole by the short-context policy).
A retrieval section measures what a follow-up retrieves with: the last message alone, the recent user
turns together (the server's default), or a standalone question the model condenses.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from kvrag.chat import Conversation
from kvrag.eval.metrics import agreement, contains
from kvrag.types import Chunk

KINDS = ("10 passages", "short")
CONDENSE = ("Rewrite the user's last question so that it can be understood without the conversation: replace "
            "words like 'it', 'its', 'they' and 'she' with the name they refer to. Reply with the rewritten question only.")


@dataclass
class ChatCase:
    id: str
    gold: list[Chunk]  # the conversation's document (a sample file: its paragraphs)
    turns: list[tuple[str, list[str]]]  # (question, gold answers)
    context: dict[str, list[Chunk]] = field(default_factory=dict)  # kind -> chunks, gold among them


def _paragraph_chunks(name: str, text: str) -> list[Chunk]:
    paras = [p.strip() for p in text.split("\n\n") if p.strip() and not p.strip().startswith("#")]
    return [Chunk(id=f"{name}-{i}", text=p) for i, p in enumerate(paras)]


def _distractors(data_dir: Path | None, n: int, seed: int) -> list[Chunk]:
    """Passages from nq10_dev (any question's), else none."""
    path = data_dir / "nq10_dev.jsonl" if data_dir is not None else None
    if path is None or not path.exists():
        return []
    passages: list[Chunk] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            for j, ctx in enumerate(row["ctxs"][:3]):
                passages.append(Chunk(id=f"nq-{i}-{j}", text=f"{ctx['title']}\n{ctx['text']}"))
            if len(passages) >= 40 * n:
                break
    rng = random.Random(seed)
    rng.shuffle(passages)
    return passages


def load_cases(data_dir: Path | None = None, passages: int = 10, seed: int = 0) -> list[ChatCase]:
    """The bundled conversation set (kvrag/eval/conversations.json) with each kind's context."""
    spec = json.loads(resources.files("kvrag.eval").joinpath("conversations.json").read_text(encoding="utf-8"))
    docs = {k: Chunk(id=f"doc-{k}", text=v) for k, v in spec["documents"].items()}
    corpus = resources.files("kvrag").joinpath("sample_corpus")
    cases = []
    for conv in spec["conversations"]:
        if "sample" in conv:
            name = conv["sample"].removesuffix(".md")
            gold = _paragraph_chunks(name, corpus.joinpath(conv["sample"]).read_text(encoding="utf-8"))
        else:
            gold = [docs[conv["doc"]]]
        cases.append(ChatCase(conv["id"], gold, [(t["q"], list(t["a"])) for t in conv["turns"]]))
    pool = _distractors(data_dir, passages, seed)
    rng = random.Random(seed)
    own = list(docs.values())
    for i, case in enumerate(cases):
        others = [d for d in own if all(d.id != g.id for g in case.gold)]
        case.context["short"] = case.gold + rng.sample(others, 2) if len(case.gold) == 1 else list(case.gold)
        fill = max(0, passages - len(case.gold))
        extra = pool[i * fill : (i + 1) * fill] if len(pool) >= (i + 1) * fill else rng.sample(others, min(fill, len(others)))
        ctx = list(extra)
        at = rng.randrange(len(ctx) + 1)
        case.context["10 passages"] = ctx[:at] + case.gold + ctx[at:]
    return cases


def _messages(case: ChatCase, answer: str) -> tuple[Conversation, Conversation]:
    first = Conversation.ask(case.turns[0][0])
    return first, first.with_answer(answer, case.turns[1][0])


def run_case(rag: Any, case: ChatCase, kind: str, method: str, max_new_tokens: int) -> dict[str, Any]:
    """One conversation under one method: turn one, then turn two with the cache, without, and Full's."""
    chunks = case.context[kind]
    opts = {"method": method, "max_new_tokens": max_new_tokens}
    rag.prefix_cache.clear()
    first, _ = _messages(case, "")
    one = rag.chat(first, chunks=chunks, **opts)
    _, second = _messages(case, one.text)
    miss = rag.chat(second, chunks=chunks, prefix_cache=False, **opts)
    hit = rag.chat(second, chunks=chunks, **opts)
    full = miss if method == "full" else rag.chat(second, chunks=chunks, method="full", prefix_cache=False, max_new_tokens=max_new_tokens)
    gold1, gold2 = case.turns[0][1], case.turns[1][1]
    return {
        "case": case.id, "kind": kind, "method": method, "turn1": one.text, "turn2": hit.text, "turn2_no_cache": miss.text,
        "turn2_full": full.text, "contained1": contains(one.text, gold1), "contained2": contains(hit.text, gold2),
        "contained2_full": contains(full.text, gold2), "agree_full": agreement(hit.text, full.text),
        "identical": hit.text == miss.text, "ttft1": one.stats.ttft_s, "ttft2_cache": hit.stats.ttft_s,
        "ttft2_no_cache": miss.stats.ttft_s, "ttft2_full": full.stats.ttft_s, "prefix_hit_tokens": hit.stats.prefix_hit_tokens,
        "prompt_tokens": hit.stats.prompt_tokens, "context_tokens": hit.stats.context_tokens,
        "read_whole": bool(miss.stats.full_reason) or method == "full",
    }


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind in KINDS:
        for method in dict.fromkeys(r["method"] for r in records):
            rs = [r for r in records if r["kind"] == kind and r["method"] == method]
            if not rs:
                continue
            n = len(rs)
            rows.append({
                "kind": kind, "method": method, "n": n,
                "context_tokens": int(statistics.median(r["context_tokens"] for r in rs)),
                "read_whole": sum(r["read_whole"] for r in rs),
                "turn1_contained": sum(r["contained1"] > 0 for r in rs), "turn2_contained": sum(r["contained2"] > 0 for r in rs),
                "turn2_full_contained": sum(r["contained2_full"] > 0 for r in rs),
                "agree_full": sum(r["agree_full"] > 0 for r in rs), "identical": sum(r["identical"] for r in rs),
                "ttft2_cache_ms": 1000 * statistics.median(r["ttft2_cache"] for r in rs),
                "ttft2_no_cache_ms": 1000 * statistics.median(r["ttft2_no_cache"] for r in rs),
                "ttft2_full_ms": 1000 * statistics.median(r["ttft2_full"] for r in rs),
                "speedup_cache": statistics.median(r["ttft2_no_cache"] / max(r["ttft2_cache"], 1e-9) for r in rs),
                "speedup_vs_full": statistics.median(r["ttft2_full"] / max(r["ttft2_cache"], 1e-9) for r in rs),
                "hit_share": statistics.median(r["prefix_hit_tokens"] / max(1, r["prompt_tokens"]) for r in rs),
            })
    return rows


def condensed_question(rag: Any, conv: Conversation) -> str:
    """The follow-up as a standalone question, written by the model (LlamaIndex's condense step, done here)."""
    history = "\n".join(f"{role}: {text}" for role, text in conv.turns)
    return rag.chat([("system", CONDENSE), ("user", history)], max_new_tokens=40, stop_at="line").text.strip() or conv.question


def retrieval_modes(rag: Any, cases: Sequence[ChatCase], index_dir: Path, k: int, max_new_tokens: int) -> list[dict[str, Any]]:
    """Turn two's retrieval with three queries, over one index of every case's chunks: gold found in the
    top k, and turn two answered (the engine's default method) from what each retrieved; and the recent
    user turns' chunks with turn one's order kept (kvrag.ingest.follow_up, what `kvrag serve` reads). Each
    mode's turn two follows its own turn one with the prefix cache holding that turn alone, so the
    tokens it reads and its TTFT say what the order costs."""
    from kvrag.ingest.follow_up import conversation_chunks
    from kvrag.ingest.retrieval import ChunkIndex

    index = ChunkIndex(index_dir, collection="chat_bench")
    every = {c.id: c for case in cases for c in case.context["10 passages"]}
    index.add(list(every.values()), skip_unchanged=True)
    rows = []
    for case in cases:
        first = Conversation.ask(case.turns[0][0])
        found1 = index.query(first.question, k=k)
        one = rag.chat(first, chunks=found1, max_new_tokens=max_new_tokens)
        second = first.with_answer(one.text, case.turns[1][0])
        queries = {"last message": lambda: index.query(second.question, k=k),
                   "recent user turns": lambda: index.query(second.retrieval_query(), k=k),
                   "condensed": lambda: index.query(condensed_question(rag, second), k=k),
                   "recent user turns, turn one's order kept": lambda: conversation_chunks(index, second, k=k)}
        gold = {c.id for c in case.gold}
        for mode, retrieve in queries.items():
            found = retrieve()
            rag.prefix_cache.clear()
            rag.chat(first, chunks=found1, max_new_tokens=max_new_tokens)  # the same turn one (greedy), kept alone
            ans = rag.chat(second, chunks=found, max_new_tokens=max_new_tokens)
            st = ans.stats
            rows.append({"case": case.id, "mode": mode, "ids": [c.id for c in found], "turn1_ids": [c.id for c in found1],
                         "gold_found": any(c.id in gold for c in found), "contained2": contains(ans.text, case.turns[1][1]) > 0,
                         "turn2": ans.text, "ttft2": st.ttft_s, "prompt_tokens": st.prompt_tokens,
                         "read_tokens": st.prompt_tokens - st.prefix_hit_tokens})
    return rows


def retrieval_summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs = [r for r in rows if r["mode"] == mode]
        out.append({"mode": mode, "n": len(rs), "gold_found": sum(r["gold_found"] for r in rs), "turn2_contained": sum(r["contained2"] for r in rs),
                    "read_tokens": statistics.median(r["read_tokens"] for r in rs), "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rs),
                    "ttft2_ms": 1000 * statistics.median(r["ttft2"] for r in rs)})
    return out


def chat_markdown(rows: Sequence[dict[str, Any]], retrieval: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Two-turn conversations: turn two with the exact prefix cache", "",
        f"{meta.get('hardware', {}).get('cpu', '')} ({meta.get('hardware', {}).get('threads', '?')} threads), "
        f"{meta.get('model', '')}, {meta.get('max_new_tokens')} new tokens at most, {meta.get('n')} conversations. "
        "Turn two's TTFT: with the prefix cache (reads only the new tokens), without it (the method reads the whole "
        "conversation again) and Full Attention over the same conversation (no cache). Speed-ups are medians of "
        "per-conversation ratios from one run. 'same as no cache': turn two with the cache answered token for token as "
        "without it; that is the promise wherever the context is exact (Full Attention, contexts read whole). An "
        "approximate method's turn two with the cache continues turn one's state exactly as it was computed, so it "
        "may part from a fresh re-read of the whole conversation.", "",
        "| context | method | chunk tokens | read whole | turn 2 TTFT: cache | no cache | Full | cache speed-up | vs Full "
        "| same as no cache | turn 2 contains gold | Full contains gold | agrees with Full | turn 1 contains gold |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        n = r["n"]
        lines.append(
            f"| {r['kind']} | {r['method']} | {r['context_tokens']} | {r['read_whole']}/{n} | {r['ttft2_cache_ms']:.0f} ms "
            f"| {r['ttft2_no_cache_ms']:.0f} ms | {r['ttft2_full_ms']:.0f} ms | **{r['speedup_cache']:.1f}x** | {r['speedup_vs_full']:.1f}x "
            f"| {r['identical']}/{n} | {r['turn2_contained']}/{n} | {r['turn2_full_contained']}/{n} | {r['agree_full']}/{n} | {r['turn1_contained']}/{n} |"
        )
    if retrieval:
        lines += ["", "## What a follow-up retrieves with", "",
                  f"One index of every conversation's 10-passage context ({meta.get('indexed', '?')} chunks); turn two's top "
                  f"{meta.get('k')} for three queries, and turn two answered from them (default method), after the same turn one "
                  "(its top {k} for its own question) with the prefix cache holding that turn alone. The last row is the recent "
                  "user turns' chunks with those turn one read first, in turn one's order (what `kvrag serve` reads): the same "
                  "chunks as the row above it, so the same answers wherever the context is exact, and a prompt whose start "
                  "the prefix cache still holds. Tokens read and TTFT are medians.".replace("{k}", str(meta.get("k"))), "",
                  "| query | gold document retrieved | turn 2 contains gold | turn 2 tokens read (of its prompt) | turn 2 TTFT |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['gold_found']}/{r['n']} | {r['turn2_contained']}/{r['n']} "
                  f"| {r.get('read_tokens', 0):.0f} of {r.get('prompt_tokens', 0):.0f} | {r.get('ttft2_ms', 0):.0f} ms |" for r in retrieval]
    return "\n".join(lines) + "\n"


def chat_plot(rows: Sequence[dict[str, Any]], path: Path) -> Path | None:
    from kvrag.eval.plots import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    labels = [f"{r['kind']}\n{r['method']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows)), 4))
    w = 0.27
    ax.bar([x - w for x in xs], [r["ttft2_full_ms"] for r in rows], w, label="Full Attention")
    ax.bar(list(xs), [r["ttft2_no_cache_ms"] for r in rows], w, label="method, no prefix cache")
    ax.bar([x + w for x in xs], [r["ttft2_cache_ms"] for r in rows], w, label="method + prefix cache")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("turn-two TTFT (ms, median)")
    ax.set_title("Turn two of a conversation")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_chat_bench(rag: Any, out_dir: str | Path, methods: Sequence[str], data_dir: Path | None = None, n: int | None = None,
                   max_new_tokens: int = 32, passages: int = 10, k: int = 5, retrieval: bool = True, progress: bool = True) -> dict[str, Any]:
    """Every conversation x context kind x method, then the retrieval section; writes chat.json, chat.md, chat.png."""
    from kvrag.eval.runner import hardware
    from tqdm.auto import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cases = load_cases(data_dir, passages)[:n]
    rag.precompute([c for case in cases for kind in KINDS for c in case.context[kind]], progress=progress)
    rag.chat(Conversation.ask("Warm-up?"), chunks=cases[0].context["short"], max_new_tokens=2, prefix_cache=False)  # untimed
    records = []
    jobs = [(c, kind, m) for kind in KINDS for c in cases for m in methods]
    for case, kind, method in tqdm(jobs, desc="conversations", disable=not progress):
        records.append(run_case(rag, case, kind, method, max_new_tokens))
    rows = summarize(records)
    t0 = time.perf_counter()
    ret_rows = []
    if retrieval:
        with tempfile.TemporaryDirectory(prefix="kvrag-chat-index-") as index_dir:  # the index is the run's own, not a result
            ret_rows = retrieval_modes(rag, cases, Path(index_dir), k, max_new_tokens)
    meta = {"hardware": hardware(), "model": getattr(rag.lm, "source", ""), "max_new_tokens": max_new_tokens, "n": len(cases),
            "methods": list(methods), "k": k, "indexed": len({c.id for case in cases for c in case.context["10 passages"]}),
            "retrieval_s": time.perf_counter() - t0}
    result = {"meta": meta, "summary": rows, "retrieval": retrieval_summary(ret_rows), "records": records, "retrieval_records": ret_rows}
    (out / "chat.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    (out / "chat.md").write_text(chat_markdown(rows, result["retrieval"], meta), encoding="utf-8")
    chat_plot(rows, out / "chat.png")
    return result
