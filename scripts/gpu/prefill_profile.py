"""One reuse prefill under torch.profiler at each context (the lent GPU's `device.sh first`): what the
host issues (kernel-launching ops, host syncs, copies, the layer feed's chunk copies) and where the
time goes (CPU and CUDA time by op), beside the synchronised TTFT of the same prefill.

    python prefill_profile.py TOKENIZER --contexts 4k,32k --store 'host://?pin=1'   # the 8B bf16 shape, CUDA
    python prefill_profile.py --shape none --device cpu --dtype float32 --contexts 256 --chunk-tokens 64
                                                                                  # the bundled model: the dry run

Every line is printed (flushed) as it is measured, so a call cut off by its limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrag import KVRag
from kvrag.eval.prefill_profile import profiled
from kvrag.eval.speed import QUESTION, corpus_chunks, parse_sizes
from kvrag.fuse import layer_feed


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def engine(args: argparse.Namespace) -> KVRag:
    if args.shape == "none":
        return KVRag.from_pretrained(None, store=args.store, device=args.device, dtype=args.dtype, check=False)
    from transformers import AutoTokenizer

    from kvrag.model.shapes import random_model

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    return KVRag(random_model(args.shape, tok, device=args.device, dtype=args.dtype), store=args.store, check=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tokenizer", nargs="?", default=None, help="with --shape: its tokenizer (device.sh: .gpu/tokenizer)")
    p.add_argument("--shape", default="llama-3.1-8b", help="random-weight shape; 'none': the bundled model's real weights")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--store", default="host://?pin=1", help="where the chunks' KV is read from (named in every line)")
    p.add_argument("--contexts", default="4k,32k")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--method", default="reuse")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=22, help="rows of each op table")
    args = p.parse_args()
    rag = engine(args)
    cuda = rag.lm.device.type == "cuda"
    print(f"device {rag.lm.device} {torch.cuda.get_device_name() if cuda else ''} dtype {rag.lm.dtype} model {rag.lm.source} "
          f"store {args.store} method {args.method} layer-wise {rag.repo.layerwise_load}", flush=True)
    for context in parse_sizes(args.contexts):
        n = max(1, context // args.chunk_tokens)
        chunks = corpus_chunks(rag.lm.tokenizer, n, args.chunk_tokens)
        rag.precompute(chunks, progress=False)
        ids = [c.id for c in chunks]
        ask = lambda: rag.prefill(QUESTION, ids, method=args.method)  # noqa: E731
        times = []
        for _ in range(args.repeats + 1):  # the first warms the prefix, the allocator and the kernels
            sync(cuda)
            t = time.perf_counter()
            pre = ask()
            sync(cuda)
            times.append(time.perf_counter() - t)
        s = pre.stats
        print(f"\n== {context} tokens ({n} chunks of {args.chunk_tokens}), KV from {args.store}: prefill {statistics.median(times[1:]) * 1000:.1f} ms "
              f"(median of {args.repeats}, synchronised); load {s.load_s * 1000:.1f} ms, stitch {s.stitch_s * 1000:.1f} ms, "
              f"recompute+question {s.recompute_s * 1000:.1f} ms, layer copies {s.layer_load_s * 1000:.1f} ms "
              f"(waited {s.load_wait_s * 1000:.1f} ms), tiers {s.tiers}", flush=True)
        feeds = []
        init = layer_feed.LayerFeed.__init__

        def tracked(self, *a, **k):  # the feed of the profiled prefill: its group size and copies
            init(self, *a, **k)
            feeds.append(self)

        layer_feed.LayerFeed.__init__ = tracked
        try:
            _, counts = profiled(ask, cuda=cuda, rows=args.rows)
        finally:
            layer_feed.LayerFeed.__init__ = init
        layers = rag.lm.model.config.num_hidden_layers
        feed = f"layer feed: {feeds[0].group} layers a copy group, {feeds[0].copies} chunk copies" if feeds else "no layer feed"
        print(f"kernel-launching ops {counts.kernel_ops} ({counts.kernel_ops / layers:.1f} a layer over {layers} layers), "
              f"host syncs {counts.sync_count} {counts.syncs}, aten::copy_ {counts.copies}; {feed}", flush=True)
        print("top ops by count:", counts.by_op.most_common(12), flush=True)
        print(counts.table, flush=True)


if __name__ == "__main__":
    main()
