// CUDA launchers of pack_rows and unpack_rows: one kernel launch per call (up to 8 tensors).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "../common/ops.h"
#include "../common/validate.h"
#include "../kernels/rows.cuh"
#include "launch.h"

namespace railwave::cuda {

at::Tensor pack_rows(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& row_index) {
  const PackLayout layout = pack_layout(tensors, row_index);
  check_on_cuda(layout.sources[0], "tensors");
  const c10::cuda::CUDAGuard guard(layout.sources[0].device());
  // Row indices are not range-checked on the device (that would need a host sync): callers pass
  // indices from the plan; the CPU twin checks them.
  at::Tensor packed = at::empty({layout.num_rows, layout.row_bytes}, layout.sources[0].options().dtype(at::kByte));
  std::vector<kernels::RowPart> parts(layout.sources.size());
  for (size_t k = 0; k < parts.size(); ++k) {
    parts[k].src = static_cast<const uint8_t*>(layout.sources[k].const_data_ptr());
    parts[k].dst = packed.data_ptr<uint8_t>() + layout.offset[k];
    parts[k].src_stride = layout.width[k];
    parts[k].dst_stride = layout.row_bytes;
    parts[k].width = layout.width[k];
    parts[k].src_row = layout.index[k].defined() ? layout.index[k].const_data_ptr<int64_t>() : nullptr;
    parts[k].dst_row = nullptr;
  }
  RW_CHECK_CUDA(kernels::launch_copy_rows(parts.data(), static_cast<int>(parts.size()), layout.num_rows,
                                          current_stream(packed)));
  return packed;
}

std::vector<at::Tensor> unpack_rows(const at::Tensor& packed, at::IntArrayRef widths,
                                    const std::optional<at::Tensor>& row_index, int64_t num_rows) {
  const std::vector<int64_t> offsets = check_unpack_args(packed, widths, row_index, num_rows);
  check_on_cuda(packed, "packed");
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor in = packed.contiguous();
  const bool scatter = row_index.has_value() && row_index->defined();
  const at::Tensor index = scatter ? row_index->contiguous() : at::Tensor();
  const int64_t out_rows = scatter ? num_rows : in.size(0);
  // Rows that no record writes stay zero (the reference's new_zeros + index_copy_); a full
  // permutation (n distinct rows of n, from the host sizes, no sync) writes every row: no fill.
  const bool fill = scatter && in.size(0) < out_rows;
  std::vector<at::Tensor> outs;
  std::vector<kernels::RowPart> parts(widths.size());
  for (size_t k = 0; k < widths.size(); ++k) {
    outs.push_back(fill ? at::zeros({out_rows, widths[k]}, in.options()) : at::empty({out_rows, widths[k]}, in.options()));
    parts[k].src = in.const_data_ptr<uint8_t>() + offsets[k];
    parts[k].dst = outs.back().data_ptr<uint8_t>();
    parts[k].src_stride = in.size(1);
    parts[k].dst_stride = widths[k];
    parts[k].width = widths[k];
    parts[k].src_row = nullptr;
    parts[k].dst_row = scatter ? index.const_data_ptr<int64_t>() : nullptr;
  }
  RW_CHECK_CUDA(kernels::launch_copy_rows(parts.data(), static_cast<int>(parts.size()), in.size(0), current_stream(in)));
  return outs;
}

}  // namespace railwave::cuda
