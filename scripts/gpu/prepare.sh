#!/usr/bin/env bash
# Run HERE (the CPU machine), before a lending's GPU calls: fills what the calls carry (kept out of
# git through .git/info/exclude); scripts/gpu/device.sh's header lists the calls.
#   .gpu/whl/        wheels the device's Python 3.12 lacks or has older: this machine's transformers,
#                    huggingface_hub, tokenizers, httpx2, httpcore2, truststore, and `kvrag serve`'s web
#                    stack (~24 MB together)
#   .gpu/tokenizer/  the bundled model's tokenizer alone (~3 MB): the random-weight 8B shapes need only it
#   .gpu/commit      the commit (and whether the tree was dirty) the tables then say they ran on
#
# `prepare.sh --distill` (a piece of the distillation, issues #34/#55) adds the peft and gguf wheels
# and the parcels .gp1 .. .gpN: one tar of the bundled GGUF (98 MB), the training mix and the run's
# state from its last piece (runs/distill-epoch/state.tar.*, the files `device.sh distill` returned),
# cut so each call stays under 64 MiB beside the checkout (.gp1 rides with .gpu). It prints the calls.
#   DISTILL_DATA="PATH@A:B ..."  another mix (default: nq10, MuSiQue, kv75 and the two fact sets)
#   DISTILL_STATE=DIR            where the returned state.tar.* files are (default runs/distill-epoch)
#   DISTILL_MODEL=PATH           another base model, a .gguf or a HF folder (default: the bundled GGUF)
#
# KVRAG_GPU_DRY=1 (tests/test_gpu_chain.py): no wheels (nothing downloaded); KVRAG_GPU_STAGE=DIR puts
# .gpu and the parcels there instead of the repo root.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ROOT=$PWD
STAGE=${KVRAG_GPU_STAGE:-$ROOT}
DRY=${KVRAG_GPU_DRY:-0}
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))   # what one call carries: the checkout, shared/ and the carried folders
MARGIN=$((1024 * 1024))
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in /.gpu/ '/.gp[0-9]*/'; do grep -qxF "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
mkdir -p "$STAGE" && rm -rf "$STAGE/.gpu" "$STAGE"/.gp[0-9]* && mkdir -p "$STAGE/.gpu/whl"

wheels() {  # wheels of this machine's versions of NAMES for the device's CPython 3.12
  [ "$DRY" = 1 ] && return 0
  local pins; pins=$("$PY" -c 'import sys; from importlib.metadata import version; print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "$@")
  # shellcheck disable=SC2086  # one argument per pin
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$STAGE/.gpu/whl" $pins
}

wheels transformers huggingface_hub tokenizers httpx2 httpcore2 truststore
wheels fastapi starlette pydantic pydantic_core annotated_types typing_inspection uvicorn typing_extensions anyio \
  opentelemetry-api annotated-doc
[ "$DRY" = 1 ] || "$PY" -c 'import sys; from kvrag.model.loading import load_tokenizer; load_tokenizer(None).save_pretrained(sys.argv[1])' \
  "$STAGE/.gpu/tokenizer" > /dev/null  # the dry run serves the bundled model: no tokenizer travels
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvrag scripts || echo '+dirty')" > "$STAGE/.gpu/commit"

if [[ " $* " == *" --distill "* ]]; then
  wheels gguf peft
  parcel=$(mktemp -d) && trap 'rm -rf "$parcel"' EXIT
  mkdir -p "$parcel/data"
  if [ -n "${DISTILL_DATA:-}" ]; then
    read -r -a mix <<< "$DISTILL_DATA"
  else
    mkdir -p runs
    [ -f runs/facts-train.jsonl ] || "$PY" -m kvrag.eval.synthetic --n 300 --seed 0 --style short --docs 3 --phrasings train --out runs/facts-train.jsonl
    [ -f runs/facts-long-train.jsonl ] || "$PY" -m kvrag.eval.synthetic --n 200 --seed 2 --style long --docs 6 --phrasings train --out runs/facts-long-train.jsonl
    mix=(../shared/data/nq10_dev.jsonl@0:1200 ../shared/data/musique_dev.jsonl@0:100 ../shared/data/kv75_dev.jsonl@0:200
      runs/facts-train.jsonl@0:300 runs/facts-long-train.jsonl@0:200)
  fi
  for spec in "${mix[@]}"; do  # each file under its own name; the rows it trains on in mix.txt, in order
    cp "${spec%@*}" "$parcel/data/"
    echo "$(basename "${spec%@*}")$([[ $spec == *@* ]] && echo "@${spec##*@}")" >> "$parcel/data/mix.txt"
  done
  model=${DISTILL_MODEL:-$("$PY" -c 'from kvrag.model.loading import bundled_gguf_path; print(bundled_gguf_path())')}
  if [ -d "$model" ]; then cp -r "$model" "$parcel/model"  # a HF folder (the dry run's tiny model)
  else cp "$model" "$parcel/model.gguf" && sha256sum "$model" | cut -d' ' -f1 > "$parcel/model.gguf.sha256"; fi
  state=${DISTILL_STATE:-runs/distill-epoch}
  if compgen -G "$state/state.tar.[0-9]*" > /dev/null; then cat "$state"/state.tar.[0-9]* > "$parcel/state.tar"; fi
  tar cf "$parcel.tar" -C "$parcel" . && trap 'rm -rf "$parcel" "$parcel.tar"' EXIT
  checkout=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
  room=$((LIMIT - checkout - MARGIN))
  first=$((room - $(du -sb "$STAGE/.gpu" | cut -f1)))
  [ -n "${KVRAG_GPU_PART_BYTES:-}" ] && room=$KVRAG_GPU_PART_BYTES first=$KVRAG_GPU_PART_BYTES  # the dry run: several parcels
  [ "$first" -gt 0 ] || { echo "the checkout and .gpu leave no room for a parcel"; exit 1; }
  mkdir -p "$STAGE/.gp1" && head -c "$first" "$parcel.tar" > "$STAGE/.gp1/part"
  n=1
  if [ "$(stat -c %s "$parcel.tar")" -gt "$first" ]; then
    tail -c +$((first + 1)) "$parcel.tar" | split -b "$room" -d -a 3 - "$parcel.rest."
    for f in "$parcel".rest.*; do n=$((n + 1)); mkdir -p "$STAGE/.gp$n" && mv "$f" "$STAGE/.gp$n/part"; done
  fi
  printf 'parts: %s\nsha256: %s\nstate: %s\n' "$n" "$(sha256sum "$parcel.tar" | cut -d' ' -f1)" \
    "$([ -f "$parcel/state.tar" ] && echo "resumed from $state" || echo "none: the run starts")" > "$STAGE/.gp1/manifest"
  du -sh "$STAGE"/.gp[0-9]*
  echo "the distill piece's calls, back to back (a machine stays warm 30 s):"
  echo "  carry [\".gpu\", \".gp1\"]: bash scripts/gpu/device.sh setup && bash scripts/gpu/device.sh stash 1"
  for ((k = 2; k <= n; k++)); do
    if [ "$k" -lt "$n" ]; then echo "  carry [\".gp$k\"]: bash scripts/gpu/device.sh stash $k"
    else echo "  carry [\".gp$k\"]: bash scripts/gpu/device.sh stash $k && bash scripts/gpu/device.sh distill 4"; fi
  done
  [ "$n" = 1 ] && echo "  (one parcel: add && bash scripts/gpu/device.sh distill 4 to the first call)"
fi
ls "$STAGE/.gpu/whl"
du -sh "$STAGE/.gpu"
