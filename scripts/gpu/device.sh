#!/usr/bin/env bash
# Run ON the lent GPU machine (the `device` tool's `run`, from the repo root): bash scripts/gpu/device.sh STEP [ARG]
#
# Why a script: a machine is lent by chance, for 30 minutes of device time, and starts bare. Its
# Python (3.12, torch 2.11 + CUDA) lacks this checkout's transformers, and a machine goes back 30 s
# after a call, so each call must set itself up. scripts/gpu/prepare.sh (run here first) puts the
# wheels and the bundled tokenizer in .gpu/ (~21 MB); every call carries [".gpu"] and may chain steps:
#
#   bash scripts/gpu/device.sh tests; bash scripts/gpu/device.sh gate; bash scripts/gpu/device.sh store;
#   bash scripts/gpu/device.sh speed 8b 'host://?pin=1'      (STORE: memory:// | host://?pin=1 | disk | default)
#   bash scripts/gpu/device.sh speed 8b disk light           (reuse + epic only: fits one call beside others)
#   bash scripts/gpu/device.sh decode                         (issue #39: 8B decode at 8k + a profile, ~50 s)
#   bash scripts/gpu/device.sh serve                          (issue #35: the server table, 8B shape; prepare.sh --serve)
#
# Issue #34's distilled adapter needs the real bundled model, whose 98 MB GGUF is more than one call
# carries (64 MiB with the checkout). prepare.sh --distill cuts it into .gg1/.gg2/.gg3 (and packs the
# training data into .gpu/data); three calls in a row, each inside the 30 s a machine stays warm:
#   carry [".gpu", ".gg1"]: bash scripts/gpu/device.sh setup && bash scripts/gpu/device.sh stash 1
#   carry [".gg2"]:         bash scripts/gpu/device.sh stash 2
#   carry [".gg3"]:         bash scripts/gpu/device.sh stash 3 && bash scripts/gpu/device.sh distill MINUTES
#
# Random-weight shapes need only a tokenizer, so no call carries the 98 MB GGUF. What comes back
# lies in $OUT (at most 8 files a call, 16 MB each). Every timing there is CUDA-synchronised.
set -uo pipefail
REPO=$(pwd)
W=/tmp/kvrag-gpu
SITE=/tmp/site
OUT=${OUT:-$W/out}
mkdir -p "$W/run" "$OUT"
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 KVRAG_HOME=$W/home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

py() { (cd "$W/run" && python3 "$@"); }  # never from the repo root: ./kvrag there lacks the package's mapped parts
kvrag() { py -m kvrag.cli.app "$@"; }

setup() {
  # A warm machine keeps the wheels, but this call's checkout may differ: reinstall kvrag every call.
  local tree; tree=$(cd "$REPO" && find kvrag cache_backends integrations pyproject.toml -type f -name '*' | sort | xargs cat | md5sum)
  [ "$(cat "$W/.ready" 2>/dev/null)" = "$tree" ] && return 0
  if [ ! -f "$SITE/.wheels-ready" ]; then
    [ -d .gpu/whl ] || { echo "no .gpu/whl: carry it"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl || return 1
    touch "$SITE/.wheels-ready"
  fi
  rm -rf "$SITE"/kvrag "$SITE"/kvrag-*.dist-info "$W/tokenizer"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" "$REPO" 2>&1 | grep -v "already exists" || true
  [ -f "$SITE/kvrag/training/loop.py" ] || { echo "kvrag did not install"; return 1; }
  cp -r .gpu/tokenizer "$W/tokenizer" || return 1
  echo "$tree" > "$W/.ready"
  py -c "import torch, transformers, kvrag; print('torch', torch.__version__, 'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
}

tests() {  # issues #20/#22: every CUDA test (they skip on the CPU)
  (cd "$W/run" && python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_cuda.py" "$REPO/tests/test_cuda_attention.py" \
    "$REPO/tests/test_every_device.py" "$REPO/tests/test_store_tiers.py::test_cuda_default_stack_serves_from_the_gpu" 2>&1) \
    | tee "$OUT/cuda-tests.log" | tail -30
}

gate() {  # issue #22: the gate in bf16 at 1B-8B shapes (random weights)
  for shape in llama-3.2-1b llama-3.1-8b qwen2.5-7b; do
    kvrag check-model "$W/tokenizer" --shape "$shape" --device cuda --dtype bfloat16 --json > "$W/gate-$shape.json"
    echo "$shape: exit $?"; cat "$W/gate-$shape.json" >> "$OUT/gate.json"; tail -c 600 "$W/gate-$shape.json"
  done
}

speed() {  # issues #20/#22: TTFT vs context, layer-wise loading on and off, decode rate; ARGS: 8b|1b STORE [light]
  # light: reuse and epic only, loading as the default picks, no decode (~1/3 of the time): a store
  # beside the host tier's full run, inside one call's 10 minutes
  local shape=$1 store=${2:-memory://} light=${3:-} name methods=reuse,epic,cacheblend,samkv extra="--layerwise both --decode-tokens 64"
  case $shape in 8b) shape=llama-3.1-8b ;; 1b) shape=llama-3.2-1b ;; esac
  name=$(echo "$shape-$store" | tr -c 'a-zA-Z0-9.\n-' '_' | sed 's/_*$//')
  [ "$store" = disk ] && store="disk://$W/kv-$shape?pin=1"
  [ "$store" = default ] && store=""
  [ "$light" = light ] && { methods=reuse,epic; extra=""; name="$name-light"; }
  kvrag bench speed --model "$W/tokenizer" ${store:+--store "$store"} --shape "$shape" --random-weights --device cuda --dtype bfloat16 --contexts 4k,8k,16k,32k \
    --chunk-tokens 512 --methods "$methods" --repeats 3 $extra \
    --out "$W/speed-$name" 2>&1 | tail -40
  cp "$W/speed-$name/speed.md" "$OUT/$name.md"; cp "$W/speed-$name/speed.json" "$OUT/$name.json"
}

store() {  # issue #22: each tier's read bandwidth beside plain reads and host-to-device copies (pinned, pageable)
  py -m kvrag.eval.store_bench "$W/store" --tiers-only --rounds 30 2>&1 | tee "$OUT/store-tiers.md" | tail -15
}

decode() {  # issue #39 item 4: the 8B bf16 decode rate at 8k (reuse's prefill, 256 tokens), then where a step's time goes
  kvrag bench speed --model "$W/tokenizer" --store memory:// --shape llama-3.1-8b --random-weights --device cuda --dtype bfloat16 \
    --contexts 8k --chunk-tokens 512 --methods reuse --repeats 1 --decode-tokens 256 --out "$W/decode-8b" 2>&1 | grep -v "it/s" | tail -8
  cp "$W/decode-8b/speed.md" "$OUT/decode-8b-8k.md"; cp "$W/decode-8b/speed.json" "$OUT/decode-8b-8k.json"
  py "$REPO/scripts/gpu/decode_profile.py" "$W/tokenizer" 2>&1 | grep -v "it/s\|Warn" | tee "$OUT/decode-8b-8k-profile.txt" | head -4
}

serve() {  # issue #35: `kvrag serve` on the 8B shape (random weights, bf16) at 1-16 clients (prepare.sh --serve; ~4 min)
  py "$REPO/scripts/server_bench.py" --out "$W/serve-8b" --shape llama-3.1-8b --model "$W/tokenizer" --device cuda \
    --dtype bfloat16 --n 16 --cli-n 0 --no-decode --no-index --stop-at none --max-new-tokens 64 --method reuse \
    --concurrency 1,2,4,8,16 2>&1 | grep -v "it/s" | tail -20
  cp "$W/serve-8b"/server_bench.* "$OUT/" 2>/dev/null
}

stash() {  # a part of the bundled GGUF, kept on the warm machine until the last part comes
  mkdir -p "$W/gguf" && cp ".gg$1"/p"$1" "$W/gguf/" && ls -l "$W/gguf"
  [ -d .gpu/data ] && { mkdir -p "$W/data" && tar xzf .gpu/data/data.tgz -C "$W/data" && cp .gpu/data/gguf.sha256 "$W/data/"; }
  return 0
}

distill() {  # issue #34: the self-distilled reuse adapter, its schedule fitted to MINUTES; what comes back: $OUT
  local minutes=${1:?minutes} g="$W/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" d="$W/data"
  cat "$W/gguf"/p1 "$W/gguf"/p2 "$W/gguf"/p3 > "$g" || return 1
  [ "$(sha256sum "$g" | cut -d' ' -f1)" = "$(cat "$d/gguf.sha256")" ] || { echo "GGUF parts do not match"; return 1; }
  py -m kvrag.train --objective distill --mode lora --link-tokens 5 --model "$g" \
    --data "$d/nq10_dev.jsonl@0:1200" --data "$d/musique_dev.jsonl@0:100" --data "$d/kv75_dev.jsonl@0:200" \
    --data "$d/facts-train.jsonl@0:300" --data "$d/facts-long-train.jsonl@0:200" --teacher-tokens 32 --continue-share 0.5 --min-chunks 1 --lr 5e-5 \
    --batch-size 1 --grad-accum 8 --epochs 1 --seed 0 --save-every 10 --device cuda --dtype float32 \
    --max-minutes "$minutes" --fit-schedule --out "$W/distill5" 2>&1 | tee "$OUT/distill-train.log" | tail -15
  cp "$W/distill5/adapter.safetensors" "$W/distill5/train_summary.json" "$W/distill5/loss.png" "$OUT/" 2>/dev/null
  ls -l "$OUT"
}

step=${1:?usage: device.sh setup|tests|gate|store|speed 8b|1b STORE [light]|stash N|distill MINUTES|decode|serve}
shift
case $step in
  setup) setup ;;
  tests | gate | store) setup && "$step" "$@" ;;
  speed) setup && speed "$@" ;;
  decode) setup && decode ;;
  serve) setup && serve ;;
  stash) stash "$@" ;;
  distill) setup && distill "$@" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
