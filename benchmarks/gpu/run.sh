#!/usr/bin/env bash
# The single-GPU check of agoq, sized for at most 10 minutes on one H100 or H200:
#   bash benchmarks/gpu/run.sh [OUT_DIR]             on a machine with an NVIDIA GPU
#   bash benchmarks/gpu/run.sh --dry-run [OUT_DIR]   on CPU: tiny sizes, Triton under its interpreter
# Each phase is a process of its own under its own timeout, so a CUDA fault or a hang in one loses
# that phase only, and each writes its results as it ends. Into OUT_DIR (default
# benchmarks/results/gpu), eight files at most: env.txt, check.log (every phase's output),
# tests.log, nccl.json, kernels.json, kernels.png, layer.json and train.json (benchmarks/gpu/README.md).
# Needs torch with CUDA and triton; agoq runs from this checkout (PYTHONPATH), nothing is installed.
# AGOQ_REVISION names the source revision where the checkout has no .git.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=""
if [[ "${1:-}" == "--dry-run" ]]; then DRY="--dry-run"; shift; fi
DEST="${1:-benchmarks/results/gpu}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
AGOQ_REVISION="${AGOQ_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
export AGOQ_REVISION
PY="${PYTHON:-python3}"
# The timeouts below are the GPU's budget. A dry run interprets every kernel and compiles on a CPU
# that may be busy: it gets five times as long, so that a slow CPU is not read as a hang.
SCALE=1
if [[ -n "$DRY" ]]; then
  export TRITON_INTERPRET=1
  SCALE=5
fi
: > "$DEST/check.log"
FAILED=()

# phase NAME SECONDS COMMAND...: run COMMAND under a timeout, its output appended to check.log.
phase() {
  local name=$1 seconds=$(($2 * SCALE))
  shift 2
  echo "== $name: at most ${seconds} s, from $(date -u +%H:%M:%S)" | tee -a "$DEST/check.log"
  timeout --kill-after=15 "$seconds" "$@" >> "$DEST/check.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc" | tee -a "$DEST/check.log"
  if [[ $rc -ne 0 ]]; then FAILED+=("$name (exit $rc)"); fi
}

{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  echo "revision $AGOQ_REVISION"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$DEST/env.txt" 2>&1
cat "$DEST/env.txt"

CHECK=("$PY" benchmarks/gpu/gpu_check.py $DRY --out-dir "$DEST")
phase nccl 60 "${CHECK[@]}" --phases nccl
# The kernels bit for bit against the CPU reference (aligned and unaligned sizes), then past 2^31 values.
phase tests 150 bash -c "'$PY' -m pytest -q -p no:cacheprovider tests/test_triton.py tests/test_triton_large.py > '$DEST/tests.log' 2>&1; rc=\$?; tail -3 '$DEST/tests.log'; exit \$rc"
phase kernels 60 "${CHECK[@]}" --phases kernels
phase layer 90 "${CHECK[@]}" --phases layer
phase train 210 "${CHECK[@]}" --phases train
if [[ ${#FAILED[@]} -gt 0 ]]; then
  echo "failed: ${FAILED[*]}"
  exit 1
fi
echo "every phase passed"
