#!/usr/bin/env bash
# Launch scripts/cluster_smoke_2x8.py on EVERY node of the first multi-GPU machine (2 nodes x 8
# GPUs; a CUDA torch on each, DeepEP 2.1 optional: --deepep-buffer none without it).
# NOT YET RUN ON HARDWARE.
#   NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0> bash scripts/cluster_smoke_2x8.sh [extra args]
# One layer per path and backend with timeout_s = 60 (a hang ends as a named error within about
# a minute, not at the NCCL watchdog's 10), the DeepEP Buffer destroyed before the process group.
# Writes $OUT/cluster_smoke.json (default out/cluster_smoke) on node 0; exit status 1 when a
# variant failed or is not bitwise equal to torch NATIVE. The whole run is bounded by
# SMOKE_LIMIT_S (default 900 s, `timeout -k 30`). DRY_RUN=1 prints the variants and exits.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${DRY_RUN:-0}" = "1" ]; then
    exec "${PY:-python3}" scripts/cluster_smoke_2x8.py --dry-run --world-size "$((${NNODES:-2} * ${GPUS_PER_NODE:-8}))" \
        --gpus-per-node "${GPUS_PER_NODE:-8}" "$@"
fi
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
exec timeout -k 30 "${SMOKE_LIMIT_S:-900}" torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" --master-addr "$MASTER_ADDR" \
    --master-port "${MASTER_PORT:-29512}" \
    scripts/cluster_smoke_2x8.py --out "${OUT:-out/cluster_smoke}" \
    --gpus-per-node "${GPUS_PER_NODE:-8}" --world-size "$((NNODES * ${GPUS_PER_NODE:-8}))" "$@"
