// The railwave ops' compiled kernels: the CPU twins and, with RAILWAVE_WITH_CUDA, the CUDA kernels.
// Registrations only: the schemas, the reference (pure-torch) kernels that serve every other case,
// the fake implementations and the autograd are defined once, in Python
// (megatron_railwave/ops/_library.py). The kernels are registered at run time, not at load time, by
// register_kernels(): they serve while its handle lives, and dropping the handle
// (ops.set_forced_reference(True)) leaves the reference kernels serving the same ops.

#include <torch/library.h>

#include <memory>
#include <optional>
#include <vector>

#include "../common/ops.h"
#include "kernels.h"

namespace {

// segment_sum's max_segment_len bounds the reference's position-by-position loop off the CPU; the
// compiled kernels need no bound.
template <auto Kernel>
at::Tensor segment_sum_without_bound(const at::Tensor& values, const at::Tensor& segment_ids, int64_t num_segments,
                                     at::ScalarType out_dtype, std::optional<int64_t> /*max_segment_len*/) {
  return Kernel(values, segment_ids, num_segments, out_dtype);
}

torch::Library cpu_kernels() {
  torch::Library m(torch::Library::IMPL, "railwave", c10::DispatchKey::CPU, __FILE__, __LINE__);
  m.impl("records_from_routing", &railwave::cpu::records_from_routing);
  m.impl("assign_egress", &railwave::cpu::assign_egress);
  m.impl("records_per_node_rail", &railwave::cpu::records_per_node_rail);
  m.impl("pack_rows", &railwave::cpu::pack_rows);
  m.impl("unpack_rows", &railwave::cpu::unpack_rows);
  m.impl("segment_sum", &segment_sum_without_bound<&railwave::cpu::segment_sum>);
  // Host planning: CPU only (its inputs are the gathered counts, always on the host).
  m.impl("rank_schedule", &railwave::cpu::rank_schedule);
  m.impl("rail_plan", &railwave::cpu::rail_plan);
  m.impl("flow_plan", &railwave::cpu::flow_plan);
  return m;
}

#if defined(RAILWAVE_WITH_CUDA)
torch::Library cuda_kernels() {
  torch::Library m(torch::Library::IMPL, "railwave", c10::DispatchKey::CUDA, __FILE__, __LINE__);
  m.impl("records_from_routing", &railwave::cuda::records_from_routing);
  m.impl("assign_egress", &railwave::cuda::assign_egress);
  m.impl("records_per_node_rail", &railwave::cuda::records_per_node_rail);
  m.impl("pack_rows", &railwave::cuda::pack_rows);
  m.impl("unpack_rows", &railwave::cuda::unpack_rows);
  m.impl("segment_sum", &segment_sum_without_bound<&railwave::cuda::segment_sum>);
  return m;
}
#endif

// Each torch::Library keeps its registrations until it is destroyed.
struct Kernels {
  std::vector<torch::Library> libraries;
};

}  // namespace

namespace railwave {

void* register_kernels(std::string& error) {
  try {
    auto kernels = std::make_unique<Kernels>();
    kernels->libraries.push_back(cpu_kernels());
#if defined(RAILWAVE_WITH_CUDA)
    kernels->libraries.push_back(cuda_kernels());
#endif
    return kernels.release();
  } catch (const std::exception& exc) {
    error = exc.what();
    return nullptr;
  }
}

void release_kernels(void* handle) { delete static_cast<Kernels*>(handle); }

}  // namespace railwave
