#!/usr/bin/env bash
# Device check of the compiled ops (csrc/) on a lent GPU machine (H200 here: Python 3.12,
# torch 2.11+cu130, nvcc 13, 16 cores; no megatron-core needed):
#   1. build megatron_railwave._C with its CUDA kernels in place (TORCH_CUDA_ARCH_LIST=9.0,
#      MAX_JOBS=16; a .so built on another machine does not load there),
#   2. the gpu-marked ops tests: every CUDA op against its CPU twin, bitwise, twice,
#   3. railwave ops-bench --device cuda (GLM-4.5-Air sizes) -> $OUT/ops_bench.json.
# Writes under $OUT (default out/gpu_check): ops_build.log, ops_tests.log, ops_bench.log,
# ops_bench.json. Exit status: 1 when the build fails or a test or the bench fails.
# Usage: OUT=/some/dir bash scripts/gpu_check_ops.sh   (PYTHON=... to pick the interpreter;
# BUILD_TIMEOUT_S, default 480: the build takes about 7 minutes on 2 busy cores, less on 16)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

echo "== build megatron_railwave._C (CUDA, sm_90)"
start=$SECONDS
if ! TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
        timeout "${BUILD_TIMEOUT_S:-480}" "$PY" setup.py -q build_ext --inplace >"$OUT/ops_build.log" 2>&1; then
    echo "build failed; last lines of $OUT/ops_build.log:"
    tail -40 "$OUT/ops_build.log"
    exit 1
fi
echo "built in $((SECONDS - start)) s"
if ! "$PY" -c "import sys, torch, megatron_railwave._C as c; sys.exit(0 if c.with_cuda else 'megatron_railwave._C has no CUDA kernels (torch without CUDA, or nvcc not found)')"; then
    tail -20 "$OUT/ops_build.log"
    exit 1
fi

echo "== gpu tests (CUDA ops vs CPU twins, bitwise, twice)"
RAILWAVE_REQUIRE_EXT=1 timeout 300 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/ops 2>&1 \
    | tee "$OUT/ops_tests.log" || status=1

echo "== railwave ops-bench --device cuda"
timeout 300 "$PY" -m megatron_railwave.cli ops-bench --device cuda --json "$OUT/ops_bench.json" 2>&1 \
    | tee "$OUT/ops_bench.log" || status=1

exit $status
