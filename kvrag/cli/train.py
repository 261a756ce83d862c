"""`kvrag train-links`: fine-tune KVLink link tokens (and optionally LoRA or every weight).

The argument parser (wired into `kvrag`'s CLI) and `python -m kvrag.train`; the run is `kvrag.training.loop.train`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Sequence

from kvrag.defaults import LINK_MODES as MODES, OBJECTIVES
from kvrag.training.config import TrainConfig


def add_train_links_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `train-links` to an argparse subparsers object (kvrag's CLI wires it in)."""
    p = subparsers.add_parser(
        "train-links",
        help="fine-tune KVLink link tokens (links / lora / full) and write a link adapter",
        description=__doc__.split("\n\n")[0],
    )
    d = TrainConfig(out="")
    p.add_argument("--data", action="append", default=[], metavar="PATH[@START:END]", help="JSONL rows (repeatable)")
    p.add_argument("--rows", default=d.rows, help="row range for --data without its own (default %(default)s)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/, loss.png, adapter.safetensors")
    p.add_argument("--adapter-out", default=None, help="where to write the adapter (default OUT/adapter.safetensors)")
    p.add_argument("--model", default=None, help="HF id, folder or .gguf (default: the bundled SmolLM2)")
    p.add_argument("--mode", choices=MODES, default=d.mode, help="links: link embeddings only (base weights); trailers: link embeddings whose slots see only their own chunk and the system prefix (KV Packet's trailer vectors); lora: plus LoRA; lora-after: plus LoRA at the positions after the cached chunks only (their KV stays the base weights', read from the store); full: every weight")
    p.add_argument("--link-tokens", type=int, default=d.link_tokens, help="K link tokens per chunk (default %(default)s)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks, help="chunk indices with their own link rows (default %(default)s)")
    p.add_argument("--min-chunks", type=int, default=None,
                   help="each example keeps a random number of passages from this to --max-chunks, the gold one "
                        "among them, so short prompts are learned too (default: up to --max-chunks)")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over the rows (fractions allowed)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="rows per forward pass")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="forward passes per optimizer step")
    p.add_argument("--lr", type=float, default=d.lr, help="LoRA / full weights (default %(default)s)")
    p.add_argument("--link-lr", type=float, default=d.link_lr, help="link embeddings (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--warmup", type=int, default=d.warmup, help="learning-rate warm-up steps")
    p.add_argument("--lora-r", type=int, default=d.lora_r, help="LoRA rank (modes lora, lora-after)")
    p.add_argument("--lora-alpha", type=int, default=d.lora_alpha, help="LoRA scale numerator (modes lora, lora-after)")
    p.add_argument("--lora-targets", default=d.lora_targets, help="module names LoRA wraps, comma-separated (modes lora, lora-after)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the data order and initialisation")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="the longest example in tokens: trailing passages that are not the gold one are dropped to fit")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop and save after this long (one piece of a run trained in pieces: --resume continues it)")
    p.add_argument("--stop-at-step", type=int, default=None, metavar="STEP",
                   help="stop and save once the run reaches optimizer step STEP; unlike --max-steps the schedule keeps "
                        "its length, so --resume continues the same run")
    p.add_argument("--fit-schedule", action="store_true",
                   help="with --max-minutes: time the first steps, then shorten the schedule (warm-up, cosine decay) "
                        "so it ends inside the budget; the run then sees fewer rows than planned (the summary says how many)")
    p.add_argument("--device", default=d.device, help="auto (CUDA when present), cuda or cpu")
    p.add_argument("--dtype", default=d.dtype, help="the training dtype: auto (bfloat16 on CUDA, float32 elsewhere), float32 or bfloat16")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in the backward pass: less memory, more time")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--allow-eval-rows", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system-prompt", default=None, help="the system text the training prompts carry (default: the engine's instruction)")
    p.add_argument("--store", default=None, help="modes links, lora-after: KV store URL for chunk KV (default disk://$KVRAG_HOME/kv)")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help="gold: cross-entropy of the rows' gold answers; distill: imitate the base model with Full "
                        "Attention (KL over its greedy continuation; gold answers unused) (default %(default)s)")
    p.add_argument("--teacher-tokens", type=int, default=d.teacher_tokens,
                   help="distill: tokens the teacher continues greedily (default %(default)s)")
    p.add_argument("--teacher-topk", type=int, default=d.teacher_topk,
                   help="distill: keep the teacher's top-k log-probs and the rest's mass (default %(default)s: the whole vocabulary)")
    p.add_argument("--ce-weight", type=float, default=d.ce_weight,
                   help="distill: weight of the cross-entropy of the teacher's tokens added to the KL (default %(default)s)")
    p.add_argument("--continue-share", type=float, default=d.continue_share,
                   help="distill: share of examples that continue a row's text instead of answering its question (default %(default)s)")
    p.add_argument("--turn-share", type=float, default=d.turn_share,
                   help="distill: share of examples that are two-turn conversations over the row's passages (its question and "
                        "answer, then a follow-up the teacher answers; default %(default)s)")
    p.add_argument("--teacher-cache", action="store_true",
                   help="distill: also keep the teacher's targets in OUT/teacher/ (~6 MB an example at full vocabulary)")
    p.add_argument("--teacher-only", action="store_true",
                   help="distill: only compute the teacher's targets of the run's remaining steps into OUT/teacher "
                        "(batched; skips those there; --max-minutes ends it), for later pieces run with --teacher-cache")
    p.add_argument("--teacher-batch", type=int, default=d.teacher_batch,
                   help="distill, --teacher-only: prompts per batched teacher generation (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_links)
    return p


def cmd_train_links(args: argparse.Namespace) -> int:
    cfg = TrainConfig(
        out=args.out,
        data=list(args.data),
        rows=args.rows,
        model=args.model,
        mode=args.mode,
        link_tokens=args.link_tokens,
        max_chunks=args.max_chunks,
        min_chunks=args.min_chunks,
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        lr=args.lr,
        link_lr=args.link_lr,
        weight_decay=args.weight_decay,
        warmup=args.warmup,
        lora_r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_targets=args.lora_targets,
        seed=args.seed,
        save_every=args.save_every,
        max_tokens=args.max_tokens,
        max_minutes=args.max_minutes,
        stop_at=args.stop_at_step,
        fit_schedule=args.fit_schedule,
        device=args.device,
        dtype=args.dtype,
        grad_checkpointing=args.grad_checkpointing,
        resume=args.resume,
        allow_eval_rows=args.allow_eval_rows,
        progress=not args.no_progress,
        adapter_out=args.adapter_out,
        system_prompt=args.system_prompt,
        store=args.store,
        objective=args.objective,
        teacher_tokens=args.teacher_tokens,
        teacher_topk=args.teacher_topk,
        ce_weight=args.ce_weight,
        continue_share=args.continue_share,
        turn_share=args.turn_share,
        teacher_cache=args.teacher_cache,
        teacher_only=args.teacher_only,
        teacher_batch=args.teacher_batch,
    )
    if cfg.teacher_only:
        from kvrag.training.ahead import precompute_teacher  # torch, only once the command runs

        ahead = precompute_teacher(cfg)
        print(f"teacher targets: steps {ahead.from_step}-{ahead.to_step} of {ahead.end_step} on disk, {ahead.generated} generated "
              f"in {ahead.seconds / 60:.1f} min{'' if ahead.complete else ' (stopped at --max-minutes: run again to go on)'}",
              file=sys.stderr)
        return 0
    from kvrag.training.loop import train  # torch, only once the command runs

    result = train(cfg)
    first = result.losses[0] if result.losses else float("nan")
    last = result.losses[-1] if result.losses else float("nan")
    print(
        f"adapter: {result.adapter_path}  steps: {result.steps}  loss {first:.4f} -> {last:.4f}  "
        f"({result.seconds / 60:.1f} min{', this piece stopped early: --resume goes on' if result.stopped_early else ''})",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrag.train")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_links_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train-links":
        argv = ["train-links", *argv]
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
