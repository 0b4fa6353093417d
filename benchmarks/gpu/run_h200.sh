#!/usr/bin/env bash
# The single-GPU check of agoq in one command (about 4 minutes on an H200):
#   bash benchmarks/gpu/run_h200.sh [OUT_DIR]             on a machine with an NVIDIA GPU
#   bash benchmarks/gpu/run_h200.sh --dry-run [OUT_DIR]   on CPU: tiny sizes, Triton under its interpreter
# 1. the Triton kernel tests on the GPU (tests/test_triton.py: codes and scales bit-identical to the
#    torch reference computed on CPU); 2. benchmarks/gpu/gpu_check.py: kernel GB/s against a
#    same-bytes copy, one llama3-8b decoder layer (bf16 vs agoq on the torch and Triton paths), and
#    a llama3.2-1b training run (bf16 vs agoq). Writes env.txt, tests.log, check.log, kernels.json,
#    kernels.png, layer.json and train.json into OUT_DIR (default benchmarks/results/gpu).
# Needs torch with CUDA and triton; agoq runs from this checkout (PYTHONPATH), nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY="--dry-run"; shift; fi
OUT="${1:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [[ -n "$DRY" ]]; then export TRITON_INTERPRET=1; fi
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  git rev-parse --short HEAD 2>/dev/null || true
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
XDIST=""
# Each kernel variant compiles once per process: spread the tests over processes on a GPU box.
if [[ -z "$DRY" ]] && "$PY" -c "import xdist" 2>/dev/null; then XDIST="-n 8"; fi
"$PY" -m pytest -q -p no:cacheprovider $XDIST tests/test_triton.py 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
# The measurements run even if a test failed: one lease should bring back everything.
"$PY" benchmarks/gpu/gpu_check.py $DRY --out-dir "$OUT" 2>&1 | tee "$OUT/check.log"
check=${PIPESTATUS[0]}
echo "tests exit $tests, check exit $check"
exit $(( tests != 0 || check != 0 ))
