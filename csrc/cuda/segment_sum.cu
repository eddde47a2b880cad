// CUDA launcher of segment_sum: fixed-order, deterministic, bitwise equal to the CPU twin.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "../common/ops.h"
#include "../common/validate.h"
#include "../kernels/segment_sum.cuh"
#include "launch.h"

namespace railwave::cuda {
namespace {

kernels::FloatType float_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::FloatType::kF32;
    case at::kDouble: return kernels::FloatType::kF64;
    case at::kBFloat16: return kernels::FloatType::kBF16;
    case at::kHalf: return kernels::FloatType::kF16;
    default: RW_CHECK(false, "unsupported dtype ", t); return kernels::FloatType::kF32;
  }
}

}  // namespace

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& segment_ids, int64_t num_segments,
                       at::ScalarType out_dtype) {
  check_segment_sum_args(values, segment_ids, num_segments, out_dtype);
  check_on_cuda(values, "values");
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor v = values.contiguous(), ids = segment_ids.contiguous();
  const int64_t n = v.size(0);
  std::vector<int64_t> out_shape = v.sizes().vec();
  out_shape[0] = num_segments;
  at::Tensor out = at::empty(out_shape, v.options().dtype(out_dtype));
  if (n == 0 || out.numel() == 0) return out.zero_();  // +0.0 in every float type is all-zero bits
  // Ids outside [0, S) are not checked on the device (no host sync): their rows are left out.
  kernels::SegmentSumArgs args{};
  args.values = v.const_data_ptr();
  args.segment_ids = ids.const_data_ptr<int64_t>();
  args.num_rows = n;
  args.num_segments = num_segments;
  args.width = v.numel() / n;
  args.values_type = float_type(v.scalar_type());
  args.out_type = float_type(out_dtype);
  args.out = out.data_ptr();
  const at::Tensor workspace = workspace_like(v, kernels::segment_sum_workspace_bytes(args));
  RW_CHECK_CUDA(kernels::launch_segment_sum(args, workspace.data_ptr(), current_stream(v)));
  return out;
}

}  // namespace railwave::cuda
