#!/usr/bin/env bash
# Soft tokens (and a LoRA after the chunks) distilled from base Full Attention with the model frozen, on the CPU,
# in pieces, keeping the adapter each piece ends with (OUT/snaps/step-N.safetensors) for `kvrag eval steps`.
#
#   scripts/train_frozen_distill.sh links      runs/distill-links       "0 15 40"
#   scripts/train_frozen_distill.sh lora-after runs/distill-lora-after  "0 15 40 80"
#   kvrag eval steps --run runs/distill-links,runs/distill-lora-after --sets nq10,facts,facts-long,musique,kv75 \
#     --n 12 --lengths 16 --store "memory://?max_bytes=4000000000" --out bench-out/steps
#
# The schedule is one epoch of the 2,000-row mix (250 steps of 8); each piece stops at its step and --resume goes
# on, so any prefix of the pieces is a prefix of the same run. Runs with the same seed see the same examples in the
# same order: point OUT/teacher of the second at the first's to reuse the teacher's targets (--teacher-cache).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:?links or lora-after}; OUT=${2:?run folder}; PIECES=${3:-"0 15 40 80 130 190 250"}
EXTRA=(); [ "$MODE" = lora-after ] && EXTRA=(--lr 2e-4)
mkdir -p runs "$OUT/snaps"
[ -f runs/facts-train.jsonl ] || python -m kvrag.eval.synthetic --n 300 --seed 0 --style short --docs 3 --phrasings train --out runs/facts-train.jsonl
[ -f runs/facts-long-train.jsonl ] || python -m kvrag.eval.synthetic --n 200 --seed 2 --style long --docs 6 --phrasings train --out runs/facts-long-train.jsonl
for S in $PIECES; do
  python -m kvrag.train --objective distill --mode "$MODE" --link-tokens 5 "${EXTRA[@]}" \
    --data ../shared/data/nq10_dev.jsonl@0:1200 --data ../shared/data/musique_dev.jsonl@0:100 \
    --data ../shared/data/kv75_dev.jsonl@0:200 --data runs/facts-train.jsonl@0:300 --data runs/facts-long-train.jsonl@0:200 \
    --teacher-tokens 32 --continue-share 0.5 --min-chunks 1 --max-tokens 1024 --batch-size 1 --grad-accum 8 \
    --epochs 1 --seed 0 --save-every 5 --resume --stop-at-step "$S" --out "$OUT" \
    --store "memory://?max_bytes=2000000000" --teacher-cache --no-progress
  cp "$OUT/adapter.safetensors" "$OUT/snaps/step-$S.safetensors"
  cp "$OUT/train_summary.json" "$OUT/snaps/step-$S.json"
  echo "$MODE: step $S at $(date +%T)"
done
