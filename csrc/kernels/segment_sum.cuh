// Device code of segment_sum (no torch headers): out[s] = cast(((0 + v[i0]) + v[i1]) + ...) over
// the rows i0 < i1 < ... of segment s, accumulated in float32 (float64 for float64 input) with
// __fadd_rn (never fused), cast once: bitwise equal to the CPU twin and from run to run.
//
// Steps, no host sync and no floating-point atomics: keys (out-of-range ids become the sentinel S),
// a stable radix sort of (segment, row), each segment's [start, end) in the sorted order, then one
// block per segment sums its rows in row order, each thread owning a few columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/float_bits.cuh"
#include "common.cuh"
#include "sort.cuh"

namespace railwave::kernels {

enum class FloatType : int { kF32 = 0, kF64 = 1, kBF16 = 2, kF16 = 3 };

struct SegmentSumArgs {
  const void* values;         // [n, W] of values_type
  const int64_t* segment_ids; // [n]
  int64_t num_rows;           // n
  int64_t num_segments;       // S
  int64_t width;              // W (elements)
  FloatType values_type;
  FloatType out_type;
  void* out;                  // [S, W] of out_type
};

__global__ void __launch_bounds__(kThreads) segment_keys_kernel(SegmentSumArgs a, uint32_t* keys, int32_t* rows) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < a.num_rows; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t id = a.segment_ids[i];
    keys[i] = static_cast<uint32_t>((id >= 0 && id < a.num_segments) ? id : a.num_segments);
    rows[i] = static_cast<int32_t>(i);
  }
}

// start/end of each segment in the sorted order (both 0 for empty segments: zeroed before).
__global__ void __launch_bounds__(kThreads) segment_bounds_kernel(const uint32_t* keys, int64_t num_rows,
                                                                    uint32_t num_segments, int32_t* start, int32_t* end) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < num_rows; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t key = keys[i];
    if (key >= num_segments) continue;
    if (i == 0 || keys[i - 1] != key) start[key] = static_cast<int32_t>(i);
    if (i == num_rows - 1 || keys[i + 1] != key) end[key] = static_cast<int32_t>(i + 1);
  }
}

template <class T, int V>
struct alignas(sizeof(T) * V) Pack {
  T x[V];
};

template <class In, class Out, int V>
__global__ void __launch_bounds__(kThreads) segment_reduce_kernel(const typename In::Storage* __restrict__ values,
                                                                    const int32_t* __restrict__ rows,
                                                                    const int32_t* __restrict__ start,
                                                                    const int32_t* __restrict__ end,
                                                                    typename Out::Storage* __restrict__ out,
                                                                    int64_t num_segments, int64_t width) {
  using Acc = typename AccumulatorOf<In>::type;
  using InPack = Pack<typename In::Storage, V>;
  using OutPack = Pack<typename Out::Storage, V>;
  for (int64_t s = blockIdx.x; s < num_segments; s += gridDim.x) {
    const int32_t first = start[s], last = end[s];
    for (int64_t c = int64_t{threadIdx.x} * V; c < width; c += int64_t{blockDim.x} * V) {
      Acc acc[V];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = Acc(0);
      for (int32_t j = first; j < last; ++j) {  // rows in index order: the fixed order
        const InPack x = *reinterpret_cast<const InPack*>(values + int64_t{rows[j]} * width + c);
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] = add_rn(acc[v], widen<In>(x.x[v]));
      }
      OutPack y;
#pragma unroll
      for (int v = 0; v < V; ++v) y.x[v] = narrow<Out>(acc[v]);
      *reinterpret_cast<OutPack*>(out + s * width + c) = y;
    }
  }
}

inline size_t element_bytes(FloatType t) {
  return t == FloatType::kF64 ? 8 : (t == FloatType::kF32 ? 4 : 2);
}

// Elements per access: 16 bytes of input when the width and both addresses allow it, else 1.
inline int segment_vector(const SegmentSumArgs& a) {
  const int v = static_cast<int>(16 / element_bytes(a.values_type));
  const bool aligned = a.width % v == 0 && reinterpret_cast<uintptr_t>(a.values) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(a.out) % (element_bytes(a.out_type) * v) == 0;
  return aligned ? v : 1;
}

template <class In, class Out, int V>
void launch_reduce(const SegmentSumArgs& a, const int32_t* rows, const int32_t* start, const int32_t* end,
                   cudaStream_t stream) {
  const unsigned grid = grid_for(a.num_segments, 1);
  segment_reduce_kernel<In, Out, V><<<grid, kThreads, 0, stream>>>(
      static_cast<const typename In::Storage*>(a.values), rows, start, end, static_cast<typename Out::Storage*>(a.out),
      a.num_segments, a.width);
}

template <class In, class Out>
void launch_reduce_vector(const SegmentSumArgs& a, const int32_t* rows, const int32_t* start, const int32_t* end,
                          cudaStream_t stream) {
  constexpr int kWide = static_cast<int>(16 / sizeof(typename In::Storage));
  if (segment_vector(a) == kWide) {
    launch_reduce<In, Out, kWide>(a, rows, start, end, stream);
  } else {
    launch_reduce<In, Out, 1>(a, rows, start, end, stream);
  }
}

template <class In>
void launch_reduce_out(const SegmentSumArgs& a, const int32_t* rows, const int32_t* start, const int32_t* end,
                       cudaStream_t stream) {
  switch (a.out_type) {
    case FloatType::kF32: return launch_reduce_vector<In, F32>(a, rows, start, end, stream);
    case FloatType::kF64: return launch_reduce_vector<In, F64>(a, rows, start, end, stream);
    case FloatType::kBF16: return launch_reduce_vector<In, BF16>(a, rows, start, end, stream);
    case FloatType::kF16: return launch_reduce_vector<In, F16>(a, rows, start, end, stream);
  }
}

inline size_t segment_sum_workspace(Workspace& ws, const SegmentSumArgs& a, uint32_t** keys_in, uint32_t** keys_out,
                                    int32_t** rows_in, int32_t** rows_out, int32_t** start, int32_t** end, void** temp,
                                    size_t* temp_bytes) {
  *keys_in = ws.take<uint32_t>(a.num_rows);
  *keys_out = ws.take<uint32_t>(a.num_rows);
  *rows_in = ws.take<int32_t>(a.num_rows);
  *rows_out = ws.take<int32_t>(a.num_rows);
  *start = ws.take<int32_t>(2 * a.num_segments);  // start and end side by side: one memset
  *end = *start ? *start + a.num_segments : nullptr;
  *temp_bytes = sort_pairs_temp_bytes(static_cast<int>(a.num_rows), key_bits(static_cast<uint32_t>(a.num_segments)));
  *temp = ws.take_bytes(*temp_bytes);
  return ws.bytes();
}

inline size_t segment_sum_workspace_bytes(const SegmentSumArgs& a) {
  Workspace ws(nullptr);
  uint32_t *ki, *ko;
  int32_t *ri, *ro, *st, *en;
  void* temp;
  size_t temp_bytes;
  return segment_sum_workspace(ws, a, &ki, &ko, &ri, &ro, &st, &en, &temp, &temp_bytes);
}

// The caller zero-fills `out` itself when num_rows == 0 (nothing is launched then).
inline cudaError_t launch_segment_sum(const SegmentSumArgs& a, void* workspace, cudaStream_t stream) {
  if (a.num_rows == 0 || a.num_segments == 0) return cudaSuccess;
  Workspace ws(workspace);
  uint32_t *keys_in, *keys_out;
  int32_t *rows_in, *rows_out, *start, *end;
  void* temp;
  size_t temp_bytes;
  segment_sum_workspace(ws, a, &keys_in, &keys_out, &rows_in, &rows_out, &start, &end, &temp, &temp_bytes);
  cudaError_t err = cudaMemsetAsync(start, 0, sizeof(int32_t) * 2 * a.num_segments, stream);
  if (err != cudaSuccess) return err;
  const unsigned grid = grid_for(a.num_rows, kThreads);
  segment_keys_kernel<<<grid, kThreads, 0, stream>>>(a, keys_in, rows_in);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = sort_pairs(temp, temp_bytes, keys_in, keys_out, rows_in, rows_out, static_cast<int>(a.num_rows),
                   key_bits(static_cast<uint32_t>(a.num_segments)), stream);
  if (err != cudaSuccess) return err;
  segment_bounds_kernel<<<grid, kThreads, 0, stream>>>(keys_out, a.num_rows, static_cast<uint32_t>(a.num_segments),
                                                        start, end);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  switch (a.values_type) {
    case FloatType::kF32: launch_reduce_out<F32>(a, rows_out, start, end, stream); break;
    case FloatType::kF64: launch_reduce_out<F64>(a, rows_out, start, end, stream); break;
    case FloatType::kBF16: launch_reduce_out<BF16>(a, rows_out, start, end, stream); break;
    case FloatType::kF16: launch_reduce_out<F16>(a, rows_out, start, end, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace railwave::kernels
