// Host planning of the online selector: layer_descriptors, the sums behind B, rho_g and kappa of
// one layer from the gathered counts (meaning: megatron_railwave/selector/online.py,
// fast_descriptors' numpy, the reference; tests/unit/test_online_selector.py checks the two agree).
//
// Letters: N nodes (s source, d destination), G GPUs per node (o), W = N * G ranks, R rails.
//
// Why compiled: the online selector computes these on every MoE layer call, on the critical path
// between the count exchange and the plan; numpy spends ~15 us of call overhead on a [32, 4] array,
// this loop well under 1 us. It is bound as a plain CPython function (bindings/module.cpp), not a
// torch op: a torch op's dispatch and output tensor cost 3-8 us per call, more than the work.
//
// Same values as the reference: every sum is of int64 counts (exact), converted to float64 once;
// the only float operations are the reference's own (one division for the healthy mean, t * t / q
// per (rail, destination node) for kappa), so the results are bitwise the reference's.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "descriptors.h"

namespace railwave::cpu {

void layer_descriptors(const int64_t* rec, int64_t row, int64_t col, int64_t N, int64_t G, int64_t R,
                       const int64_t* rail, const int64_t* healthy, double out[6]) {
  const int64_t W = N * G;
  // load[(s * R + r) * N + d]: remote records node s sends on rail r to node d (GPUs sharing a rail add up).
  std::vector<int64_t> load(static_cast<size_t>(N * R * N), 0);
  int64_t records_total = 0, remote_total = 0, busiest = 0;
  for (int64_t w = 0; w < W; ++w) {
    const int64_t s = w / G, r = rail[w % G];
    int64_t remote = 0;
    for (int64_t d = 0; d < N; ++d) {
      const int64_t x = rec[w * row + d * col];
      records_total += x;
      if (d != s) {
        remote += x;
        load[(s * R + r) * N + d] += x;
      }
    }
    remote_total += remote;
    busiest = std::max(busiest, remote);
  }
  int64_t egress_max = 0, healthy_sum = 0, healthy_ports = 0;
  for (int64_t port = 0; port < N * R; ++port) {
    int64_t egress = 0;
    for (int64_t d = 0; d < N; ++d) egress += load[port * N + d];
    egress_max = std::max(egress_max, egress);
    if (healthy[port]) {
      healthy_sum += egress;
      ++healthy_ports;
    }
  }
  double kappa = 1.0;  // the reference's fill where a (rail, node) receives nothing
  if (N > 1 && remote_total > 0) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t d = 0; d < N; ++d) {
        int64_t t = 0, q = 0;
        for (int64_t s = 0; s < N; ++s) {
          const int64_t x = load[(s * R + r) * N + d];
          t += x;
          q += x * x;
        }
        if (q > 0) {
          const double td = static_cast<double>(t);
          kappa = std::max(kappa, td * td / static_cast<double>(q));
        }
      }
    }
  }
  out[0] = static_cast<double>(remote_total);
  out[1] = static_cast<double>(busiest);
  out[2] = static_cast<double>(egress_max);
  out[3] = healthy_ports > 0 ? static_cast<double>(healthy_sum) / static_cast<double>(healthy_ports) : 0.0;
  out[4] = kappa;
  out[5] = static_cast<double>(records_total);
}

}  // namespace railwave::cpu
