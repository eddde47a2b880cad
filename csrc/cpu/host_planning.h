// Shared by the host-planning ops (csrc/cpu/schedule.cpp, flow.cpp): the host-tensor check.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../common/check.h"

namespace railwave::cpu {

inline void check_host(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  RW_CHECK(t.device().is_cpu(), name, " must be a CPU tensor (host planning), got ", t.device());
  RW_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  RW_CHECK(t.is_contiguous(), name, " must be contiguous");
  RW_CHECK(t.sizes().equals(shape), name, " has shape ", t.sizes(), ", expected ", shape);
}

}  // namespace railwave::cpu
