#!/usr/bin/env bash
# The one prepared device check for a lent GPU machine: one H200 (139 GiB), 16 cores, Python 3.12,
# torch with CUDA, nvcc; no Megatron, no package registry. NOT YET RUN ON HARDWARE.
#
# Steps, each with its own time limit (seconds; they add up to 475 < 480, so the whole check ends
# within 8 minutes; every step runs under `timeout -k 10`, and summary.json gives per step the
# seconds it took and the limit it had). CPU-side costs measured on the 2-core CPU dev box (shared,
# niced) with the same simulate-exchange commands on --device cpu, 6 paths:
#   T=512 H=256 fp32 on 4x8: 39 s; with --chunks 3: 41 s; on 2x8 (--nodes 2): 18 s
#   T=1024 H=512 bf16 on 4x8 (GLM shape scaled down 8x in H): 106 s
#   T=256 H=2048 bf16 fixed capacity on 4x8: over 300 s (CPU bf16 compute, not Python overhead)
# so the 4x8 GLM steps do not fit 480 s with 2x headroom: the virtual steps run on 2 nodes x 8.
#   preflight            30 s  imports and tools (torch with CUDA, numpy, yaml, Python.h, a C++ compiler,
#                              ninja, nvcc), one line naming what is missing; no CUDA device: exit 2
#   doctor               25 s  railwave doctor --json (versions, compiled ops, GPUs, NICs, self-test)
#   build               180 s  megatron_railwave._C with its CUDA kernels (TORCH_CUDA_ARCH_LIST=9.0;
#                              ninja required, so the 3 .cu files build in parallel); not measured
#   gpu_tests            60 s  the gpu-marked ops tests: every CUDA op against its CPU twin, bitwise;
#                              not measured
#   virtual_fp32         40 s  2x8, T=512 H=256 fp32 (measured 18 s on CPU: 2.2x headroom); compiled
#                              ops required, 1 host sync per layer asserted
#   virtual_fixed_fp32   40 s  fixed-capacity mode C = T = 128, H=256 fp32, 2x8: bitwise equal to the
#                              normal mode, 0 host syncs asserted; NOT measured (the CPU run did not
#                              finish in the time this change had)
#   async_gpu            20 s  the asynchronous exchange's stream / event ordering (test_async_gpu.py)
#   ops_bench            20 s  railwave ops-bench --device cuda: every op's output equal to the
#                              reference (exit 1 otherwise), fails without compiled CUDA kernels
#   virtual_glm_bf16     60 s  last: 2x8, T=1024 H=4096 bf16, 1 host sync asserted; this limit is NOT
#                              2x a measurement (the 2x8 H=512 CPU run took over 100 s); a timeout
#                              here costs no other step
# The virtual-cluster steps pass --max-memory-gib 110: simulate-exchange refuses to start a run
# whose estimated peak is larger, and the JSON gives the measured peak next to the estimate.
#
# What this check does NOT check: NCCL across processes (every rank runs in one process here),
# DeepEP, the rails and NICs (one GPU, no network), Megatron-Core (not installed there), timing at
# cluster scale (the virtual cluster runs the W ranks one after another).
#
# Writes under $OUT (default out/gpu_check): summary.json (PASS / FAIL / SKIP per step, seconds,
# exit status, the limits), one <step>.log per step, <step>.json where the step writes one, and
# gpu_check.log (everything printed). Exit status: 0 when every step passed, 2 without a CUDA
# device (nothing was checked), 1 when any step failed.
# Usage: make gpu-check (or OUT=... bash scripts/gpu_check.sh; PY=... picks the interpreter).
# Test hooks (tests/unit/test_gpu_check_script.py): GPU_CHECK_ONLY=step,step runs only those
# steps; GPU_CHECK_FAIL_STEP=step replaces that step's command by a failing one;
# GPU_CHECK_REQUIRE_CUDA=0 goes on without a CUDA device; GPU_CHECK_PREFLIGHT_S=seconds replaces
# the preflight's 30 s and GPU_CHECK_LIMIT_SCALE=k multiplies the steps' limits (a loaded CPU
# machine can take 30 s to import torch).
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
ONLY=${GPU_CHECK_ONLY:-}
FAIL_STEP=${GPU_CHECK_FAIL_STEP:-}
REQUIRE_CUDA=${GPU_CHECK_REQUIRE_CUDA:-1}
PREFLIGHT_S=${GPU_CHECK_PREFLIGHT_S:-30}
LIMIT_SCALE=${GPU_CHECK_LIMIT_SCALE:-1}
TOTAL_LIMIT_S=480
# Everything printed goes to the terminal and to gpu_check.log; status stays in this shell (no
# pipeline around the steps, so that a failure sets the exit status).
exec > >(tee "$OUT/gpu_check.log") 2>&1
status=0
steps_tsv="$OUT/steps.tsv"
: > "$steps_tsv"

# step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout LIMIT_S`, logs to $OUT/NAME.log,
# records PASS / FAIL and the seconds.
step() {
    local name=$1 limit=$(($2 * LIMIT_SCALE))
    shift 2
    if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then
        printf '%s\tSKIP\t0\t%s\tnot selected (GPU_CHECK_ONLY)\n' "$name" "$limit" >> "$steps_tsv"
        return 0
    fi
    if [ "$name" = "$FAIL_STEP" ]; then
        set -- bash -c "echo 'forced failure (GPU_CHECK_FAIL_STEP=$name)'; exit 3"
    fi
    echo "== $name (limit ${limit} s)"
    local start=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - start))
    tail -n 25 "$OUT/$name.log"
    local verdict=PASS note=""
    if [ "$rc" -ne 0 ]; then
        verdict=FAIL status=1
        note="exit status $rc"
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note="timed out after $limit s"; fi
    fi
    echo "-- $name: $verdict in ${took} s of ${limit} s${note:+ ($note)}"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$verdict" "$took" "$limit" "$note" >> "$steps_tsv"
}

write_summary() {
    "$PY" - "$steps_tsv" "$OUT/summary.json" "$status" "$TOTAL_LIMIT_S" <<'PYEOF' || echo "could not write summary.json"
import json, sys
steps = []
for line in open(sys.argv[1]):
    name, verdict, seconds, limit, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
    steps.append({"step": name, "result": verdict, "seconds": int(seconds), "limit_s": int(limit), "note": note})
summary = {"schema": "railwave.gpu_check/1", "exit_status": int(sys.argv[3]), "total_limit_s": int(sys.argv[4]),
           "sum_of_step_limits_s": sum(s["limit_s"] for s in steps), "steps": steps}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
PYEOF
}

# Preflight: one line that names what is missing. Without a CUDA device nothing else can run.
echo "== preflight (limit $PREFLIGHT_S s)"
start=$SECONDS
pre_rc=0
timeout -k 10 "$PREFLIGHT_S" "$PY" - > "$OUT/preflight.log" 2>&1 <<'PYEOF' || pre_rc=$?
import importlib, importlib.util, os, shutil, sys, sysconfig
missing, notes = [], []
for mod in ("torch", "numpy", "yaml", "pytest"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # noqa: BLE001
        missing.append(f"{mod} ({type(exc).__name__})")
if importlib.util.find_spec("hypothesis") is None:
    notes.append("hypothesis not installed: the property tests skip (the gpu tests do not need it)")
if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    missing.append("Python.h (python3-dev)")
if not (shutil.which("c++") or shutil.which("g++")):
    missing.append("a C++ compiler (c++ / g++)")
if not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
    missing.append("nvcc")
if not shutil.which("ninja"):
    missing.append("ninja (pip install ninja; without it the 3 .cu files build one after another)")
cuda = False
try:
    import torch
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuda available: {cuda}"
          + (f", {torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}" if cuda else ""))
except Exception:  # noqa: BLE001
    pass
print("preflight: " + ("missing: " + ", ".join(missing) if missing else "nothing missing")
      + ("; " + "; ".join(notes) if notes else ""))
if not cuda:
    print("preflight: no CUDA device: torch.cuda.is_available() is False (or torch did not import); "
          "this check needs one GPU")
    sys.exit(2)
sys.exit(1 if missing else 0)
PYEOF
cat "$OUT/preflight.log"
took=$((SECONDS - start))
if [ "$pre_rc" -eq 2 ] && [ "$REQUIRE_CUDA" = "1" ]; then
    echo "gpu-check: no CUDA device on this machine: nothing was checked (exit 2)"
    printf 'preflight\tFAIL\t%s\t%s\tno CUDA device\n' "$took" "$PREFLIGHT_S" >> "$steps_tsv"
    status=2
    write_summary
    exit 2
elif [ "$pre_rc" -eq 2 ]; then
    printf 'preflight\tSKIP\t%s\t%s\tno CUDA device (GPU_CHECK_REQUIRE_CUDA=0)\n' "$took" "$PREFLIGHT_S" >> "$steps_tsv"
elif [ "$pre_rc" -ne 0 ]; then
    note="exit status $pre_rc"
    if [ "$pre_rc" -eq 124 ]; then note="timed out after $PREFLIGHT_S s"; fi
    printf 'preflight\tFAIL\t%s\t%s\t%s\n' "$took" "$PREFLIGHT_S" "$note" >> "$steps_tsv"
    status=1
else
    printf 'preflight\tPASS\t%s\t%s\t\n' "$took" "$PREFLIGHT_S" >> "$steps_tsv"
fi

VIRTUAL=("$PY" -m megatron_railwave.cli simulate-exchange --cluster h800_4x8 --device cuda
         --experts 128 --topk 8 --max-memory-gib 110 --require-compiled --nodes 2)
step doctor 25 "$PY" -m megatron_railwave.cli doctor --json "$OUT/doctor.json"
step build 180 env TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
    "$PY" setup.py -q build_ext --inplace
step gpu_tests 60 env RAILWAVE_REQUIRE_EXT=1 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/ops
step virtual_fp32 40 "${VIRTUAL[@]}" --tokens 512 --hidden 256 --dtype fp32 --expect-host-syncs 1 \
    --json "$OUT/virtual_fp32.json"
step virtual_fixed_fp32 40 "${VIRTUAL[@]}" --tokens 128 --hidden 256 --dtype fp32 --max-tokens-per-rank 128 \
    --expect-host-syncs 0 --json "$OUT/virtual_fixed_fp32.json"
step async_gpu 20 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/unit/exchange/test_async_gpu.py
step ops_bench 20 "$PY" -m megatron_railwave.cli ops-bench --device cuda --json "$OUT/ops_bench.json"
step virtual_glm_bf16 60 "${VIRTUAL[@]}" --tokens 1024 --hidden 4096 --dtype bf16 --expect-host-syncs 1 \
    --json "$OUT/virtual_glm_bf16.json"

write_summary
echo "== gpu-check done: exit status $status (summary: $OUT/summary.json)"
exit $status
