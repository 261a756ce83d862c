"""`kvrag bench-decode`: single-stream decode speed against stock `generate` and the weights-read bound.

Decoding is most of an answer's time (issue #39). Per context length, in one run and interleaved:
- the engine's decode with the growing-cache forward (`static=False`, the CPU path before issue #39);
- the engine's decode with its default step (static buffers, the lean step on supported models, and
  prompt-lookup drafts: kvrag.decode.draft), and the same step without drafts;
- stock transformers `generate` on the same prompt (greedy, KV cache): its decode rate is
  (new tokens - 1) / (time for N tokens - time for 1 token), so its prefill is not counted;
- the bound: the bytes of weights one step must read (every parameter; a tied embedding once, read
  whole as the output layer) over the machine's measured read bandwidth (a sum over 1 GiB).
Tokens must match: the engine's paths and `generate` decode the same greedy tokens. The first run of
each path is reported too (nothing is compiled: the first answer after start-up pays no set-up).
With `data`: the drafts' speed-up and agreement on real questions (kvrag.eval.draft_speed).

With `int8` (on the CPU): the engine's default step over int8 decode weights (kvrag.decode.int8, opt-in)
in the same interleaved runs, its own bound (its bytes), whether its tokens are the model's and where
they first part; and, since int8 may change answers, how close its answers are to the model's own on
the bundled sample's questions in every phrasing (`int8_agreement`).
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from kvrag.kv.prefix_cache import without_prefix_cache
from kvrag.decode.lean import lean_step, use_decode_weights
from kvrag.defaults import DEFAULT_DRAFT_TOKENS
from kvrag.eval.draft_speed import draft_markdown, draft_speed
from kvrag.decode.stream import DecodeConfig, DecodeState, stream_tokens
from kvrag.types import Chunk

WORDS = ("river", "bridge", "market", "station", "tower", "harbour", "garden", "library", "mill", "canal")


def filler_chunks(tokens: int, tokenizer: Any, seed: int = 0) -> list[Chunk]:
    """Plain fictional-fact chunks of ~200 tokens each, about `tokens` tokens in all."""
    rng = random.Random(seed)
    chunks, total, i = [], 0, 0
    while total < tokens:
        text = " ".join(
            f"The {rng.choice(WORDS)} of Town {rng.randint(1, 999)} opened in {rng.randint(1700, 2020)} "
            f"and {rng.randint(2, 900)} people came to see it." for _ in range(12)
        )
        chunks.append(Chunk(f"filler-{seed}-{i}", text, f"Record {i}"))
        total += len(tokenizer.encode(text, add_special_tokens=False))
        i += 1
    return chunks


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a torch sum reads over `gib` GiB (the best of `repeats`)."""
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t))
    return best


def weight_bytes(model: Any) -> int:
    """Bytes of every parameter (shared ones, such as a tied embedding, once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def random_pool(model: Any, context_tokens: int, rows: int, steps: int = 16) -> tuple[Any, list[Any]]:
    """A slot pool of `model` (kvrag.decode.pool) and its step (kvrag.decode.graphs) with `rows` sequences
    seated, each over the same `context_tokens` of random K/V (timing only) with room for `steps` more.
    None, [] without a lean step. What the step timer and scripts/gpu/decode_profile.py measure."""
    from kvrag.decode.graphs import PooledStep
    from kvrag.decode.pool import SlotPool

    step = lean_step(model)
    if step is None:
        return None, []
    cfg = model.config
    param = next(model.parameters())
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (1, kv_heads, context_tokens, head_dim)
    kv = [tuple(torch.randn(shape, generator=gen).to(param.device, param.dtype) for _ in range(2))
          for _ in range(cfg.num_hidden_layers)]
    pooled = PooledStep(step, SlotPool(len(kv), kv_heads, head_dim, param.dtype, param.device, max_rows=rows))
    seats = [pooled.seat(kv, context_tokens, context_tokens + steps) for _ in range(rows)]
    return pooled, seats


def batched_step_ms(model: Any, context_tokens: int, sizes: Sequence[int] = (1, 8), repeats: int = 8,
                    graph: bool | None = None) -> dict[int, float]:
    """Milliseconds of one batched decode step for each number of sequences in `sizes`: the step the
    engine runs (the slot pool's, kvrag.decode.graphs; replayed from its CUDA graph on CUDA unless
    `graph=False`), every sequence over its own `context_tokens` of K/V (random: timing only), the sizes
    interleaved and the median of `repeats` kept (the first round, which captures, is left out). Why:
    how much more a step of 8 sequences costs than a step of one is what batching can give at most
    (the server benchmark's ceiling). {} without a lean step."""
    pooled, seats = random_pool(model, context_tokens, max(sizes), repeats + 2)
    if pooled is None:
        return {}
    device = pooled.pool.device
    graph = device.type == "cuda" if graph is None else graph
    times: dict[int, list[float]] = {b: [] for b in sizes}
    for i in range(repeats + 1):  # the first round warms up (and captures)
        for b in sizes:
            slot = context_tokens + i
            feeds = [(seats[j], 100 + i, slot, slot) for j in range(b)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            pooled.run(feeds, graph)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times[b].append((time.perf_counter() - t) * 1000)
    return {b: round(statistics.median(v), 1) for b, v in times.items()}


def _engine_decode(rag: Any, question: str, chunks: list[Chunk], new_tokens: int, static: bool | None,
                   drafts: int = DEFAULT_DRAFT_TOKENS) -> tuple[float, list[int], int]:
    """Decode tok/s, the tokens, and the forwards they took."""
    pre = rag.prefill(question, chunks=chunks, method="full")  # the prompt `generate` reads, read as it reads it
    cfg = DecodeConfig(max_new_tokens=new_tokens, static=static, draft_tokens=drafts)
    state = DecodeState()
    t = time.perf_counter()
    for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context,
                           (), pre.segments.read_ids()):
        pass
    dt = time.perf_counter() - t
    return (len(state.token_ids) - 1) / dt if len(state.token_ids) > 1 else 0.0, state.token_ids, state.forwards


def _generate_decode(rag: Any, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    model, eos = rag.lm.model, rag.lm.tokenizer.eos_token_id
    kwargs = dict(do_sample=False, pad_token_id=eos, use_cache=True)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, **kwargs)
        one = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(input_ids, max_new_tokens=new_tokens, **kwargs)
        many = time.perf_counter() - t
    ids = out[0, input_ids.shape[1]:].tolist()
    return (len(ids) - 1) / max(1e-9, many - one) if len(ids) > 1 else 0.0, ids


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two decodes part (None: they are the same)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def int8_bytes(model: Any) -> int:
    """Bytes one int8 decode step reads: its int8 linears and scales, plus the norms' weights."""
    step = lean_step(model, "int8")
    assert step is not None and step.int8 is not None
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    return step.int8.nbytes + norms


@without_prefix_cache
def run_decode_bench(rag: Any, contexts: list[int], new_tokens: int = 64, repeats: int = 3, int8: bool = False,
                     data: Path | None = None, draft_sets: Sequence[str] = (), draft_n: int = 8) -> dict[str, Any]:
    """Decode tokens/s per context length and path (medians of `repeats` interleaved runs), and the bound."""
    bandwidth = read_bandwidth()
    wbytes = weight_bytes(rag.lm.model)
    model = rag.lm.model
    int8 = int8 and use_decode_weights(model, "int8") == "int8"  # made now: no run pays for quantising
    use_decode_weights(model, "model")
    question = "Which of these places opened first, and how many people came to see it?"
    rows = []
    for n in contexts:
        chunks = filler_chunks(n, rag.lm.tokenizer, seed=n)
        rag.precompute(chunks, progress=False)
        chunk_ids = [rag.layout.chunk_ids(c) for c in chunks]
        prompt_ids = rag.layout.segments(chunk_ids, question).all_ids()  # what Full Attention reads
        paths = (("growing", False, 0), ("engine", None, DEFAULT_DRAFT_TOKENS), ("no_drafts", None, 0))
        paths += (("int8", None, DEFAULT_DRAFT_TOKENS),) if int8 else ()
        speeds: dict[str, list[float]] = {name: [] for name, _, _ in paths}
        speeds["generate"] = []
        tokens: dict[str, list[int]] = {}
        forwards = 0
        for _ in range(repeats):
            for name, static, drafts in paths:
                use_decode_weights(model, "int8" if name == "int8" else "model")
                try:
                    tps, ids, fwd = _engine_decode(rag, question, chunks, new_tokens, static, drafts)
                finally:
                    use_decode_weights(model, "model")
                speeds[name].append(tps)
                tokens[name] = ids
                forwards = fwd if name == "engine" else forwards
            if prompt_ids is not None:
                tps, ids = _generate_decode(rag, torch.tensor([prompt_ids], device=rag.lm.device), new_tokens)
                speeds["generate"].append(tps)
                tokens["generate"] = ids
        pre = rag.prefill(question, chunks=chunks, method="full")
        row = {"context_tokens": pre.stats.prompt_tokens, "new_tokens": len(tokens["engine"])}
        for name, vals in speeds.items():
            row[f"{name}_tok_s"] = round(statistics.median(vals), 2) if vals else None
            row[f"{name}_first_tok_s"] = round(vals[0], 2) if vals else None
        row["tokens_per_forward"] = round((len(tokens["engine"]) - 1) / forwards, 2) if forwards else None
        row["engine_same_tokens_as_growing"] = tokens["engine"] == tokens["growing"] == tokens["no_drafts"]
        row["generate_same_tokens"] = tokens.get("generate") == tokens["engine"] if "generate" in tokens else None
        if int8:
            row["int8_first_difference"] = first_difference(tokens["int8"], tokens["engine"])
        rows.append(row)
    bound = bandwidth / wbytes
    out = {"weights_bytes": wbytes, "read_gb_s": round(bandwidth / 1e9, 1), "bound_tok_s": round(bound, 1),
           "dtype": str(rag.lm.dtype).replace("torch.", ""), "repeats": repeats, "rows": rows}
    if int8:
        out["int8_weights_bytes"] = int8_bytes(model)
        out["int8_bound_tok_s"] = round(bandwidth / out["int8_weights_bytes"], 1)
        out["int8_agreement"] = int8_agreement(rag, new_tokens)
    if data is not None and draft_sets:
        out["drafts"] = draft_speed(rag, data, draft_sets, draft_n, new_tokens)
    return out


@without_prefix_cache
def int8_agreement(rag: Any, new_tokens: int = 64) -> dict[str, Any]:
    """How close int8 decoding's answers are to the model's own: every bundled sample question in every
    phrasing, read over the chunks of its own document with the engine's default method, answered to
    `new_tokens` tokens (no stop rule: the longer the answer, the likelier int8 parts from it) with
    each kind of decode weights."""
    from kvrag.eval.metrics import contains
    from kvrag.ingest.documents import load_documents
    from kvrag.ingest.samples import sample_corpus_dir, sample_questions

    docs = load_documents([sample_corpus_dir()])
    rag.precompute(docs, progress=False)
    rows = []
    model = rag.lm.model
    for q in sample_questions():
        chunks = [c for c in docs if str(c.metadata.get("source", "")).endswith(q["file"])]
        for question in [q["question"], *q.get("phrasings", [])]:
            texts = {}
            for kind in ("model", "int8"):
                use_decode_weights(model, kind)
                try:
                    texts[kind] = rag.answer(question, chunks=chunks, max_new_tokens=new_tokens, stop_at="none").text
                finally:
                    use_decode_weights(model, "model")
            rows.append({"question": question, "gold": q["answer"], "model": texts["model"], "int8": texts["int8"],
                         "same": texts["model"] == texts["int8"],
                         "model_contains": bool(contains(texts["model"], [q["answer"]])),
                         "int8_contains": bool(contains(texts["int8"], [q["answer"]]))})
    n = len(rows)
    return {"questions": n, "new_tokens": new_tokens, "same_answer": sum(r["same"] for r in rows),
            "model_contains": sum(r["model_contains"] for r in rows), "int8_contains": sum(r["int8_contains"] for r in rows),
            "rows": rows}


def decode_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    b = result["bound_tok_s"]
    lines = [
        "# kvrag bench-decode", "", f"`{meta.get('command', '')}`", "",
        f"hardware: {meta.get('hardware_line', '')}; model: {meta.get('model', '')} ({result['dtype']}); greedy, one stream; "
        f"medians of {result['repeats']} interleaved runs. Bound: {result['weights_bytes'] / 1e6:.0f} MB of weights read per token "
        f"at {result['read_gb_s']} GB/s (a torch sum over 1 GiB) = **{b} tok/s** for one token per read of the weights; "
        f"with drafts (kvrag.decode.draft, {DEFAULT_DRAFT_TOKENS} a step, the default) one read serves several tokens. "
        "Nothing is compiled: the first run of each path (after start-up) is shown beside the median.", "",
        "| context tokens | new tokens | engine (default: drafts) | first run | without drafts | growing-cache step | stock `generate` "
        "| engine ÷ bound | without drafts ÷ bound | tokens per forward | same tokens (engine = no drafts = growing; = generate) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        gen = "–" if r["generate_tok_s"] is None else f"{r['generate_tok_s']:.1f}"
        lines.append(
            f"| {r['context_tokens']} | {r['new_tokens']} | **{r['engine_tok_s']:.1f}** | {r['engine_first_tok_s']:.1f} | "
            f"{r['no_drafts_tok_s']:.1f} | {r['growing_tok_s']:.1f} | {gen} | {100 * r['engine_tok_s'] / b:.0f}% | "
            f"{100 * r['no_drafts_tok_s'] / b:.0f}% | {r['tokens_per_forward']} | "
            f"{r['engine_same_tokens_as_growing']}; {r['generate_same_tokens']} |"
        )
    if "drafts" in result:
        lines += draft_markdown(result["drafts"])
    if "int8_bound_tok_s" in result:
        b8, a = result["int8_bound_tok_s"], result["int8_agreement"]
        lines += [
            "", f"**int8 decode weights** (opt-in, `--decode-weights int8`): {result['int8_weights_bytes'] / 1e6:.0f} MB read per token, "
            f"bound **{b8} tok/s**. Prefill (and the first token) read the model's own weights; the decode steps after it read int8.", "",
            "| context tokens | int8 tok/s | × model's weights | int8 ÷ its bound | tokens the same as the model's |", "|---|---|---|---|---|",
        ]
        for r in result["rows"]:
            d = r["int8_first_difference"]
            same = "all" if d is None else f"first {d} of {r['new_tokens']}"
            lines.append(f"| {r['context_tokens']} | **{r['int8_tok_s']:.1f}** | {r['int8_tok_s'] / r['engine_tok_s']:.2f}× | "
                         f"{100 * r['int8_tok_s'] / b8:.0f}% | {same} |")
        n = a["questions"]
        lines += [
            "", f"How close int8's answers are to the model's own: the bundled sample's {n} questions (every phrasing), each over its "
            f"document's chunks with the default method, {a['new_tokens']} new tokens, no stop rule:", "",
            "| decode weights | same answer as the model's | contains the gold answer |", "|---|---|---|",
            f"| model (its own) | {n} of {n} | {a['model_contains']} of {n} |",
            f"| int8 | **{a['same_answer']} of {n}** | {a['int8_contains']} of {n} |",
        ]
    return "\n".join(lines) + "\n"
