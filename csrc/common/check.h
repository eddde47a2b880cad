// Host-side checks for the op launchers and CPU twins: every failure names file:line, the
// condition and the operand values, and reaches Python as ValueError (user input) or
// RuntimeError (CUDA errors).
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

// RW_CHECK(cond, "what", value, ...): raise ValueError "file:line: check `cond` failed: what value ...".
#define RW_CHECK(cond, ...)                                                                         \
  do {                                                                                            \
    if (C10_UNLIKELY(!(cond))) {                                                                  \
      TORCH_CHECK_VALUE(false, __FILE__, ":", __LINE__, ": check `", #cond, "` failed: ", __VA_ARGS__); \
    }                                                                                             \
  } while (0)

// RW_CHECK_CUDA(expr) for a cudaError_t: raise RuntimeError with the error's name and text.
#define RW_CHECK_CUDA(expr)                                                                          \
  do {                                                                                             \
    const cudaError_t rw_status_ = (expr);                                                         \
    TORCH_CHECK(rw_status_ == cudaSuccess, __FILE__, ":", __LINE__, ": ", #expr, " failed: ",      \
                cudaGetErrorName(rw_status_), " (", cudaGetErrorString(rw_status_), ")");          \
  } while (0)
