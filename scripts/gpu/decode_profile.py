"""Where a decode step's time goes (issue #39, run on a lent GPU by `device.sh first`): the answer
loop's rate at two lengths, then torch.profiler over a short answer (CPU-side and, on CUDA,
CUDA-side totals of the top ops).

    python decode_profile.py TOKENIZER                                   # the 8B bf16 shape at 8k, on CUDA
    python decode_profile.py --device cpu --chunks 2 --chunk-tokens 64 --tokens 4,8 --profile-tokens 4
                                                                         # the bundled model: device.sh's dry run

Each line is printed (flushed) as it is measured, so a call cut off by its time limit still
returns the rates it finished.
"""

from __future__ import annotations

import argparse
import time

import torch

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
    p.add_argument("--profile-tokens", type=int, default=32)
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
    rag.precompute(chunks, progress=False)
    for n in (int(x) for x in args.tokens.split(",")):
        sync(args.device)
        t = time.perf_counter()
        ans = rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=n, stop_at="none")
        sync(args.device)
        s = ans.stats
        print(f"{n} tokens: decode {s.decode_tokens_per_s:.1f} tok/s, setup {s.decode_setup_s * 1000:.0f} ms, "
              f"whole {time.perf_counter() - t:.2f} s, forwards {getattr(s, 'decode_forwards', None)}", flush=True)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=args.profile_tokens, stop_at="none")
        sync(args.device)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60), flush=True)
    if args.device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
