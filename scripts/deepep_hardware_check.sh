#!/usr/bin/env bash
# Launch scripts/deepep_hardware_check.py on EVERY node of a rail cluster (>= 2 nodes x 8 GPUs,
# DeepEP 2.1 + a CUDA torch on each; megatron-core optional, for the alltoall baseline).
# NOT YET RUN ON HARDWARE.
#   NNODES=2 NODE_RANK=<0..NNODES-1> MASTER_ADDR=<node 0> bash scripts/deepep_hardware_check.sh [extra args]
# Writes $OUT/deepep_hardware.json (default out/deepep_hw) on node 0; exit status 1 when a DeepEP
# path is not bitwise equal to the torch backend. Extra arguments go to the script (e.g.
# --tokens 1024 --samples 20; see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29511}" \
    scripts/deepep_hardware_check.py --out "${OUT:-out/deepep_hw}" "$@"
