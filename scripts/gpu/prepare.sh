#!/usr/bin/env bash
# Run HERE (the CPU machine), once, before a session's GPU work: fills .gpu/ (kept out of git through
# .git/info/exclude) with what the lent GPU machine lacks, so each `run` call carries [".gpu"]:
#   .gpu/whl/        wheels of this machine's transformers, huggingface_hub, tokenizers, httpx2,
#                    httpcore2 and truststore, for the device's Python 3.12 (its own are older or absent)
#   .gpu/tokenizer/  the bundled model's tokenizer alone (~3 MB): the random-weight shapes need only
#                    a tokenizer, so no call has to carry the 98 MB GGUF
# Together ~20 MB, so one call carries them with the checkout (see scripts/gpu/device.sh).
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
ls .gpu/whl
du -sh .gpu
