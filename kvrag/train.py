"""`kvrag train-links` / `python -m kvrag.train`: KVLink training (see `kvrag.training`).

The code lives in `kvrag.training` (config, data, passes, trainables, loop, cli); this module keeps
the names it always had, and the command, importable and runnable here.
"""

from __future__ import annotations

import sys

from kvrag.cli.train import add_train_links_parser, cmd_train_links, main
from kvrag.training.config import DEFAULT_LORA_TARGETS, TrainConfig
from kvrag.training.data import (
    EVAL_FILE,
    EVAL_ROWS,
    Example,
    answer_ids,
    build_example,
    context_positions,
    file_sha256,
    load_rows,
    shuffled_passages,
    training_mask,
)
from kvrag.training.loop import TrainResult, micro_batches, plot_losses, sample_order, save_checkpoint, total_steps, train
from kvrag.training.passes import (
    Context,
    PassBatch,
    _pad_stack,
    batch_logits,
    batch_loss,
    encode_context,
    example_loss,
    load_context,
    pass_batch,
    stitched_context,
)
from kvrag.training.trainables import export_adapter, lora_factors, lr_factor, optimizer_tensors, prepare_model, restore_optimizer

__all__ = [
    "DEFAULT_LORA_TARGETS", "EVAL_FILE", "EVAL_ROWS", "Context", "Example", "PassBatch", "TrainConfig", "TrainResult",
    "add_train_links_parser", "answer_ids", "batch_logits", "batch_loss", "build_example", "cmd_train_links",
    "context_positions", "encode_context", "example_loss", "export_adapter", "file_sha256", "load_context", "load_rows",
    "lora_factors", "lr_factor", "main", "micro_batches", "optimizer_tensors", "pass_batch", "plot_losses",
    "prepare_model", "restore_optimizer", "sample_order", "save_checkpoint", "shuffled_passages", "stitched_context",
    "total_steps", "train", "training_mask",
]

if __name__ == "__main__":
    sys.exit(main())
