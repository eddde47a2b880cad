// Signatures of the railwave ops, declared once for both implementations: railwave::cpu (the
// CPU twins, csrc/cpu) and railwave::cuda (the launchers, csrc/cuda; only with RAILWAVE_WITH_CUDA).
// Meaning: megatron_railwave/ops/reference.py; both give its results bit for bit.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#define RAILWAVE_OP_SIGNATURES                                                                                \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> records_from_routing(                            \
      const at::Tensor& routing_map, int64_t num_nodes, int64_t gpus_per_node);                               \
  std::tuple<at::Tensor, at::Tensor> assign_egress(const at::Tensor& node, int64_t owner_gpu,                 \
                                                   const at::Tensor& counts, const at::Tensor& keep,          \
                                                   const at::Tensor& surplus_lo, const at::Tensor& deficit_hi, \
                                                   const at::Tensor& wave);                                   \
  at::Tensor records_per_node_rail(const at::Tensor& node, const at::Tensor& egress,                          \
                                   const at::Tensor& rail_of_gpu, int64_t num_nodes, int64_t num_rails);      \
  at::Tensor pack_rows(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& row_index);        \
  std::vector<at::Tensor> unpack_rows(const at::Tensor& packed, at::IntArrayRef widths,                       \
                                      const std::optional<at::Tensor>& row_index, int64_t num_rows);          \
  at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& segment_ids, int64_t num_segments,       \
                         at::ScalarType out_dtype);

namespace railwave::cpu {
RAILWAVE_OP_SIGNATURES

// Host planning (CPU tensors only, whatever the exchange's device): csrc/cpu/schedule.cpp.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rank_schedule(
    const at::Tensor& records_NNG, const at::Tensor& quota_NNG, const at::Tensor& relay_NNGG,
    const at::Tensor& wave_NN, const at::Tensor& masks_WM, int64_t rank, int64_t chunks, int64_t num_phases,
    at::IntArrayRef relay_phase_U, at::IntArrayRef rail_phase_V, at::IntArrayRef deliver_phase_R);
std::tuple<at::Tensor, at::Tensor> rail_plan(const at::Tensor& records_NNG, const at::Tensor& eligible_NNG,
                                             bool balanced, int64_t phase);
// The min-max relay plan of FLOW / FLOW_WAVES (int64 relay counts): csrc/cpu/flow.cpp.
at::Tensor flow_plan(const at::Tensor& records_NNG, const at::Tensor& copies_NNGG, const at::Tensor& eligible_NNG,
                     const at::Tensor& wave_NN, const at::Tensor& rail_of_gpu_G, int64_t num_waves, int64_t num_rails,
                     int64_t nvlink_cost, int64_t nic_cost, int64_t units, int64_t sweeps);
}  // namespace railwave::cpu

#if defined(RAILWAVE_WITH_CUDA)
namespace railwave::cuda {
RAILWAVE_OP_SIGNATURES
}  // namespace railwave::cuda
#endif
