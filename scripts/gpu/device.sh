#!/usr/bin/env bash
# Run ON the lent GPU machine (the `device` tool's `run`, from the repo root): bash scripts/gpu/device.sh STEP [ARGS]
#
# A machine is lent by chance, for 15 minutes of device time in all (its start, ~1-2 min, included),
# starts bare and goes back 30 s after a call. So the work is cut into calls that each set
# themselves up, write every result under $OUT as it is produced (a call cut off by its limit still
# returns what it finished), and fit the 15 minutes. scripts/gpu/prepare.sh (run HERE first) fills
# .gpu/ (wheels, the bundled tokenizer, the commit) and, with --distill, the parcels .gp1 .. .gpN.
#
# The chain of one lending (device time; what comes back in $OUT, at most 8 files a call):
#
#   1. carry [".gpu"], timeout_s 400:  bash scripts/gpu/device.sh first               (~6.5 min with the start)
#      The GPU prefill: the command ends by FIRST_BUDGET_S (default 330 s); each step gets its cap or what is left:
#        setup    ~40 s   wheels + this checkout's kvrag                       -> chain.log (machine, versions, commit)
#        tests    80 s    every CUDA test (-k "not cpu": their CPU twins run in CI) -> cuda-tests.log
#        prefill  50 s    one reuse prefill profiled at 4k and 32k, KV in pinned host memory
#                                                                              -> prefill-profile.txt (as it runs)
#        store    30 s    each tier's read bandwidth, the disk tier ÷ a plain read -> store-tiers.md
#        tiers    140 s   `kvrag bench speed` 4k,16k,32k: Full, reuse and epic from every tier of the CUDA
#                         default stack (hot GPU, warm pinned host, cold disk, cold from the device)
#                                                                              -> speed-tiers.md, speed-tiers.json
#   2. right after it (the machine stays warm 30 s), carry [".gpu"], timeout_s 330:
#                                        bash scripts/gpu/device.sh second             (~5 min)
#      Many users on one GPU: ends by SECOND_BUDGET_S (default 290 s):
#        decode   90 s    8B bf16 decode at 4k, 8k, 16k, 32k (reuse prefill, 128 tokens) -> decode-8b.md, decode-8b.json
#        serve    150 s   `kvrag serve`, 8B shape, 1-16 clients                 -> serve.log (as it runs),
#                                                                                  server_bench.md, server_bench.json
#                                                                                  (after each client count)
#        profile  45 s    one decode step alone and one batched at 8 rows, profiled -> decode-profile.txt
#      chain.log gets a line per step (rc, seconds) as each ends; rc 124 = cut at its cap.
#
#   3. the distillation, one resumable piece a lending (~5-6 min with the parcels), when a lending has time left
#      (each call within the 30 s a machine stays warm; prepare.sh --distill prints this list):
#        carry [".gpu", ".gp1"], timeout_s 120:  bash scripts/gpu/device.sh setup && bash scripts/gpu/device.sh stash 1
#        carry [".gp2"] ... [".gpN-1"], 60 each: bash scripts/gpu/device.sh stash K
#        carry [".gpN"], timeout_s 330:          bash scripts/gpu/device.sh stash N && bash scripts/gpu/device.sh distill 4
#      The parcels hold the bundled GGUF (98 MB: more than one call carries beside the checkout), the
#      training mix and the run's state from the last piece. `distill MINUTES [TOPK]` resumes the run
#      (optimizer, schedule, data position) and stops itself after MINUTES (model load included) ->
#        state.tar.00, state.tar.01 (its checkpoint, cut to 15 MiB files), adapter.safetensors,
#        train_summary.json, distill-train.log (as it runs), loss.png
#      Copy the state.tar.* files back to runs/distill-epoch/ HERE and run prepare.sh --distill
#      again before the next lending's piece. A full epoch (250 steps) takes several pieces.
#      TOPK > 0 keeps top-k teacher targets in the run (--teacher-cache; they travel in the state);
#      the default 0 is the shipped recipe's full-vocabulary targets, generated a step at a time on
#      the GPU: each piece generates the targets of exactly the steps it trains.
#
# Older single steps (each carries [".gpu"]): tests | decode | serve | profile | gate | store |
#   speed 8b|1b STORE [light]   (STORE: memory:// | host://?pin=1 | disk | default)
#
# KVRAG_GPU_DRY=1: the same steps on this CPU with tiny settings (the bundled model, no wheels),
# so tests/test_gpu_chain.py checks every file each call writes. Every timing is CUDA-synchronised.
set -uo pipefail
CARRY=$(pwd)                                     # where the carried folders (.gpu, .gpN) are
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY=${KVRAG_GPU_DRY:-0}
W=${KVRAG_GPU_WORK:-/tmp/kvrag-gpu}
SITE=$W/site
OUT=${OUT:-$W/out}
mkdir -p "$W/run" "$OUT"
export PYTHONUNBUFFERED=1 KVRAG_HOME=$W/home HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "$DRY" = 1 ]; then
  DEV=cpu DT=float32 PY=${PYTHON:-python3}
else
  DEV=cuda DT=bfloat16 PY=python3
  export PYTHONPATH=$SITE
fi

py() { (cd "$W/run" && "$PY" "$@"); }  # never from the repo root: ./kvrag there lacks the package's mapped parts
kvrag() { py -m kvrag.cli.app "$@"; }
note() { echo "$*" | tee -a "$OUT/chain.log"; }

setup() {
  [ "$DRY" = 1 ] && return 0
  # A warm machine keeps the wheels, but this call's checkout may differ: reinstall kvrag when it does.
  local tree; tree=$(cd "$REPO" && find kvrag cache_backends integrations pyproject.toml -type f | sort | xargs cat | md5sum)
  if [ "$(cat "$W/.ready" 2>/dev/null)" != "$tree" ]; then
    if [ ! -f "$SITE/.wheels-ready" ]; then
      [ -d "$CARRY/.gpu/whl" ] || { echo "no .gpu/whl: carry .gpu"; return 1; }
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$CARRY"/.gpu/whl/*.whl || return 1
      touch "$SITE/.wheels-ready"
    fi
    rm -rf "$SITE"/kvrag "$SITE"/kvrag-*.dist-info "$W/tokenizer"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target "$SITE" "$REPO" 2>&1 | grep -v "already exists"
    [ -f "$SITE/kvrag/training/loop.py" ] || { echo "kvrag did not install"; return 1; }
    cp -r "$CARRY/.gpu/tokenizer" "$W/tokenizer" || return 1
    echo "$tree" > "$W/.ready"
  fi
}

provenance() {  # what the tables must say they ran on: machine, versions, commit
  [ -f "$W/.provenance" ] && { cat "$W/.provenance" >> "$OUT/chain.log"; return 0; }
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(cat "$CARRY/.gpu/commit" 2>/dev/null || git -C "$REPO" describe --always --dirty 2>/dev/null || echo unknown)"
    echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
    py -c "import sys, torch, transformers, kvrag; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  } > "$W/.provenance" 2>&1
  cat "$W/.provenance" >> "$OUT/chain.log"
}

tokenizer() { [ "$DRY" = 1 ] && echo "" || echo "$W/tokenizer"; }

tests() {  # issues #20/#22/#39: every CUDA test (they skip on the CPU: the dry run only collects them)
  local files=("$REPO/tests/test_cuda.py" "$REPO/tests/test_cuda_attention.py" "$REPO/tests/test_every_device.py"
    "$REPO/tests/test_store_tiers.py::test_cuda_default_stack_serves_from_the_gpu")
  local extra=(-rs -k "not cpu"); [ "$DRY" = 1 ] && extra=(--collect-only -k "not cpu")
  (cd "$W/run" && "$PY" -m pytest -q -p no:cacheprovider "${extra[@]}" "${files[@]}" 2>&1) > "$OUT/cuda-tests.log"
  local rc=$?; tail -5 "$OUT/cuda-tests.log"; return $rc
}

decode() {  # the 8B bf16 decode rate at 4k-32k (reuse's prefill, 128 tokens), beside its weights-read bound
  local model=(--model "$(tokenizer)" --shape llama-3.1-8b --random-weights --contexts 4k,8k,16k,32k --chunk-tokens 512 --decode-tokens 128)
  [ "$DRY" = 1 ] && model=(--contexts 256 --chunk-tokens 64 --decode-tokens 4)
  kvrag bench speed "${model[@]}" --store memory:// --device "$DEV" --dtype "$DT" --methods reuse --repeats 1 \
    --out "$W/decode-8b" 2>&1 | grep -v "it/s" | tail -8
  cp "$W/decode-8b/speed.md" "$OUT/decode-8b.md" && cp "$W/decode-8b/speed.json" "$OUT/decode-8b.json"
}

prefill() {  # the GPU prefill: one reuse prefill profiled at 4k and 32k (ops, host syncs, copies, CPU and CUDA time by op)
  local args=("$(tokenizer)" --contexts 4k,32k --store "host://?pin=1")
  [ "$DRY" = 1 ] && args=(--shape none --contexts 256 --chunk-tokens 64 --store memory:// --repeats 1)
  py "$REPO/scripts/gpu/prefill_profile.py" "${args[@]}" --device "$DEV" --dtype "$DT" 2>&1 | grep -v "it/s\|Warn\|USDT" \
    > "$OUT/prefill-profile.txt"
  local rc=$?; grep "^==\|^kernel" "$OUT/prefill-profile.txt"; return $rc
}

tiers() {  # reuse from every tier of the CUDA default stack (hot, warm, cold, cold from the device), beside Full
  local model=(--model "$(tokenizer)" --shape llama-3.1-8b --random-weights --contexts 4k,16k,32k --chunk-tokens 512 --repeats 3)
  [ "$DRY" = 1 ] && model=(--contexts 256 --chunk-tokens 64 --repeats 1)
  kvrag bench speed "${model[@]}" --tiers hot,warm,cold,device --device "$DEV" --dtype "$DT" --methods reuse,epic \
    --out "$W/speed-tiers" 2>&1 | grep -v "it/s" | tail -12
  cp "$W/speed-tiers/speed.md" "$OUT/speed-tiers.md" && cp "$W/speed-tiers/speed.json" "$OUT/speed-tiers.json"
}

profile() {  # where a decode step's time goes: one step alone and one batched at 8 rows
  local args=("$(tokenizer)" --tokens 64 --profile-tokens 16 --rows 8)
  [ "$DRY" = 1 ] && args=(--shape none --chunks 2 --chunk-tokens 64 --tokens 4 --profile-tokens 2 --rows 2 --sizes 1,2)
  py "$REPO/scripts/gpu/decode_profile.py" "${args[@]}" --device "$DEV" --dtype "$DT" 2>&1 | grep -v "it/s\|Warn" \
    > "$OUT/decode-profile.txt"
  local rc=$?; head -3 "$OUT/decode-profile.txt"; return $rc
}

serve() {  # issue #35: `kvrag serve` on the 8B shape (random weights, bf16) at 1-16 clients (prepare.sh adds the web stack)
  local model=(--shape llama-3.1-8b --model "$(tokenizer)" --n 16 --max-new-tokens 64 --concurrency "1,2,4,8,16")  # 16 requests a count
  [ "$DRY" = 1 ] && model=(--n 2 --max-new-tokens 2 --concurrency "1,2")
  # server_bench.py rewrites its tables in $OUT after each client count (a step cut at its cap keeps the
  # counts it finished, marked partial); its log comes back as it runs
  py "$REPO/scripts/server_bench.py" --out "$W/serve-8b" --tables "$OUT" "${model[@]}" --device "$DEV" --dtype "$DT" --cli-n 0 \
    --no-decode --no-index --stop-at none --method reuse 2>&1 | grep -v "it/s" > "$OUT/serve.log"
  local rc=$?; tail -12 "$OUT/serve.log"
  [ -f "$OUT/server_bench.md" ] && [ -f "$OUT/server_bench.json" ] || rc=1
  return $rc
}

timed() {  # timed NAME CAP_S: run step NAME for at most CAP_S seconds (and never past the call's deadline)
  local name=$1 cap=$2 left t0 rc
  [ "$DRY" = 1 ] && cap=$((cap * 4))  # the dry run's CPU is slower than the GPU it stands in for
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then note "$name: skipped (the call's budget is spent)"; return 0; fi
  t0=$(date +%s)
  timeout --kill-after=5 "$cap" bash "$REPO/scripts/gpu/device.sh" "$name"
  rc=$?
  note "$name: rc $rc, $(( $(date +%s) - t0 )) s (cap $cap s)"
}

begin() {  # begin BUDGET_S: a call's deadline, its chain.log, the set-up (kept on a warm machine)
  DEADLINE=$(( $(date +%s) + $1 ))
  : > "$OUT/chain.log"
  local t0; t0=$(date +%s)
  { setup && provenance; } || { note "setup failed"; return 1; }
  note "setup: $(( $(date +%s) - t0 )) s"
}

first() {  # call 1 of a lending: the GPU prefill (see the top)
  begin "${FIRST_BUDGET_S:-330}" || return 1
  timed tests 80
  timed prefill 50
  timed store 30
  timed tiers 140
  ls -l "$OUT"
}

second() {  # call 2 of a lending: many users on one GPU (see the top)
  begin "${SECOND_BUDGET_S:-290}" || return 1
  timed decode 90
  timed serve 150
  timed profile 45
  ls -l "$OUT"
}

# -- the distillation in pieces ---------------------------------------------------------------------
stash() {  # parcel N, kept on the warm machine until the last one comes
  local n=${1:?parcel number}
  [ -f "$CARRY/.gp$n/part" ] || { echo "no .gp$n/part: carry .gp$n"; return 1; }
  mkdir -p "$W/parcel" && cp "$CARRY/.gp$n/part" "$W/parcel/$(printf %03d "$n")"
  [ -f "$CARRY/.gp$n/manifest" ] && cp "$CARRY/.gp$n/manifest" "$W/parcel/manifest"
  ls "$W/parcel"
}

unpack() {  # the parcels, checked whole, into $W/in (gguf, data/, state.tar)
  local m="$W/parcel/manifest" parts
  [ -f "$m" ] || { echo "no manifest: stash parcel 1 first"; return 1; }
  parts=$(sed -n 's/^parts: //p' "$m")
  [ "$(find "$W/parcel" -name '[0-9][0-9][0-9]' | wc -l)" = "$parts" ] || { echo "have $(ls "$W/parcel"), need $parts parts"; return 1; }
  [ "$(cat "$W/parcel"/[0-9][0-9][0-9] | sha256sum | cut -d' ' -f1)" = "$(sed -n 's/^sha256: //p' "$m")" ] || { echo "parcels do not match their manifest"; return 1; }
  rm -rf "$W/in" && mkdir -p "$W/in" && cat "$W/parcel"/[0-9][0-9][0-9] | tar x -C "$W/in" || return 1
  [ -d "$W/in/model" ] || [ "$(sha256sum "$W/in/model.gguf" | cut -d' ' -f1)" = "$(cat "$W/in/model.gguf.sha256")" ] \
    || { echo "GGUF damaged"; return 1; }
}

distill() {  # one piece of the self-distilled reuse adapter (issues #34/#55): resume, train MINUTES, pack the state
  local minutes=${1:?minutes} topk=${2:-0} run="$W/distill" data=() args=() keep=(checkpoint)
  [ -f "$W/in/model.gguf" ] || [ -d "$W/in/model" ] || unpack || return 1
  local base=model.gguf; [ -d "$W/in/model" ] && base=./model
  rm -rf "$run" && mkdir -p "$run"
  [ -f "$W/in/state.tar" ] && tar xf "$W/in/state.tar" -C "$run"
  # paths relative to $W/in, where it runs: the resume key holds them, so they must not depend on the machine's folders
  while read -r spec; do data+=(--data "data/$spec"); done < "$W/in/data/mix.txt"
  args=(--teacher-tokens 32 --continue-share 0.5 --min-chunks 1 --lr 5e-5 --batch-size 1 --grad-accum 8 --epochs 1)
  [ "$DRY" = 1 ] && args=(--teacher-tokens 2 --continue-share 0.5 --max-chunks 2 --max-tokens 192 --batch-size 1 --grad-accum 1
    --max-steps 4 --stop-at-step "$(( $(sed -n 's/.*"step": \([0-9]*\).*/\1/p' "$run/checkpoint/state.json" 2>/dev/null || echo 0) + 1 ))")
  [ "$topk" -gt 0 ] && { args+=(--teacher-topk "$topk" --teacher-cache); keep+=(teacher); }
  (cd "$W/in" && "$PY" -m kvrag.train --objective distill --mode lora --link-tokens 5 --model "$base" "${data[@]}" "${args[@]}" \
    --seed 0 --save-every 10 --device "$DEV" --dtype float32 --max-minutes "$minutes" --resume --no-progress \
    --out "$run") > "$OUT/distill-train.log" 2>&1
  local rc=$?; tail -4 "$OUT/distill-train.log"
  [ -f "$run/checkpoint/state.json" ] || { echo "no checkpoint"; return 1; }
  local have=(); for k in "${keep[@]}"; do [ -e "$run/$k" ] && have+=("$k"); done
  tar cf "$W/state.tar" -C "$run" "${have[@]}" && split -b 15M -d -a 2 "$W/state.tar" "$OUT/state.tar."
  cp "$run/adapter.safetensors" "$run/train_summary.json" "$OUT/" 2>/dev/null
  cp "$run/loss.png" "$OUT/" 2>/dev/null
  echo "state: $(sha256sum "$W/state.tar" | cut -d' ' -f1), step $(sed -n 's/.*"step": \([0-9]*\).*/\1/p' "$run/checkpoint/state.json")" \
    | tee -a "$OUT/distill-train.log"
  ls -l "$OUT"
  return $rc
}

# -- older single steps -----------------------------------------------------------------------------
gate() {  # issue #22: the gate in bf16 at 1B-8B shapes (random weights)
  for shape in llama-3.2-1b llama-3.1-8b qwen2.5-7b; do
    kvrag check-model "$W/tokenizer" --shape "$shape" --device cuda --dtype bfloat16 --json > "$W/gate-$shape.json"
    echo "$shape: exit $?"; cat "$W/gate-$shape.json" >> "$OUT/gate.json"; tail -c 600 "$W/gate-$shape.json"
  done
}

speed() {  # issues #20/#22: TTFT vs context, layer-wise loading on and off, decode rate; ARGS: 8b|1b STORE [light]
  local shape=$1 store=${2:-memory://} light=${3:-} name methods=reuse,epic,cacheblend,samkv extra=(--layerwise both --decode-tokens 64)
  case $shape in 8b) shape=llama-3.1-8b ;; 1b) shape=llama-3.2-1b ;; esac
  name=$(echo "$shape-$store" | tr -c 'a-zA-Z0-9.\n-' '_' | sed 's/_*$//')
  [ "$store" = disk ] && store="disk://$W/kv-$shape?pin=1"
  [ "$store" = default ] && store=""
  [ "$light" = light ] && { methods=reuse,epic; extra=(); name="$name-light"; }
  kvrag bench speed --model "$W/tokenizer" ${store:+--store "$store"} --shape "$shape" --random-weights --device cuda --dtype bfloat16 \
    --contexts 4k,8k,16k,32k --chunk-tokens 512 --methods "$methods" --repeats 3 "${extra[@]}" --out "$W/speed-$name" 2>&1 | tail -40
  cp "$W/speed-$name/speed.md" "$OUT/$name.md"; cp "$W/speed-$name/speed.json" "$OUT/$name.json"
}

store() {  # each tier's read bandwidth beside plain reads and host-to-device copies (pinned, pageable)
  local rounds=20; [ "$DRY" = 1 ] && rounds=2
  py -m kvrag.eval.store_bench "$W/store" --tiers-only --rounds "$rounds" 2>&1 | tee "$OUT/store-tiers.md" | tail -15
}

step=${1:?usage: device.sh first|second|setup|tests|prefill|store|tiers|decode|serve|profile|stash N|distill MINUTES [TOPK]|gate|speed 8b|1b STORE [light]}
shift
case $step in
  first) first ;;
  second) second ;;
  setup) : > "$OUT/chain.log"; setup && provenance ;;
  tests | prefill | tiers | decode | serve | profile | gate | store) setup > /dev/null && "$step" ;;
  speed) setup > /dev/null && speed "$@" ;;
  stash) stash "$@" ;;
  distill) setup > /dev/null && distill "$@" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
