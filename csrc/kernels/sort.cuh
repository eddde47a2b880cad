// Stable sort of (key, value) pairs on the device: cub's LSD radix sort (stable, deterministic).
#pragma once

#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace railwave::kernels {

// Bits that hold every key in 0..max_key.
inline int key_bits(uint32_t max_key) {
  int bits = 1;
  while (bits < 32 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// With temp == nullptr only sets temp_bytes (a host computation: no launch, no sync).
inline cudaError_t sort_pairs(void* temp, size_t& temp_bytes, const uint32_t* keys_in, uint32_t* keys_out,
                              const int32_t* values_in, int32_t* values_out, int num_items, int end_bit,
                              cudaStream_t stream) {
  return cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, values_in, values_out, num_items, 0,
                                         end_bit, stream);
}

inline size_t sort_pairs_temp_bytes(int num_items, int end_bit) {
  size_t bytes = 0;
  sort_pairs(nullptr, bytes, nullptr, nullptr, nullptr, nullptr, num_items, end_bit, nullptr);
  return bytes;
}

}  // namespace railwave::kernels
