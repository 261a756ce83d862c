"""Where an 8B bf16 decode step's time goes at 8k (issue #39, run on a lent GPU): the answer loop's
rate, then torch.profiler over 32 tokens (CPU-side and CUDA-side totals of the top ops)."""
import sys
import time

import torch
from transformers import AutoTokenizer

from kvrag import KVRag
from kvrag.eval.speed import QUESTION, corpus_chunks
from kvrag.model.shapes import random_model

tok = AutoTokenizer.from_pretrained(sys.argv[1])
lm = random_model("llama-3.1-8b", tok, device="cuda", dtype="bfloat16")
rag = KVRag(lm, store="memory://", check=False)
chunks = corpus_chunks(tok, 16, 512)
rag.precompute(chunks, progress=False)
for n in (64, 256):
    torch.cuda.synchronize()
    t = time.perf_counter()
    ans = rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=n, stop_at="none")
    torch.cuda.synchronize()
    s = ans.stats
    print(f"{n} tokens: decode {s.decode_tokens_per_s:.1f} tok/s, setup {s.decode_setup_s*1000:.0f} ms, whole {time.perf_counter()-t:.2f} s, forwards {getattr(s, 'decode_forwards', None)}")
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    rag.answer(QUESTION, chunks=chunks, method="reuse", max_new_tokens=32, stop_at="none")
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
