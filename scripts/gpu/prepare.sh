#!/usr/bin/env bash
# Run HERE (the CPU machine), once, before a session's GPU work: fills .gpu/ (kept out of git through
# .git/info/exclude) with what the lent GPU machine lacks, so each `run` call carries [".gpu"]:
#   .gpu/whl/        wheels of this machine's transformers, huggingface_hub, tokenizers, httpx2,
#                    httpcore2 and truststore, for the device's Python 3.12 (its own are older or absent)
#   .gpu/tokenizer/  the bundled model's tokenizer alone (~3 MB): the random-weight shapes need only
#                    a tokenizer, so no call has to carry the 98 MB GGUF
# Together ~20 MB, so one call carries them with the checkout (see scripts/gpu/device.sh).
#
# `prepare.sh --distill` (issue #34's adapter, which needs the real bundled model) adds peft and gguf
# wheels, .gpu/data/ (the training mix, packed, and the GGUF's sha256) and cuts the 98 MB GGUF into
# .gg1 (18 MB, beside .gpu), .gg2 and .gg3, so each of three calls stays under 64 MiB.
# `prepare.sh --serve` (issue #35's server table on the 8B shape) adds the web stack's wheels (~3 MB).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/whl
pins=$(python3 - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("transformers", "huggingface_hub", "tokenizers", "httpx2", "httpcore2", "truststore")))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl $pins
python3 -c 'import sys; from kvrag.model.loading import load_tokenizer; load_tokenizer(None).save_pretrained(sys.argv[1])' .gpu/tokenizer
if [[ " $* " == *" --distill "* ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl \
    "gguf==$(python3 -c 'from importlib.metadata import version; print(version("gguf"))')" \
    "peft==$(python3 -c 'from importlib.metadata import version; print(version("peft"))')"
  [ -f runs/facts-train.jsonl ] || python3 -m kvrag.eval.synthetic --n 300 --seed 0 --style short --docs 3 --phrasings train --out runs/facts-train.jsonl
  [ -f runs/facts-long-train.jsonl ] || python3 -m kvrag.eval.synthetic --n 200 --seed 2 --style long --docs 6 --phrasings train --out runs/facts-long-train.jsonl
  mkdir -p .gpu/data
  tar czf .gpu/data/data.tgz -C ../shared/data nq10_dev.jsonl musique_dev.jsonl kv75_dev.jsonl -C "$PWD/runs" facts-train.jsonl facts-long-train.jsonl
  gguf=$(python3 -c 'from kvrag.model.loading import bundled_gguf_path; print(bundled_gguf_path())')
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu/data/gguf.sha256
  for d in /.gg1/ /.gg2/ /.gg3/; do grep -qxF "$d" "$exclude" || echo "$d" >> "$exclude"; done
  rm -rf .gg1 .gg2 .gg3 && mkdir -p .gg1 .gg2 .gg3
  head -c 18000000 "$gguf" > .gg1/p1
  tail -c +18000001 "$gguf" | head -c 45500000 > .gg2/p2
  tail -c +63500001 "$gguf" > .gg3/p3
  du -sh .gg1 .gg2 .gg3
fi
if [[ " $* " == *" --serve "* ]]; then  # issue #35's server table: `kvrag serve`'s web stack, which the device's image lacks
  spins=$(python3 - <<'PY'
from importlib.metadata import version
names = ("fastapi", "starlette", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "uvicorn",
         "typing_extensions", "anyio", "opentelemetry-api", "annotated-doc")
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl $spins
fi
ls .gpu/whl
du -sh .gpu
