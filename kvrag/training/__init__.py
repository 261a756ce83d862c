"""`kvrag train-links`: fine-tune KVLink link tokens (and optionally LoRA or every weight).

A training example is a prompt laid out as at inference,

    [system prefix | chunk 1 | links(1) | ... | chunk N | links(N) | question | answer]

and it is computed the way inference computes it, so the model is trained on exactly what it will
see (tested: the training pass reproduces the engine's first-token logits):

1. the context: each chunk's KV computed after the system prefix alone (precompute), its keys
   re-rotated to the chunk's place in the prompt (stitch). Mode `links` reads it from the engine's
   KV store (the model is frozen, so every passage is computed once for the whole run); modes
   `lora`/`full` encode it here, with gradients, in one forward whose mask is the picture's chunk rows;
2. the pass: the link tokens, the question and the answer in one forward over that context, at
   their inference positions, under KVLink's picture (`kvrag.fuse.links.link_picture`, the function the
   inference pass draws its mask with): link tokens, question and answer see every earlier position.

The loss (objective `gold`, the default) is the cross-entropy of the answer tokens only. Objective
`distill` (`--objective distill`, module `distill`) never reads the gold answers: the base model
(LoRA off) with Full Attention over the same prompt without link slots greedily continues it for
`--teacher-tokens` tokens, and the loss is the mean KL(teacher || student) over that continuation,
the student teacher-forced over the teacher's tokens on the reused KV (+ `--ce-weight` x their
cross-entropy). Its examples are "qa" (a row's passages and question) or, for `--continue-share`
of them, "continue" (a row's passage text as chunks, the question slot "Continue the text."). Modes:

- `links`: only the link embeddings train (new rows beside the frozen vocabulary);
- `lora`: LoRA factors (through `peft`, `pip install kvrag[train]`) plus the links;
- `full`: every weight plus the links.

Data: JSONL rows shaped like `shared/data/*.jsonl` ({question, answers[], ctxs[{title,text}],
gold_index, source}); `--data PATH` (repeatable, `PATH@START:END` for a row range, else `--rows`).
Each example's chunk order is shuffled with the gold passage moved to a random position (KVLink
App. A.5), seeded by (seed, epoch, row), so a run is reproducible and resumable. Rows 1200-1599 of
nq10_dev.jsonl are the evaluation split and refused. Every source file's path, sha256, row range
and the rows' own `source` fields go into the adapter's header.

Batching (right-padded micro-batches, one forward per stage), gradient accumulation, AdamW with
warm-up and cosine decay, fixed seeds; a checkpoint (safetensors + JSON only) every `--save-every` steps in OUT/checkpoint, which
`--resume` continues from exactly; a tqdm bar with the loss; OUT/loss.png; OUT/adapter.safetensors.
The same command runs on the CPU for the bundled model and on CUDA for bigger ones.

Modules: `config` (TrainConfig), `data` (rows, examples), `passes` (context KV, the pass, the loss),
`distill` (objective distill: the teacher, its cached targets, the KL), `ahead` (`--teacher-only`: the
schedule's teacher targets computed ahead, for a run trained in pieces),
`trainables` (model preparation, adapter export, lr schedule, optimizer state), `loop` (checkpoints,
`train()`); the command is `kvrag.cli.train` (`kvrag train-links` / `python -m kvrag.train`). `kvrag.train` re-exports them.
"""
