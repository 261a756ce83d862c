"""`kvrag bench-decode`: single-stream decode speed against stock `generate` and the weights-read bound.

Decoding is most of an answer's time (issue #39). Per context length, in one run and interleaved:
- the engine's decode with the growing-cache forward (`static=False`, the CPU path before issue #39);
- the engine's decode with its default step (static buffers, the lean step on supported models);
- stock transformers `generate` on the same prompt (greedy, KV cache): its decode rate is
  (new tokens - 1) / (time for N tokens - time for 1 token), so its prefill is not counted;
- the bound: the bytes of weights one step must read (every parameter; a tied embedding once, read
  whole as the output layer) over the machine's measured read bandwidth (a sum over 1 GiB).
Tokens must match: the engine's two paths and `generate` decode the same greedy tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import torch

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


def _engine_decode(rag: Any, question: str, chunks: list[Chunk], new_tokens: int, static: bool | None) -> tuple[float, list[int]]:
    pre = rag.prefill(question, chunks=chunks, method="full")  # the prompt `generate` reads, read as it reads it
    cfg = DecodeConfig(max_new_tokens=new_tokens, static=static)
    state = DecodeState()
    t = time.perf_counter()
    for _ in stream_tokens(rag.lm, pre.output.cache, pre.logits, pre.output.next_position, cfg, state, rag.lm.max_context):
        pass
    dt = time.perf_counter() - t
    return (len(state.token_ids) - 1) / dt if len(state.token_ids) > 1 else 0.0, state.token_ids


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


def run_decode_bench(rag: Any, contexts: list[int], new_tokens: int = 64, repeats: int = 3) -> dict[str, Any]:
    """Decode tokens/s per context length and path (medians of `repeats` interleaved runs), and the bound."""
    bandwidth = read_bandwidth()
    wbytes = weight_bytes(rag.lm.model)
    question = "Which of these places opened first, and how many people came to see it?"
    rows = []
    for n in contexts:
        chunks = filler_chunks(n, rag.lm.tokenizer, seed=n)
        rag.precompute(chunks, progress=False)
        chunk_ids = [rag.layout.chunk_ids(c) for c in chunks]
        prompt_ids = rag.layout.segments(chunk_ids, question).all_ids()  # what Full Attention reads
        speeds: dict[str, list[float]] = {"growing": [], "engine": [], "generate": []}
        tokens: dict[str, list[int]] = {}
        for _ in range(repeats):
            for name, static in (("growing", False), ("engine", None)):
                tps, ids = _engine_decode(rag, question, chunks, new_tokens, static)
                speeds[name].append(tps)
                tokens[name] = ids
            if prompt_ids is not None:
                tps, ids = _generate_decode(rag, torch.tensor([prompt_ids], device=rag.lm.device), new_tokens)
                speeds["generate"].append(tps)
                tokens["generate"] = ids
        pre = rag.prefill(question, chunks=chunks, method="full")
        row = {"context_tokens": pre.stats.prompt_tokens, "new_tokens": len(tokens["engine"])}
        for name, vals in speeds.items():
            row[f"{name}_tok_s"] = round(statistics.median(vals), 2) if vals else None
        row["engine_same_tokens_as_growing"] = tokens["engine"] == tokens["growing"]
        row["generate_same_tokens"] = tokens.get("generate") == tokens["engine"] if "generate" in tokens else None
        rows.append(row)
    bound = bandwidth / wbytes
    return {"weights_bytes": wbytes, "read_gb_s": round(bandwidth / 1e9, 1), "bound_tok_s": round(bound, 1),
            "dtype": str(rag.lm.dtype).replace("torch.", ""), "repeats": repeats, "rows": rows}


def decode_markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    b = result["bound_tok_s"]
    lines = [
        "# kvrag bench-decode", "", f"`{meta.get('command', '')}`", "",
        f"hardware: {meta.get('hardware_line', '')}; model: {meta.get('model', '')} ({result['dtype']}); greedy, one stream; "
        f"medians of {result['repeats']} interleaved runs. Bound: {result['weights_bytes'] / 1e6:.0f} MB of weights read per token "
        f"at {result['read_gb_s']} GB/s (a torch sum over 1 GiB) = **{b} tok/s**.", "",
        "| context tokens | new tokens | engine (default step) | growing-cache step | stock `generate` | engine ÷ bound | same tokens (engine = growing; = generate) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        gen = "–" if r["generate_tok_s"] is None else f"{r['generate_tok_s']:.1f}"
        lines.append(
            f"| {r['context_tokens']} | {r['new_tokens']} | **{r['engine_tok_s']:.1f}** | {r['growing_tok_s']:.1f} | {gen} | "
            f"{100 * r['engine_tok_s'] / b:.0f}% | {r['engine_same_tokens_as_growing']}; {r['generate_same_tokens']} |"
        )
    return "\n".join(lines) + "\n"
