// Shared by the host-planning ops (csrc/cpu/schedule.cpp, arrivals.cpp, path_model.cpp): the
// host-tensor check, numpy's summation order and the arrival model's kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../common/check.h"

namespace railwave::cpu {

// numpy's sum of n doubles a[0], a[stride], ... (its pairwise summation, the order np.sum takes
// along a contiguous last axis): so a compiled twin of numpy code rounds as numpy does.
inline double numpy_sum(const double* a, int64_t n, int64_t stride = 1) {
  if (n < 8) {
    double res = 0.0;
    for (int64_t i = 0; i < n; ++i) res += a[i * stride];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int k = 0; k < 8; ++k) r[k] = a[k * stride];
    int64_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int k = 0; k < 8; ++k) r[k] += a[(i + k) * stride];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i * stride];
    return res;
  }
  int64_t half = n / 2;
  half -= half % 8;
  return numpy_sum(a, half, stride) + numpy_sum(a + half * stride, n - half, stride);
}

inline void check_host(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  RW_CHECK(t.device().is_cpu(), name, " must be a CPU tensor (host planning), got ", t.device());
  RW_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  RW_CHECK(t.is_contiguous(), name, " must be contiguous");
  RW_CHECK(t.sizes().equals(shape), name, " has shape ", t.sizes(), ", expected ", shape);
}

// The arrival model (arrivals.cpp): adds into out [N, N, C, G, G], which must hold zeros, the
// expected copies from node s arriving on GPU (d, l) in chunk k for GPU (d, j). records [N, G, N],
// class copies [N, G, N, K, G] (per mask class, traffic.mask_classes), relay [N, N, G, G]
// (RailBalance's, o == l: the kept part). The class copies as float64 (arrival_copies' input,
// fractional counts allowed) or as the count exchange's int64 (path_estimates: no conversion pass).
void arrival_copies_into(const double* records, const double* class_copies, const int64_t* relay, int64_t N, int64_t G,
                         int64_t C, double* out);
void arrival_copies_into(const double* records, const int64_t* class_copies, const int64_t* relay, int64_t N,
                         int64_t G, int64_t C, double* out);

}  // namespace railwave::cpu
