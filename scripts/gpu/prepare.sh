#!/usr/bin/env bash
# Run HERE (the CPU machine), once, before a session's GPU work: fills .gpu/ (kept out of git through
# .git/info/exclude) with what the lent GPU machine lacks, so each `run` call carries [".gpu"]:
#   .gpu/whl/        wheels of this machine's transformers, huggingface_hub, tokenizers, httpx2,
#                    httpcore2, truststore and gguf, for the device's Python 3.12 (its own are older or absent)
#   .gpu/data/nq10_dev.jsonl the training and evaluation rows (../shared does not travel)
#   .gpu/model/part-0..3     the bundled model's GGUF (98 MB: more than one call may carry) in four
#                            pieces, with its sha256; `device.sh receive` joins them on the machine
# A call carries at most 64 MiB with the checkout (~9 MB), so the first three calls of a session
# bring these over (see scripts/gpu/device.sh for the chain).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/whl .gpu/model .gpu/data
pins=$(python3 - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in ("transformers", "huggingface_hub", "tokenizers", "httpx2", "httpcore2", "truststore", "gguf")))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .gpu/whl $pins
gguf=$(python3 -c 'from kvrag.model import bundled_gguf_path; print(bundled_gguf_path())')
( cd .gpu/model && sha256sum "$gguf" | sed "s|  .*/|  |" > SHA256SUMS && split -n 4 -d -a 1 "$gguf" part- )
cp "${KVRAG_SHARED:-../shared}/data/nq10_dev.jsonl" .gpu/data/
ls .gpu/whl
du -sh .gpu
