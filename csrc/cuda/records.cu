// CUDA launchers of records_from_routing, assign_egress and records_per_node_rail.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "../common/ops.h"
#include "../common/validate.h"
#include "../kernels/records.cuh"
#include "launch.h"

namespace railwave::cuda {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> records_from_routing(const at::Tensor& routing_map,
                                                                                int64_t num_nodes,
                                                                                int64_t gpus_per_node) {
  check_records_args(routing_map, num_nodes, gpus_per_node);
  check_on_cuda(routing_map, "routing_map");
  const c10::cuda::CUDAGuard guard(routing_map.device());
  const at::Tensor map_TE = routing_map.contiguous();
  const int64_t T = map_TE.size(0), C = num_nodes * T;
  const auto options = map_TE.options().dtype(at::kLong);
  at::Tensor token_C = at::empty({C}, options), node_C = at::empty({C}, options), mask_C = at::empty({C}, options);
  at::Tensor counts_NM = at::empty({num_nodes, int64_t{1} << gpus_per_node}, options);
  kernels::RecordsArgs args{};
  args.routing_map = reinterpret_cast<const uint8_t*>(map_TE.const_data_ptr<bool>());
  args.num_tokens = T;
  args.num_experts = map_TE.size(1);
  args.num_nodes = static_cast<int>(num_nodes);
  args.gpus_per_node = static_cast<int>(gpus_per_node);
  args.token_C = token_C.data_ptr<int64_t>();
  args.node_C = node_C.data_ptr<int64_t>();
  args.mask_C = mask_C.data_ptr<int64_t>();
  args.counts_NM = counts_NM.data_ptr<int64_t>();
  const at::Tensor workspace = workspace_like(map_TE, kernels::records_workspace_bytes(args));
  RW_CHECK_CUDA(kernels::launch_records_from_routing(args, workspace.data_ptr(), current_stream(map_TE)));
  return {token_C, node_C, mask_C, counts_NM};
}

std::tuple<at::Tensor, at::Tensor> assign_egress(const at::Tensor& node_R, int64_t owner_gpu, const at::Tensor& counts_N,
                                                 const at::Tensor& keep_N, const at::Tensor& surplus_lo_N,
                                                 const at::Tensor& deficit_hi_NG, const at::Tensor& wave_N) {
  const int64_t G = check_assign_args(node_R, owner_gpu, counts_N, keep_N, surplus_lo_N, deficit_hi_NG, wave_N);
  check_on_cuda(node_R, "node_R");
  RW_CHECK(counts_N.numel() <= kernels::kMaxAssignNodes, "assign_egress supports up to ", kernels::kMaxAssignNodes,
           " nodes on CUDA, got ", counts_N.numel());
  const c10::cuda::CUDAGuard guard(node_R.device());
  const at::Tensor node_c = node_R.contiguous(), counts_c = counts_N.contiguous(), keep_c = keep_N.contiguous(),
                   lo_c = surplus_lo_N.contiguous(), hi_c = deficit_hi_NG.contiguous(), wave_c = wave_N.contiguous();
  at::Tensor egress_R = at::empty_like(node_c), wave_R = at::empty_like(node_c);
  kernels::AssignArgs args{};
  args.node_R = node_c.const_data_ptr<int64_t>();
  args.num_records = node_c.numel();
  args.owner_gpu = static_cast<int>(owner_gpu);
  args.num_nodes = static_cast<int>(counts_c.numel());
  args.gpus_per_node = static_cast<int>(G);
  args.counts_N = counts_c.const_data_ptr<int64_t>();
  args.keep_N = keep_c.const_data_ptr<int64_t>();
  args.surplus_lo_N = lo_c.const_data_ptr<int64_t>();
  args.deficit_hi_NG = hi_c.const_data_ptr<int64_t>();
  args.wave_N = wave_c.const_data_ptr<int64_t>();
  args.egress_R = egress_R.data_ptr<int64_t>();
  args.wave_R = wave_R.data_ptr<int64_t>();
  RW_CHECK_CUDA(kernels::launch_assign_egress(args, current_stream(node_c)));
  return {egress_R, wave_R};
}

at::Tensor records_per_node_rail(const at::Tensor& node_R, const at::Tensor& egress_R, const at::Tensor& rail_of_gpu_G,
                                 int64_t num_nodes, int64_t num_rails) {
  check_node_rail_args(node_R, egress_R, rail_of_gpu_G, num_nodes, num_rails);
  check_on_cuda(node_R, "node_R");
  const c10::cuda::CUDAGuard guard(node_R.device());
  const at::Tensor node_c = node_R.contiguous(), egress_c = egress_R.contiguous(), rail_c = rail_of_gpu_G.contiguous();
  at::Tensor out_NR = at::empty({num_nodes, num_rails}, node_c.options());
  kernels::NodeRailArgs args{};
  args.node_R = node_c.const_data_ptr<int64_t>();
  args.egress_R = egress_c.const_data_ptr<int64_t>();
  args.rail_of_gpu = rail_c.const_data_ptr<int64_t>();
  args.num_records = node_c.numel();
  args.num_nodes = static_cast<int>(num_nodes);
  args.num_rails = static_cast<int>(num_rails);
  args.gpus_per_node = static_cast<int>(rail_c.numel());
  args.out_NR = out_NR.data_ptr<int64_t>();
  RW_CHECK_CUDA(kernels::launch_records_per_node_rail(args, current_stream(node_c)));
  return out_NR;
}

}  // namespace railwave::cuda
