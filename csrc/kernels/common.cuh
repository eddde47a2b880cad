// Small helpers of the device code (no torch headers): launch sizes and workspace carving.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace railwave::kernels {

constexpr int kThreads = 256;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over `work` items, `per_block` items per block per step.
inline unsigned grid_for(int64_t work, int64_t per_block) {
  const int64_t blocks = ceil_div(work > 0 ? work : 1, per_block);
  return static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : (int64_t{1} << 20));
}

// Carves 256-byte aligned arrays out of one workspace. With base == nullptr it only adds up the
// bytes, so the same code sizes the workspace (host, before allocating) and splits it (launch).
class Workspace {
 public:
  explicit Workspace(void* base) : base_(static_cast<uint8_t*>(base)) {}
  template <class T>
  T* take(int64_t count) {
    offset_ = (offset_ + 255) / 256 * 256;
    T* p = base_ ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += static_cast<size_t>(count > 0 ? count : 0) * sizeof(T);
    return p;
  }
  void* take_bytes(size_t bytes) { return take<uint8_t>(static_cast<int64_t>(bytes)); }
  size_t bytes() const { return offset_; }

 private:
  uint8_t* base_;
  size_t offset_ = 0;
};

}  // namespace railwave::kernels
