// The railwave op library: schemas and kernel registrations only (meaning: ops/reference.py).

#include <torch/library.h>

#include "../common/ops.h"

TORCH_LIBRARY(railwave, m) {
  m.def("records_from_routing(Tensor routing_map, int num_nodes, int gpus_per_node) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("assign_egress(Tensor node, int owner_gpu, Tensor counts, Tensor keep, Tensor surplus_lo, "
        "Tensor deficit_hi, Tensor wave) -> (Tensor, Tensor)");
  m.def("records_per_node_rail(Tensor node, Tensor egress, Tensor rail_of_gpu, int num_nodes, int num_rails) -> Tensor");
  m.def("pack_rows(Tensor[] tensors, Tensor?[] row_index) -> Tensor");
  m.def("unpack_rows(Tensor packed, int[] widths, Tensor? row_index, int num_rows) -> Tensor[]");
  m.def("segment_sum(Tensor values, Tensor segment_ids, int num_segments, ScalarType out_dtype) -> Tensor");
  // Host planning: CPU only (its inputs are the gathered counts, always on the host).
  m.def("rail_plan(Tensor records, Tensor eligible, bool balanced, int phase) -> (Tensor, Tensor)");
  m.def("rank_schedule(Tensor records, Tensor quota, Tensor relay, Tensor wave, Tensor masks, int rank, int chunks, "
        "int num_phases, int relay_phase, int[] rail_phase, int[] deliver_phase) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("arrival_copies(Tensor records, Tensor copies, Tensor relay, int chunks) -> Tensor");
  m.def("path_estimates(Tensor records, Tensor copies, Tensor eligible, Tensor window, int num_windows, "
        "int chunks, float record_bytes, float nvlink_bytes_per_s, float rail_bytes_per_s, float rail_phase_s, "
        "float layer_s, float combine_share) -> Tensor");
}

TORCH_LIBRARY_IMPL(railwave, CPU, m) {
  m.impl("records_from_routing", &railwave::cpu::records_from_routing);
  m.impl("assign_egress", &railwave::cpu::assign_egress);
  m.impl("records_per_node_rail", &railwave::cpu::records_per_node_rail);
  m.impl("pack_rows", &railwave::cpu::pack_rows);
  m.impl("unpack_rows", &railwave::cpu::unpack_rows);
  m.impl("segment_sum", &railwave::cpu::segment_sum);
  m.impl("rank_schedule", &railwave::cpu::rank_schedule);
  m.impl("rail_plan", &railwave::cpu::rail_plan);
  m.impl("arrival_copies", &railwave::cpu::arrival_copies);
  m.impl("path_estimates", &railwave::cpu::path_estimates);
}

#if defined(RAILWAVE_WITH_CUDA)
TORCH_LIBRARY_IMPL(railwave, CUDA, m) {
  m.impl("records_from_routing", &railwave::cuda::records_from_routing);
  m.impl("assign_egress", &railwave::cuda::assign_egress);
  m.impl("records_per_node_rail", &railwave::cuda::records_per_node_rail);
  m.impl("pack_rows", &railwave::cuda::pack_rows);
  m.impl("unpack_rows", &railwave::cuda::unpack_rows);
  m.impl("segment_sum", &railwave::cuda::segment_sum);
}
#endif
