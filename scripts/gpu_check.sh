#!/usr/bin/env bash
# The one prepared device check for a lent GPU machine (H200; Python 3.12, torch 2.11+cu130,
# nvcc 13, no Megatron, no package registry). Runs from the repository root in under 7 minutes
# and writes JSON under $OUT (default out/gpu_check):
#   env.json                    torch / CUDA / device facts
#   ops_bench.json, ops.log     the CUDA extension: build, gpu-marked op tests, ops-bench
#                               (scripts/gpu_check_ops.sh)
#   virtual_glm_bf16.json       virtual cluster, H800 4x8 preset, GLM-4.5-Air layer size
#                               (T=4096, H=4096 bf16, E=128, top-8): the four paths bitwise equal,
#                               error vs the float64 reference, host syncs counted with
#                               torch.cuda.set_sync_debug_mode, time per path
#   virtual_fp32.json           the same at T=512, H=256 fp32 (error goal 1e-5)
#   virtual_fixed_bf16.json     fixed-capacity mode (max_tokens_per_rank = 1024, T = 1024,
#                               H = 4096 bf16): bitwise equal to the normal mode and across paths,
#                               0 host syncs per layer under set_sync_debug_mode
#   gpu_check.log               everything printed
# Usage: make gpu-check (or OUT=... bash scripts/gpu_check.sh).
set -u -o pipefail
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
status=0
{
  echo "== environment"
  $PY - "$OUT/env.json" <<'PYEOF'
import json, sys, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1), sm=f"{p.major}.{p.minor}")
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
PYEOF
  if [ -f scripts/gpu_check_ops.sh ]; then
    echo "== CUDA extension (scripts/gpu_check_ops.sh)"
    OUT="$OUT" timeout 240 bash scripts/gpu_check_ops.sh > "$OUT/ops.log" 2>&1 || { echo "ops check failed ($?)"; status=1; }
    tail -n 40 "$OUT/ops.log"
  fi
  echo "== virtual cluster, GLM-4.5-Air layer, bf16, CUDA"
  timeout 240 $PY -m megatron_railwave.cli simulate-exchange --cluster configs/clusters/h800_4x8.yaml \
      --tokens 4096 --hidden 4096 --experts 128 --topk 8 --dtype bf16 --device cuda \
      --json "$OUT/virtual_glm_bf16.json" || status=1
  echo "== virtual cluster, fp32, CUDA"
  timeout 120 $PY -m megatron_railwave.cli simulate-exchange --cluster configs/clusters/h800_4x8.yaml \
      --tokens 512 --hidden 256 --experts 128 --topk 8 --dtype fp32 --device cuda \
      --json "$OUT/virtual_fp32.json" || status=1
  echo "== virtual cluster, fp32, CUDA, 3 rail chunks per wave (PERM / JOINT)"
  timeout 120 $PY -m megatron_railwave.cli simulate-exchange --cluster configs/clusters/h800_4x8.yaml \
      --tokens 512 --hidden 256 --experts 128 --topk 8 --dtype fp32 --device cuda --chunks 3 \
      --json "$OUT/virtual_fp32_chunks3.json" || status=1
  echo "== virtual cluster, fixed-capacity mode, bf16, CUDA"
  timeout 120 $PY -m megatron_railwave.cli simulate-exchange --cluster configs/clusters/h800_4x8.yaml \
      --tokens 1024 --hidden 4096 --experts 128 --topk 8 --dtype bf16 --device cuda \
      --max-tokens-per-rank 1024 --json "$OUT/virtual_fixed_bf16.json" || status=1
  echo "== done: status $status"
} 2>&1 | tee "$OUT/gpu_check.log"
exit $status
