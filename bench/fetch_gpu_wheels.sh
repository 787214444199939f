#!/usr/bin/env bash
# Wheels the lent GPU machine lacks, for `python -m bench gpu` there (see bench/README.md):
# bitsandbytes (its manylinux wheel holds the CUDA 13 library that matches the image's torch), the
# pinned transformers/peft (the image's are older), trl, datasets and its dill/multiprocess, and
# hydra-core/omegaconf/antlr4 (antlr4 4.9.3 is an sdist: built here into a pure-Python wheel).
# Versions are the ones requirements.txt pins. Output: .whl/ (git-ignored), ~58 MiB of the 64 MiB
# a device call may carry. LIGER=1 adds liger-kernel (for trainer.liger=true).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
rm -rf .whl && mkdir -p .whl
pin() { grep -E "^$1==" requirements.txt | head -1; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
wheels=("$(pin bitsandbytes)" "$(pin transformers)" "$(pin peft)" "$(pin trl)" "$(pin datasets)"
        "$(pin hydra-core)" "$(pin omegaconf)" "dill==0.4.1" "multiprocess==0.70.19")
if [[ "${LIGER:-0}" == 1 ]]; then wheels+=("liger-kernel"); fi
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl && du -sh .whl
