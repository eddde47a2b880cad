// Shared glue of the CUDA launchers: the device guard, the current stream and a workspace tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/check.h"

namespace railwave::cuda {

inline void check_on_cuda(const at::Tensor& t, const char* name) {
  RW_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

inline cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Scratch memory from torch's caching allocator, on the tensor's device (freed when it goes out of
// scope, which is stream-ordered for the current stream).
inline at::Tensor workspace_like(const at::Tensor& t, size_t bytes) {
  return at::empty({static_cast<int64_t>(bytes)}, t.options().dtype(at::kByte));
}

}  // namespace railwave::cuda
