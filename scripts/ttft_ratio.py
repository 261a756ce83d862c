"""Quick TTFT ratio Full Attention / reuse on nq10_dev rows (10 passages each), disk store warm.

Usage: python scripts/ttft_ratio.py [--rows 10] [--data ../shared/data/nq10_dev.jsonl]
The full benchmark is `kvrag bench` (a separate issue); this is the core engine's sanity figure.
"""

import argparse
import json
import platform
import statistics
import tempfile

import torch

from kvrag import Chunk, KVRag
from kvrag.quiet import quiet_libraries


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--data", default="../shared/data/nq10_dev.jsonl")
    args = ap.parse_args()
    quiet_libraries()
    rows = [json.loads(line) for line in open(args.data)][: args.rows]
    with tempfile.TemporaryDirectory() as tmp:
        rag = KVRag.from_pretrained(store=f"disk://{tmp}")
        ratios, full_t, reuse_t, ctx = [], [], [], []
        for row in rows:
            chunks = [Chunk(f"{row['id']}-{i}", c["text"], c["title"]) for i, c in enumerate(row["ctxs"])]
            rag.precompute(chunks, progress=False)
            ids = [c.id for c in chunks]
            rag.prefill(row["question"], ids, method="reuse")  # warm the page cache, as a serving store would be
            f = rag.prefill(row["question"], ids, method="full").stats
            r = rag.prefill(row["question"], ids, method="reuse").stats
            ratios.append(f.ttft_s / r.ttft_s)
            full_t.append(f.ttft_s)
            reuse_t.append(r.ttft_s)
            ctx.append(f.context_tokens / len(chunks))
    print(f"hardware: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"rows={len(rows)} chunks/row=10 mean tokens/chunk={statistics.mean(ctx):.0f}")
    print(f"TTFT full median {statistics.median(full_t) * 1000:.0f} ms, reuse median {statistics.median(reuse_t) * 1000:.0f} ms")
    print(f"TTFT ratio full/reuse: median {statistics.median(ratios):.1f}x (min {min(ratios):.1f}x, max {max(ratios):.1f}x)")


if __name__ == "__main__":
    main()
