// Argument checks and output layouts shared by the CPU twins and the CUDA launchers, so that
// both reject the same inputs with the same messages. Host only; metadata only (no data reads).
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "check.h"

namespace railwave {

constexpr int64_t kMaxGpusPerNode = 8;  // masks are bit sets of the node's GPUs (M = 2**G <= 256)

inline void check_index_tensor(const at::Tensor& t, const char* name, int64_t length, c10::Device device) {
  RW_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  RW_CHECK(t.dim() == 1 && t.size(0) == length, name, " must be [", length, "], got ", t.sizes());
  RW_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
}

inline void check_records_args(const at::Tensor& routing_map, int64_t num_nodes, int64_t gpus_per_node) {
  RW_CHECK(routing_map.scalar_type() == at::kBool, "routing_map must be bool, got ", routing_map.scalar_type());
  RW_CHECK(routing_map.dim() == 2, "routing_map must be [T, E], got ", routing_map.sizes());
  RW_CHECK(num_nodes >= 1, "num_nodes must be >= 1, got ", num_nodes);
  RW_CHECK(gpus_per_node >= 1 && gpus_per_node <= kMaxGpusPerNode, "gpus_per_node must be in 1..8, got ",
           gpus_per_node);
  RW_CHECK(routing_map.size(1) % (num_nodes * gpus_per_node) == 0, "E=", routing_map.size(1),
           " experts do not split evenly over ", num_nodes, " nodes x ", gpus_per_node, " GPUs");
  RW_CHECK(routing_map.size(0) * num_nodes < (int64_t{1} << 31), "T * N = ", routing_map.size(0) * num_nodes,
           " records exceed 2**31");
}

// Returns G (the deficit table's width).
inline int64_t check_assign_args(const at::Tensor& node, int64_t owner_gpu, const at::Tensor& counts,
                                 const at::Tensor& keep, const at::Tensor& surplus_lo,
                                 const at::Tensor& deficit_hi, const at::Tensor& wave) {
  RW_CHECK(node.dim() == 1, "node_R must be [n], got ", node.sizes());
  const int64_t num_nodes = counts.numel();
  RW_CHECK(deficit_hi.dim() == 2 && deficit_hi.size(0) == num_nodes, "deficit_hi_NG must be [N, G] with N=",
           num_nodes, " (counts_N's length), got ", deficit_hi.sizes());
  const int64_t gpus = deficit_hi.size(1);
  RW_CHECK(gpus >= 1 && gpus <= kMaxGpusPerNode, "deficit_hi_NG has G=", gpus, " GPUs, expected 1..8");
  RW_CHECK(owner_gpu >= 0 && owner_gpu < gpus, "owner_gpu=", owner_gpu, " is not a GPU of a node with ", gpus,
           " GPUs");
  check_index_tensor(node, "node_R", node.size(0), node.device());
  check_index_tensor(counts, "counts_N", num_nodes, node.device());
  check_index_tensor(keep, "keep_N", num_nodes, node.device());
  check_index_tensor(surplus_lo, "surplus_lo_N", num_nodes, node.device());
  check_index_tensor(wave, "wave_N", num_nodes, node.device());
  RW_CHECK(deficit_hi.scalar_type() == at::kLong && deficit_hi.device() == node.device(),
           "deficit_hi_NG must be int64 on ", node.device(), ", got ", deficit_hi.scalar_type(), " on ",
           deficit_hi.device());
  return gpus;
}

inline void check_node_rail_args(const at::Tensor& node, const at::Tensor& egress, const at::Tensor& rail_of_gpu,
                                 int64_t num_nodes, int64_t num_rails) {
  RW_CHECK(node.dim() == 1, "node_R must be [n], got ", node.sizes());
  RW_CHECK(num_nodes >= 1 && num_rails >= 1, "num_nodes and num_rails must be >= 1, got ", num_nodes, " and ",
           num_rails);
  check_index_tensor(node, "node_R", node.size(0), node.device());
  check_index_tensor(egress, "egress_R", node.size(0), node.device());
  RW_CHECK(rail_of_gpu.dim() == 1 && rail_of_gpu.numel() >= 1, "rail_of_gpu_G must be [G], got ",
           rail_of_gpu.sizes());
  check_index_tensor(rail_of_gpu, "rail_of_gpu_G", rail_of_gpu.size(0), node.device());
}

// Byte layout of pack_rows: source k's row goes to bytes [offset[k], offset[k] + width[k]).
struct PackLayout {
  std::vector<at::Tensor> sources;  // contiguous
  std::vector<at::Tensor> index;    // undefined where the source takes rows 0..n-1
  std::vector<int64_t> width;       // bytes of one row of source k
  std::vector<int64_t> offset;      // byte offset of source k in a packed row
  int64_t num_rows = 0;
  int64_t row_bytes = 0;
};

inline int64_t row_width_bytes(const at::Tensor& t) {
  int64_t width = 1;
  for (int64_t d = 1; d < t.dim(); ++d) width *= t.size(d);
  return width * static_cast<int64_t>(t.element_size());
}

inline PackLayout pack_layout(at::TensorList tensors, const c10::List<std::optional<at::Tensor>>& row_index) {
  RW_CHECK(!tensors.empty(), "pack_rows needs at least one tensor");
  RW_CHECK(static_cast<int64_t>(row_index.size()) == static_cast<int64_t>(tensors.size()), "got ",
           tensors.size(), " tensors but ", row_index.size(), " row indices");
  PackLayout layout;
  const c10::Device device = tensors[0].device();
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    RW_CHECK(t.dim() >= 1, "tensor ", k, " must be [rows, ...], got a scalar");
    RW_CHECK(t.device() == device, "tensor ", k, " is on ", t.device(), ", tensor 0 on ", device);
    const std::optional<at::Tensor> idx = row_index.get(k);
    const int64_t rows = (idx.has_value() && idx->defined()) ? idx->numel() : t.size(0);
    if (k == 0) layout.num_rows = rows;
    RW_CHECK(rows == layout.num_rows, "pack_rows: tensors give ", rows, " and ", layout.num_rows, " rows");
    if (idx.has_value() && idx->defined()) {
      check_index_tensor(*idx, "row_index", rows, device);
      layout.index.push_back(idx->contiguous());
    } else {
      layout.index.emplace_back();
    }
    layout.sources.push_back(t.contiguous());
    layout.width.push_back(row_width_bytes(t));
    layout.offset.push_back(layout.row_bytes);
    layout.row_bytes += layout.width.back();
  }
  return layout;
}

// Returns the byte offset of each part in a packed row.
inline std::vector<int64_t> check_unpack_args(const at::Tensor& packed, at::IntArrayRef widths,
                                              const std::optional<at::Tensor>& row_index, int64_t num_rows) {
  RW_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2, "packed must be [n, row_bytes] uint8, got ",
           packed.scalar_type(), " ", packed.sizes());
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const int64_t w : widths) {
    RW_CHECK(w >= 0, "part widths must be >= 0, got ", widths);
    offsets.push_back(total);
    total += w;
  }
  RW_CHECK(total == packed.size(1), "unpack_rows: rows have ", packed.size(1), " bytes, specs need ", total);
  if (row_index.has_value() && row_index->defined()) {
    check_index_tensor(*row_index, "row_index", packed.size(0), packed.device());
    RW_CHECK(num_rows >= 0, "num_rows is required with row_index, got ", num_rows);
  }
  return offsets;
}

inline bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline void check_segment_sum_args(const at::Tensor& values, const at::Tensor& segment_ids, int64_t num_segments,
                                   at::ScalarType out_dtype) {
  RW_CHECK(values.dim() >= 1, "values must be [n, ...], got a scalar");
  RW_CHECK(is_float_dtype(values.scalar_type()), "values must be float32, float64, bfloat16 or float16, got ",
           values.scalar_type());
  RW_CHECK(is_float_dtype(out_dtype), "out_dtype must be float32, float64, bfloat16 or float16, got ", out_dtype);
  RW_CHECK(num_segments >= 0, "num_segments must be >= 0, got ", num_segments);
  RW_CHECK(num_segments < (int64_t{1} << 31) && values.size(0) < (int64_t{1} << 31),
           "segment_sum supports up to 2**31 rows and segments, got ", values.size(0), " rows and ", num_segments,
           " segments");
  check_index_tensor(segment_ids, "segment_ids", values.size(0), values.device());
}

}  // namespace railwave
