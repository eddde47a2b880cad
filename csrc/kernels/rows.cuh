// Device code of pack_rows / unpack_rows (no torch headers): one launch copies the rows of up to
// kMaxRowParts tensors, each with its own width, optional gather (pack) or scatter (unpack) index.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace railwave::kernels {

constexpr int kMaxRowParts = 8;
constexpr int kRowsPerBlock = kThreads / 32;  // one warp per row

struct RowPart {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_stride;     // bytes between source rows
  int64_t dst_stride;     // bytes between destination rows
  int64_t width;          // bytes copied per row
  const int64_t* src_row; // [num_rows] source row of row i (gather), or nullptr: row i
  const int64_t* dst_row; // [num_rows] destination row of row i (scatter), or nullptr: row i
  int vector_bytes;       // 16, 8, 4, 2 or 1: widest access every address and size allows
};

struct RowCopyArgs {
  RowPart parts[kMaxRowParts];
  int num_parts;
  int64_t num_rows;
};

// The widest access (<= 16 bytes) that divides every address, stride and width of a part.
inline int row_vector_bytes(const RowPart& p) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(p.src) | reinterpret_cast<uintptr_t>(p.dst) |
                        static_cast<uint64_t>(p.src_stride) | static_cast<uint64_t>(p.dst_stride) |
                        static_cast<uint64_t>(p.width);
  int v = 16;
  while (v > 1 && (bits & static_cast<uint64_t>(v - 1))) v >>= 1;
  return v;
}

template <class V>
__device__ __forceinline__ void copy_span(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, int64_t count,
                                          int lane) {
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  int64_t k = lane;
  // Four independent loads in flight per lane before the stores.
  for (; k + 96 < count; k += 128) {
    const V a = s[k], b = s[k + 32], c = s[k + 64], e = s[k + 96];
    d[k] = a;
    d[k + 32] = b;
    d[k + 64] = c;
    d[k + 96] = e;
  }
  for (; k < count; k += 32) d[k] = s[k];
}

__global__ void __launch_bounds__(kThreads) copy_rows_kernel(const __grid_constant__ RowCopyArgs args) {
  const int lane = threadIdx.x & 31;
  const int64_t first = (blockIdx.x * int64_t{blockDim.x} + threadIdx.x) >> 5;
  const int64_t step = (int64_t{gridDim.x} * blockDim.x) >> 5;
  for (int64_t i = first; i < args.num_rows; i += step) {
    for (int k = 0; k < args.num_parts; ++k) {
      const RowPart& p = args.parts[k];
      const int64_t src_row = p.src_row ? p.src_row[i] : i;
      const int64_t dst_row = p.dst_row ? p.dst_row[i] : i;
      const uint8_t* src = p.src + src_row * p.src_stride;
      uint8_t* dst = p.dst + dst_row * p.dst_stride;
      switch (p.vector_bytes) {
        case 16: copy_span<uint4>(dst, src, p.width / 16, lane); break;
        case 8: copy_span<uint2>(dst, src, p.width / 8, lane); break;
        case 4: copy_span<uint32_t>(dst, src, p.width / 4, lane); break;
        case 2: copy_span<uint16_t>(dst, src, p.width / 2, lane); break;
        default: copy_span<uint8_t>(dst, src, p.width, lane); break;
      }
    }
  }
}

// Copies every part; more than kMaxRowParts parts take several launches (disjoint columns).
inline cudaError_t launch_copy_rows(const RowPart* parts, int num_parts, int64_t num_rows, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  for (int first = 0; first < num_parts; first += kMaxRowParts) {
    RowCopyArgs args{};
    args.num_rows = num_rows;
    args.num_parts = 0;
    for (int k = first; k < num_parts && k < first + kMaxRowParts; ++k) {
      if (parts[k].width == 0) continue;
      args.parts[args.num_parts] = parts[k];
      args.parts[args.num_parts].vector_bytes = row_vector_bytes(parts[k]);
      ++args.num_parts;
    }
    if (args.num_parts == 0) continue;
    copy_rows_kernel<<<grid_for(num_rows, kRowsPerBlock), kThreads, 0, stream>>>(args);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace railwave::kernels
