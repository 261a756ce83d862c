#!/usr/bin/env bash
# The KVLink evaluation (README "KVLink"): train the comparison adapters, then answer nq10_dev rows
# 1200-1599 (never trained on) under every setting, scored against the base model's Full Attention.
#
#   scripts/kvlink_eval.sh [DATA] [OUT] [DEVICE]      e.g. scripts/kvlink_eval.sh ../shared/data/nq10_dev.jsonl runs/kvlink-eval cuda
#
# The shipped adapter (links mode, K=5) comes from the README's one CPU command and is evaluated as it
# ships; the others are trained here with the same recipe (rows 0:1200, batch 1 x 8 accumulated,
# 110 steps, seed 0, fp32): LoRA with K=0 (the BlockAttention baseline), 1 and 5 link tokens, and
# links-only K=1. The answers run as parallel parts (one process each, their own Full reference) and
# are merged into one table; re-running resumes every step.
set -euo pipefail
DATA=${1:-../shared/data/nq10_dev.jsonl}
OUT=${2:-runs/kvlink-eval}
DEV=${3:-auto}
SHIPPED=kvrag/adapters/smollm2-135m-instruct.kvlink.safetensors
TRAIN="--data $DATA --rows 0:1200 --batch-size 1 --grad-accum 8 --max-steps 110 --seed 0 --device $DEV --dtype float32 --no-progress"
EVAL="--data $DATA@1200:1600 --n 400 --max-new-tokens 16 --contexts none --device $DEV --dtype float32 --store memory://"
mkdir -p "$OUT/parts"

train() {  # NAME MODE K
    [ -f "$OUT/$1/adapter.safetensors" ] && return 0
    python -m kvrag.train $TRAIN --mode "$2" --link-tokens "$3" --out "$OUT/$1" >"$OUT/$1.log" 2>&1
}

part() {  # NAME METHODS RATIOS [--adapter NAME=PATH ...]
    local name=$1 methods=$2 ratios=$3
    shift 3
    kvrag bench $EVAL --methods "$methods" --ratios "$ratios" "$@" --out "$OUT/parts/$name" >"$OUT/parts/$name.log" 2>&1
}

# Parts that need no training start at once; the others start as their adapters appear.
part base "fusionrag,cacheblend" 0.15 &
part shipped "kvlink:link_tokens=5,model=links5" 0 --adapter "links5=$SHIPPED" &
part compose "kvlink:link_tokens=5,select=a3,model=links5" 0.15 --adapter "links5=$SHIPPED" &
(
    train lora0 lora 0 && train lora1 lora 1 && train lora5 lora 5 && train links1 links 1
) &
trainer=$!
wait_for() { while [ ! -f "$OUT/$1/adapter.safetensors" ]; do kill -0 $trainer 2>/dev/null || { echo "training $1 failed: see $OUT/$1.log" >&2; return 1; }; sleep 5; done; }
(wait_for lora1 && part lora01 "kvlink:link_tokens=0,model=lora0,kvlink:link_tokens=1,model=lora1" 0 \
    --adapter "lora0=$OUT/lora0/adapter.safetensors" --adapter "lora1=$OUT/lora1/adapter.safetensors") &
(wait_for lora5 && part lora5 "kvlink:link_tokens=5,model=lora5,full:model=lora5" 0 --adapter "lora5=$OUT/lora5/adapter.safetensors") &
(wait_for links1 && part links1 "kvlink:link_tokens=1,model=links1" 0 --adapter "links1=$OUT/links1/adapter.safetensors") &
wait
kvrag bench --merge "$(ls -d "$OUT"/parts/*/ | paste -sd,)" --out "$OUT/merged" --contexts none
