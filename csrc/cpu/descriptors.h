// The online selector's per-layer sums (csrc/cpu/descriptors.cpp); plain C++, no ATen: bound as a
// CPython function in bindings/module.cpp.
#pragma once

#include <cstdint>

namespace railwave::cpu {

// From records [W = N * G, N] int64 read at rec[w * row + d * col] (any strides), the rail of each
// local GPU rail[G] (0 <= rail < R) and the healthy ports healthy[N * R] (0 / 1), writes out[6]:
// remote records in all, the most remote records of one GPU, the most of one port (node, rail),
// the mean over healthy ports (0 without one), kappa (the largest (sum)^2 / sum of squares over
// source nodes of one (rail, destination node); 1 when nothing is remote or N = 1), records in all.
void layer_descriptors(const int64_t* rec, int64_t row, int64_t col, int64_t N, int64_t G, int64_t R,
                       const int64_t* rail, const int64_t* healthy, double out[6]);

}  // namespace railwave::cpu
