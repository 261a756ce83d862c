"""Where a decode step's time goes (issues #39, #60; run on a lent GPU by `device.sh first`): the answer
loop's rate at two lengths, then torch.profiler over a short answer (CPU-side and, on CUDA,
CUDA-side totals of the top ops); then, with `--rows N`, the batched step (the slot pool's,
kvrag.decode.graphs) at the same context a row: its time at `--sizes` rows replayed from its CUDA
graphs and run eagerly, and torch.profiler over one step of N rows, replayed and eager (the eager one
lists the kernels a replay runs).

    python decode_profile.py TOKENIZER                                   # the 8B bf16 shape at 8k, on CUDA
    python decode_profile.py TOKENIZER --tokens '' --profile-tokens 0 --rows 8
                                                                         # the batched step alone, 8k a row
    python decode_profile.py --device cpu --chunks 2 --chunk-tokens 64 --tokens 4,8 --profile-tokens 4
                                                                         # the bundled model: device.sh's dry run

Each line is printed (flushed) as it is measured, so a call cut off by its time limit still
returns the rates it finished.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import profile

from kvrag import KVRag
from kvrag.eval.speed import QUESTION, corpus_chunks


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer", nargs="?", default=None, help="with --shape: its tokenizer (device.sh: .gpu/tokenizer)")
    p.add_argument("--shape", default="llama-3.1-8b", help="random-weight shape; 'none': the bundled model's real weights")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--tokens", default="64,256", help="answer lengths whose decode rate is printed")
    p.add_argument("--profile-tokens", type=int, default=32, help="0: no profile of an answer")
    p.add_argument("--rows", type=int, default=0, help="rows of the profiled batched step (0: no batched step)")
    p.add_argument("--sizes", default="1,2,4,8,16", help="rows the batched step is timed at")
    args = p.parse_args()
    if args.shape == "none":
        rag = KVRag.from_pretrained(None, store="memory://", device=args.device, dtype=args.dtype, check=False)
        tok = rag.lm.tokenizer
    else:
        from transformers import AutoTokenizer

        from kvrag.model.shapes import random_model

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        rag = KVRag(random_model(args.shape, tok, device=args.device, dtype=args.dtype), store="memory://", check=False)
    chunks = corpus_chunks(tok, args.chunks, args.chunk_tokens)
    if args.tokens or args.profile_tokens > 0:
        rag.precompute(chunks, progress=False)
    for n in (int(x) for x in args.tokens.split(",") if x):
        sync(args.device)
        t = time.perf_counter()
        ans = rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=n, stop_at="none")
        sync(args.device)
        s = ans.stats
        print(f"{n} tokens: decode {s.decode_tokens_per_s:.1f} tok/s, setup {s.decode_setup_s * 1000:.0f} ms, "
              f"whole {time.perf_counter() - t:.2f} s, forwards {getattr(s, 'decode_forwards', None)}", flush=True)
    if args.profile_tokens > 0:
        with profile(activities=activities(args.device)) as prof:
            rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=args.profile_tokens, stop_at="none")
            sync(args.device)
        tables(prof, args.device)
    if args.rows > 0:
        context = args.chunks * args.chunk_tokens
        batched(rag.lm.model, context, args.rows, [int(x) for x in args.sizes.split(",") if x], args.device)


def activities(device: str) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])


def tables(prof, device: str) -> None:  # noqa: ANN001 (torch.profiler.profile)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
    if device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)


def batched(model, context: int, rows: int, sizes: list[int], device: str) -> None:  # noqa: ANN001 (a torch model)
    """The slot pool's step at `context` tokens a row: ms at each size (graphed, eager), then one step of
    `rows` rows under torch.profiler, replayed (on CUDA) and eager."""
    from kvrag.eval.decode_speed import batched_step_ms, random_pool

    graphed = device == "cuda"
    if sizes:
        ms = batched_step_ms(model, context, sizes, repeats=5, graph=graphed)
        eager = batched_step_ms(model, context, sizes, repeats=3, graph=False) if graphed else ms
        print(f"batched step at {context} context tokens a row, ms by rows: "
              f"{'graphed ' + str(ms) + '; ' if graphed else ''}eager {eager}", flush=True)
    pooled, seats = random_pool(model, context, rows, steps=8)
    if pooled is None:
        print("no lean step for this model: no batched step", flush=True)
        return
    feeds = lambda i: [(s, 100 + i, context + i, context + i) for s in seats]  # noqa: E731
    modes = [True, False] if graphed else [False]
    for i, graph in enumerate(modes):
        pooled.run(feeds(2 * i), graph)  # warm (and capture)
        sync(device)
        with profile(activities=activities(device)) as prof:
            pooled.run(feeds(2 * i + 1), graph)
            sync(device)
        print(f"one {rows}-row step, {'replayed from its CUDA graph' if graph else 'eager'} "
              f"(span {pooled.pool.capacity}, captures so far {pooled.captures}):", flush=True)
        tables(prof, device)


if __name__ == "__main__":
    main()
