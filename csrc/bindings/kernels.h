// The compiled kernels of the railwave ops as one registration handle (bindings/ops.cpp), for the
// Python module (bindings/module.cpp), which compiles without torch headers.
#pragma once

#include <string>

namespace railwave {

// Registers the CPU kernels (and the CUDA kernels where built) of the railwave ops with torch's
// dispatcher and returns the handle that holds them; nullptr with `error` set where torch refused
// (e.g. a kernel whose signature does not match its schema).
void* register_kernels(std::string& error);

// Takes the kernels of `handle` out of the dispatcher again and frees it.
void release_kernels(void* handle);

}  // namespace railwave
