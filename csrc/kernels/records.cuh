// Device code of records_from_routing, assign_egress and records_per_node_rail (no torch headers).
//
// Letters: T tokens, E experts, N nodes, G GPUs per node, M = 2**G masks, C = N * T capacity,
// n records. Canonical record order: destination node, then target mask, then token.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"
#include "sort.cuh"

namespace railwave::kernels {

struct RecordsArgs {
  const uint8_t* routing_map;  // [T, E] bool as bytes
  int64_t num_tokens;
  int64_t num_experts;
  int num_nodes;
  int gpus_per_node;
  int64_t* token_C;    // [C] out
  int64_t* node_C;     // [C] out
  int64_t* mask_C;     // [C] out
  int64_t* counts_NM;  // [N, M] out
};

// Keys node * M + mask in node-major order c = node * T + token ("no record": N * M, sorts last),
// values c, and the histogram of the keys.
__global__ void __launch_bounds__(kThreads) record_keys_kernel(RecordsArgs a, uint32_t* keys, int32_t* values) {
  const int64_t capacity = a.num_nodes * a.num_tokens;
  const int64_t per_node = a.num_experts / a.num_nodes, per_gpu = per_node / a.gpus_per_node;
  const uint32_t num_masks = 1u << a.gpus_per_node, no_record = static_cast<uint32_t>(a.num_nodes) * num_masks;
  for (int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; c < capacity; c += int64_t{gridDim.x} * blockDim.x) {
    const int64_t node = c / a.num_tokens, token = c - node * a.num_tokens;
    const uint8_t* experts = a.routing_map + token * a.num_experts + node * per_node;
    uint32_t mask = 0;
    for (int j = 0; j < a.gpus_per_node; ++j) {
      for (int64_t e = 0; e < per_gpu; ++e) {
        if (experts[j * per_gpu + e]) {
          mask |= 1u << j;
          break;
        }
      }
    }
    const uint32_t key = mask ? static_cast<uint32_t>(node) * num_masks + mask : no_record;
    keys[c] = key;
    values[c] = static_cast<int32_t>(c);
    if (mask) atomicAdd(reinterpret_cast<unsigned long long*>(a.counts_NM + key), 1ull);  // integer: exact
  }
}

__global__ void __launch_bounds__(kThreads) record_decode_kernel(RecordsArgs a, const uint32_t* keys,
                                                                   const int32_t* values) {
  const int64_t capacity = a.num_nodes * a.num_tokens;
  const uint32_t num_masks = 1u << a.gpus_per_node, no_record = static_cast<uint32_t>(a.num_nodes) * num_masks;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < capacity; i += int64_t{gridDim.x} * blockDim.x) {
    const uint32_t key = keys[i];
    if (key < no_record) {
      const int64_t c = values[i], node = c / a.num_tokens;
      a.token_C[i] = c - node * a.num_tokens;
      a.node_C[i] = node;
      a.mask_C[i] = key - static_cast<uint32_t>(node) * num_masks;
    } else {
      a.token_C[i] = -1;
      a.node_C[i] = -1;
      a.mask_C[i] = 0;
    }
  }
}

// The workspace: keys and values twice (sort in/out) and cub's temporary storage.
inline size_t records_workspace(Workspace& ws, int64_t capacity, int end_bit, uint32_t** keys_in, uint32_t** keys_out,
                                int32_t** values_in, int32_t** values_out, void** temp, size_t* temp_bytes) {
  *keys_in = ws.take<uint32_t>(capacity);
  *keys_out = ws.take<uint32_t>(capacity);
  *values_in = ws.take<int32_t>(capacity);
  *values_out = ws.take<int32_t>(capacity);
  *temp_bytes = sort_pairs_temp_bytes(static_cast<int>(capacity), end_bit);
  *temp = ws.take_bytes(*temp_bytes);
  return ws.bytes();
}

inline int records_end_bit(const RecordsArgs& a) {
  return key_bits(static_cast<uint32_t>(a.num_nodes) << a.gpus_per_node);
}

inline size_t records_workspace_bytes(const RecordsArgs& a) {
  Workspace ws(nullptr);
  uint32_t *ki, *ko;
  int32_t *vi, *vo;
  void* temp;
  size_t temp_bytes;
  return records_workspace(ws, a.num_nodes * a.num_tokens, records_end_bit(a), &ki, &ko, &vi, &vo, &temp, &temp_bytes);
}

// Three steps, no host sync: keys + histogram, stable radix sort, decode.
inline cudaError_t launch_records_from_routing(const RecordsArgs& a, void* workspace, cudaStream_t stream) {
  const int64_t capacity = a.num_nodes * a.num_tokens;
  cudaError_t err = cudaMemsetAsync(a.counts_NM, 0, sizeof(int64_t) * (size_t{1} << a.gpus_per_node) * a.num_nodes,
                                    stream);
  if (err != cudaSuccess || capacity == 0) return err;
  Workspace ws(workspace);
  uint32_t *keys_in, *keys_out;
  int32_t *values_in, *values_out;
  void* temp;
  size_t temp_bytes;
  const int end_bit = records_end_bit(a);
  records_workspace(ws, capacity, end_bit, &keys_in, &keys_out, &values_in, &values_out, &temp, &temp_bytes);
  const unsigned grid = grid_for(capacity, kThreads);
  record_keys_kernel<<<grid, kThreads, 0, stream>>>(a, keys_in, values_in);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  err = sort_pairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out, static_cast<int>(capacity), end_bit,
                   stream);
  if (err != cudaSuccess) return err;
  record_decode_kernel<<<grid, kThreads, 0, stream>>>(a, keys_out, values_out);
  return cudaGetLastError();
}

struct AssignArgs {
  const int64_t* node_R;  // [n], -1 past the last record
  int64_t num_records;
  int owner_gpu;
  int num_nodes;
  int gpus_per_node;
  const int64_t* counts_N;       // [N]
  const int64_t* keep_N;         // [N]
  const int64_t* surplus_lo_N;   // [N]
  const int64_t* deficit_hi_NG;  // [N, G]
  const int64_t* wave_N;         // [N]
  int64_t* egress_R;             // [n] out
  int64_t* wave_R;               // [n] out
};

constexpr int kMaxAssignNodes = 4096;  // start offsets live in shared memory (32 KiB)

__global__ void __launch_bounds__(kThreads) assign_egress_kernel(AssignArgs a) {
  __shared__ int64_t start_N[kMaxAssignNodes];
  if (threadIdx.x == 0) {  // N is small: one thread's prefix sum is cheaper than a block scan
    int64_t run = 0;
    for (int d = 0; d < a.num_nodes; ++d) {
      start_N[d] = run;
      run += a.counts_N[d];
    }
  }
  __syncthreads();
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < a.num_records; r += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = a.node_R[r];
    if (d < 0 || d >= a.num_nodes) {  // padding (out-of-range nodes are not checked on the device)
      a.egress_R[r] = -1;
      a.wave_R[r] = -1;
      continue;
    }
    const int64_t pos = r - start_N[d], keep = a.keep_N[d];
    int64_t egress = a.owner_gpu;
    if (pos >= keep) {
      const int64_t surplus_pos = max(a.surplus_lo_N[d] + pos - keep, int64_t{0});
      const int64_t* hi = a.deficit_hi_NG + d * a.gpus_per_node;
      egress = 0;
      for (int l = 0; l < a.gpus_per_node; ++l) egress += hi[l] <= surplus_pos;
    }
    a.egress_R[r] = egress;
    a.wave_R[r] = a.wave_N[d];
  }
}

inline cudaError_t launch_assign_egress(const AssignArgs& a, cudaStream_t stream) {
  if (a.num_records == 0) return cudaSuccess;
  assign_egress_kernel<<<grid_for(a.num_records, kThreads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

struct NodeRailArgs {
  const int64_t* node_R;       // [n], -1 past the last record
  const int64_t* egress_R;     // [n]
  const int64_t* rail_of_gpu;  // [G]
  int64_t num_records;
  int num_nodes;
  int num_rails;
  int gpus_per_node;
  int64_t* out_NR;  // [N, R] out
};

__global__ void __launch_bounds__(kThreads) records_per_node_rail_kernel(NodeRailArgs a) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < a.num_records; r += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = a.node_R[r], egress = a.egress_R[r];
    if (d < 0 || d >= a.num_nodes || egress < 0 || egress >= a.gpus_per_node) continue;  // padding
    const int64_t rail = a.rail_of_gpu[egress];
    if (rail < 0 || rail >= a.num_rails) continue;
    atomicAdd(reinterpret_cast<unsigned long long*>(a.out_NR + d * a.num_rails + rail), 1ull);  // integer: exact
  }
}

inline cudaError_t launch_records_per_node_rail(const NodeRailArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.out_NR, 0, sizeof(int64_t) * a.num_nodes * a.num_rails, stream);
  if (err != cudaSuccess || a.num_records == 0) return err;
  records_per_node_rail_kernel<<<grid_for(a.num_records, kThreads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace railwave::kernels
