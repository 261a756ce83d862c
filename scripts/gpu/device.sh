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
  [ -d "$SITE/kvrag/store_admin" ] || { echo "kvrag did not install"; return 1; }
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

step=${1:?usage: device.sh setup|tests|gate|store|speed 8b|1b STORE [light]}
shift
case $step in
  setup) setup ;;
  tests | gate | store) setup && "$step" "$@" ;;
  speed) setup && speed "$@" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
