#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that has no network (its image holds
# torch 2.11, transformers 5.17, numpy, safetensors, tokenizers, accelerate, pytest and hypothesis
# for Python 3.12): surgery's own dependencies it lacks into .whl/, llm-compressor 0.14 and what it
# needs beyond the image into .whl-peer/ (installed apart: it pins compressed-tensors 0.19). Run
# here, where pip reaches the package registry; both folders are git-ignored and travel with the
# device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/.."
get() {
  folder="$1"; shift
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$folder" "$@"
}
get .whl gguf==0.19.0 compressed-tensors==0.20.0 torchao==0.18.0 loguru==0.7.3 \
  hydra-core==1.3.8 omegaconf==2.3.1  # the command line's (the device tests' runs)
# hydra's parser runtime is published as a source distribution only (pure Python: built there, offline)
python3 -m pip download --quiet --no-deps --no-binary=:all: -d .whl antlr4-python3-runtime==4.9.3
get .whl-peer llmcompressor==0.14.0.1 compressed-tensors==0.19.0 loguru==0.7.3 datasets auto-round==0.15.1 \
  dill multiprocess pydantic pydantic-core annotated-types typing-inspection
du -sh .whl .whl-peer
