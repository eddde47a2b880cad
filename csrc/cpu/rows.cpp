// CPU twins of pack_rows and unpack_rows: one memcpy per (row, tensor), no intermediate copies.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <vector>

#include "../common/ops.h"
#include "../common/validate.h"
#include "alloc.h"

namespace railwave::cpu {

at::Tensor pack_rows(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& row_index) {
  const PackLayout layout = pack_layout(tensors, row_index);
  const int64_t n = layout.num_rows, row_bytes = layout.row_bytes;
  const size_t parts = layout.sources.size();
  std::vector<const uint8_t*> src(parts);
  std::vector<const int64_t*> idx(parts, nullptr);
  for (size_t k = 0; k < parts; ++k) {
    src[k] = static_cast<const uint8_t*>(layout.sources[k].const_data_ptr());
    if (layout.index[k].defined()) {
      idx[k] = layout.index[k].const_data_ptr<int64_t>();
      const int64_t rows = layout.sources[k].size(0);
      for (int64_t i = 0; i < n; ++i) {
        RW_CHECK(idx[k][i] >= 0 && idx[k][i] < rows, "row_index[", k, "][", i, "] = ", idx[k][i],
                 " is out of range for a tensor of ", rows, " rows");
      }
    }
  }
  at::Tensor packed = empty_output({n, row_bytes}, layout.sources[0].options().dtype(at::kByte));
  uint8_t* out = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* dst = out + i * row_bytes;
    for (size_t k = 0; k < parts; ++k) {
      const int64_t w = layout.width[k];
      const int64_t r = idx[k] ? idx[k][i] : i;
      std::memcpy(dst + layout.offset[k], src[k] + r * w, static_cast<size_t>(w));
    }
  }
  return packed;
}

std::vector<at::Tensor> unpack_rows(const at::Tensor& packed, at::IntArrayRef widths,
                                    const std::optional<at::Tensor>& row_index, int64_t num_rows) {
  const std::vector<int64_t> offsets = check_unpack_args(packed, widths, row_index, num_rows);
  const at::Tensor in = packed.contiguous();
  const int64_t n = in.size(0), row_bytes = in.size(1);
  const uint8_t* src = in.const_data_ptr<uint8_t>();
  const bool scatter = row_index.has_value() && row_index->defined();
  const int64_t out_rows = scatter ? num_rows : n;
  // n distinct rows of n: a full permutation writes every output row, so none is zero-filled
  // (decided from the host sizes; distinctness is still checked below).
  const bool fill = scatter && n < out_rows;
  const at::Tensor index = scatter ? row_index->contiguous() : at::Tensor();
  const int64_t* idx = scatter ? index.const_data_ptr<int64_t>() : nullptr;

  std::vector<uint8_t> written;
  if (scatter) {
    written.assign(static_cast<size_t>(out_rows), 0);
    for (int64_t i = 0; i < n; ++i) {
      RW_CHECK(idx[i] >= 0 && idx[i] < out_rows, "row_index[", i, "] = ", idx[i], " is out of range for ", out_rows,
               " rows");
      RW_CHECK(!written[idx[i]], "row_index must be distinct; row ", idx[i], " appears twice");
      written[idx[i]] = 1;
    }
  }
  std::vector<at::Tensor> outs;
  outs.reserve(widths.size());
  for (size_t k = 0; k < widths.size(); ++k) {
    const int64_t w = widths[k];
    at::Tensor out = empty_output({out_rows, w}, in.options());
    uint8_t* dst = out.data_ptr<uint8_t>();
    const uint8_t* part = src + offsets[k];
    if (w > 0) {
      for (int64_t i = 0; i < n; ++i) {
        std::memcpy(dst + (idx ? idx[i] : i) * w, part + i * row_bytes, static_cast<size_t>(w));
      }
      if (fill) {
        for (int64_t r = 0; r < out_rows; ++r) {
          if (!written[r]) std::memset(dst + r * w, 0, static_cast<size_t>(w));  // rows nobody writes are zero
        }
      }
    }
    outs.push_back(std::move(out));
  }
  return outs;
}

}  // namespace railwave::cpu
