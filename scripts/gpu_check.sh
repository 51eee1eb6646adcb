#!/usr/bin/env bash
# The GPU check, run once on a borrowed CUDA machine with no internet and no install of this package
# (torch with CUDA, transformers, onnx, onnxruntime, click, rich, pytest, scipy, numpy already there):
#   1. every CUDA test of the repository (their names contain "cuda": pytest -k cuda);
#   2. scripts/bench_gpu.py: engine figures on random-weight SmolLM2-135M-shaped models, eager, with CUDA
#      graphs, and compiled by torch.compile (with graphs), side by side.
# Results go flat into $OUT: env.txt, gpu_tests.log, bench_gpu.log, bench_gpu.json, summary.txt.
# Exits non-zero if the tests or the benchmark failed (each is recorded; one failing does not stop the other).
#   OUT=/tmp/gpu bash scripts/gpu_check.sh
# Wall time: about 3.5 minutes on an H200, compiling included; each step is capped
# (TESTS_TIMEOUT, BENCH_TIMEOUT seconds) so the whole check stays under 9 minutes.
set -euo pipefail
: "${OUT:?set OUT to a folder for the results, e.g. OUT=/tmp/gpu bash scripts/gpu_check.sh}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
repo=$PWD
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# runtime/ and build_engines/ import as specdec_trt.runtime and specdec_trt.build_engines, as an install maps
# them; without one (nothing to build with here), an overlay of the package with links to both does the same.
# Python runs from the overlay, so that the repository's own specdec_trt/ (without the two) is not found first.
# scripts/ comes after it for benchlib, the scripts' helpers, which some test modules import.
overlay=$(mktemp -d)
cp -r specdec_trt "$overlay/"
ln -s "$PWD/runtime" "$overlay/specdec_trt/runtime"
ln -s "$PWD/build_engines" "$overlay/specdec_trt/build_engines"
export PYTHONPATH=$overlay:$PWD/scripts
PY=${PYTHON:-python3}
start=$SECONDS

{
    echo "== GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), ${HOSTNAME:-unknown host}, git $(git rev-parse --short HEAD 2>/dev/null || echo none)"
    nvidia-smi -L || echo "nvidia-smi -L failed"
    "$PY" - <<'EOF'
import platform

import torch
import transformers

print(f"python {platform.python_version()} | torch {torch.__version__} | CUDA {torch.version.cuda} "
      f"| cuDNN {torch.backends.cudnn.version()} | transformers {transformers.__version__}")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch.cuda.is_available(): {torch.cuda.is_available()} | devices: {names}")
EOF
} 2>&1 | tee "$OUT/env.txt"
if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    echo "FAIL: this torch sees no CUDA device; nothing to check" | tee "$OUT/summary.txt"
    exit 1
fi

select=cuda  # every CUDA test has "cuda" in its name
echo "== pytest -k \"$select\" ($((SECONDS - start)) s)"
tests_rc=0
timeout -s INT -k 15 "${TESTS_TIMEOUT:-210}" \
    sh -c 'cd "$0" && exec "$@"' "$overlay" "$PY" -m pytest -q -rs -p no:cacheprovider -k "$select" "$repo/tests" 2>&1 | tee "$OUT/gpu_tests.log" || tests_rc=$?
if grep -q "needs a CUDA device" "$OUT/gpu_tests.log"; then
    echo "FAIL: CUDA tests were skipped as if there were no CUDA device" | tee -a "$OUT/gpu_tests.log"
    if [ "$tests_rc" -eq 0 ]; then tests_rc=1; fi
fi

echo "== scripts/bench_gpu.py ($((SECONDS - start)) s)"
bench_rc=0
timeout -s INT -k 15 "${BENCH_TIMEOUT:-300}" \
    sh -c 'cd "$0" && exec "$@"' "$overlay" "$PY" "$repo/scripts/bench_gpu.py" --out "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log" || bench_rc=$?

{
    echo "pytest exit status: $tests_rc$([ "$tests_rc" -eq 124 ] && echo ' (timed out)')"
    echo "bench exit status: $bench_rc$([ "$bench_rc" -eq 124 ] && echo ' (timed out)')"
    echo "wall time: $((SECONDS - start)) s"
} | tee "$OUT/summary.txt"
if [ "$tests_rc" -ne 0 ] || [ "$bench_rc" -ne 0 ]; then
    exit 1
fi
