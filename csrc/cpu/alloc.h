// Output allocation of the CPU twins.
//
// Large outputs are fresh memory (the allocator mmaps them), and the first write faults every
// page in. On the VMs this project runs on a 4 KiB fault costs about 5 us (1.3 ms per MiB, more
// than the copy itself), so before the first touch such outputs are advised to use transparent
// huge pages (512x fewer faults). This is advice only: without THP nothing changes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace railwave::cpu {

inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// at::empty, with huge pages advised for outputs of 4 MiB or more.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor out = at::empty(sizes, options);
  if (out.nbytes() >= (size_t{4} << 20)) advise_huge_pages(out.data_ptr(), out.nbytes());
  return out;
}

}  // namespace railwave::cpu
