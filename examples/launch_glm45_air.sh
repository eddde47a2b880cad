#!/usr/bin/env bash
# GLM-4.5-Air style MoE pretraining with the RailWave dispatcher on 4 nodes x 8 GPUs (EP 32).
#
# *** NOT YET RUN ON GPUs. *** The flags are checked on CPU only: they parse and validate with
# Megatron-LM's own argument parser plus the RailWave flags (tests/unit/test_plugin.py runs this
# script with RAILWAVE_PRINT_ARGS=1). Expect to tune memory settings on the first real run.
#
# Model (GLM-4.5-Air, public config; check against the checkpoint you use):
#   46 layers: layer 1 dense (FFN 10944), layers 2-46 MoE; hidden 4096; 96 heads, GQA 8 groups,
#   head dim 128; partial RoPE (50%), base 1e6; RMSNorm; SwiGLU; QKV bias; untied embeddings;
#   vocab 151552. MoE: 128 routed experts, top-8, expert FFN 1408, one shared expert (1408),
#   sigmoid scores with an expert bias updated outside the gradient (aux-loss free), top-k probs
#   renormalised, no node-limited routing.
# Parallelism: TP 1, PP 1, EP 32 (4 experts per GPU), DP 32 for the dense part; the expert-parallel
#   group spans all 4 nodes, which is what RailWave's rails and waves act on.
#   Memory estimate (not measured): routed experts ~100 B params / 32 = 3.1 B per GPU, plus ~6 B
#   dense and embedding params replicated; with bf16 params, fp32 grads and the distributed
#   optimizer (sharded over DP 32 for dense, not for experts: expert-DP = 1) this is roughly
#   60-70 GB per 80 GB H800 before activations, hence full recompute below. If it does not fit,
#   use PP 2 (EP 32 still spans 4 nodes with 64 GPUs) or fewer layers for a first test.
#
# Usage, on every node (NODE_RANK = 0..3; MASTER_ADDR = node 0's address), from any directory:
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 examples/launch_glm45_air.sh [extra Megatron-LM flags]
# Environment:
#   NNODES (4), GPUS_PER_NODE (8), MASTER_PORT (29500)
#   DATA_PATH     Megatron-LM indexed dataset prefix; unset: --mock-data
#   TOKENIZER     HuggingFace tokenizer name or path (zai-org/GLM-4.5-Air); with mock data and no
#                 TOKENIZER a NullTokenizer with the GLM vocab size is used
#   RAILWAVE_CONFIG (glm45_air_h800: the packaged example, by name; or a YAML path)
#   RAILWAVE_PATH (overrides its 'path': native | rail | perm | joint | auto)
#   MEGATRON_LM_DIR  optional Megatron-LM checkout; its pretrain_gpt data glue is then used
#   SAVE_DIR      checkpoints and TensorBoard logs (unset: no checkpoints)
#   RAILWAVE_PRINT_ARGS=1  print the training script's arguments, one per line, and exit
#   DISPATCHER    railwave (default) or alltoall: the same run with Megatron's alltoall dispatcher
set -euo pipefail

# megatron-railwave must be installed in this environment (README, Install); the config and its
# cluster preset are package data, so the working directory is the caller's.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

NNODES="${NNODES:-4}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RAILWAVE_CONFIG="${RAILWAVE_CONFIG:-glm45_air_h800}"
DISPATCHER="${DISPATCHER:-railwave}"
EP=$((NNODES * GPUS_PER_NODE))

MODEL_ARGS=(
  --num-layers 46
  --hidden-size 4096
  --ffn-hidden-size 10944
  --num-attention-heads 96
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --seq-length 4096
  --max-position-embeddings 131072
  --position-embedding-type rope
  --rotary-percent 0.5
  --rotary-base 1000000
  --normalization RMSNorm
  --norm-epsilon 1e-5
  --swiglu
  --disable-bias-linear
  --add-qkv-bias
  --untie-embeddings-and-output-weights
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --init-method-std 0.02
)

MOE_ARGS=(
  --num-experts 128
  --moe-layer-freq "([0]*1+[1]*45)"
  --moe-ffn-hidden-size 1408
  --moe-shared-expert-intermediate-size 1408
  --moe-router-topk 8
  --moe-router-score-function sigmoid
  --moe-router-enable-expert-bias
  --moe-router-bias-update-rate 1e-3
  --moe-router-topk-scaling-factor 1.0
  --moe-router-dtype fp32
  --moe-router-load-balancing-type none
  --moe-aux-loss-coeff 0.0
  --moe-grouped-gemm
  --moe-per-layer-logging
  --moe-token-dispatcher-type "${DISPATCHER}"
)
if [[ "${DISPATCHER}" == "railwave" ]]; then
  MOE_ARGS+=(--railwave-config "${RAILWAVE_CONFIG}")
  if [[ -n "${RAILWAVE_PATH:-}" ]]; then MOE_ARGS+=(--railwave-path "${RAILWAVE_PATH}"); fi
  if [[ -n "${SAVE_DIR:-}" ]]; then MOE_ARGS+=(--railwave-log-dir "${SAVE_DIR}/railwave"); fi
fi

PARALLEL_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --expert-model-parallel-size "${EP}"
  --use-distributed-optimizer
  --distributed-timeout-minutes 30
)

TRAIN_ARGS=(
  --bf16
  --micro-batch-size 1
  --global-batch-size 256
  --train-iters 1000
  --lr 1e-4
  --min-lr 1e-5
  --lr-decay-style cosine
  --lr-warmup-iters 100
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.95
  --clip-grad 1.0
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --log-interval 1
  --log-throughput
  --eval-iters 0
)

if [[ -n "${DATA_PATH:-}" ]]; then
  DATA_ARGS=(--data-path "${DATA_PATH}" --split 99,1,0
             --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER:-zai-org/GLM-4.5-Air}")
elif [[ -n "${TOKENIZER:-}" ]]; then
  DATA_ARGS=(--mock-data --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER}")
else
  DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 151552)
fi

OUTPUT_ARGS=()
if [[ -n "${SAVE_DIR:-}" ]]; then
  OUTPUT_ARGS=(--save "${SAVE_DIR}/ckpt" --load "${SAVE_DIR}/ckpt" --save-interval 500
               --tensorboard-dir "${SAVE_DIR}/tensorboard")
fi

ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}"
      "${OUTPUT_ARGS[@]}" "$@")

if [[ "${RAILWAVE_PRINT_ARGS:-0}" == "1" ]]; then
  printf '%s\n' "${ARGS[@]}"
  exit 0
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun \
  --nproc-per-node "${GPUS_PER_NODE}" --nnodes "${NNODES}" --node-rank "${NODE_RANK}" \
  --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
  "${REPO_ROOT}/examples/pretrain_gpt_railwave.py" "${ARGS[@]}"
