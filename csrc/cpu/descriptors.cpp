// Host planning of the online selector: layer_descriptors, the sums behind B, rho_g and kappa of
// one layer from the gathered counts (meaning: megatron_railwave/selector/online.py,
// fast_descriptors' numpy, the reference; tests/unit/test_online_selector.py checks the two agree).
//
// Letters: N nodes (s source, d destination), G GPUs per node (o), W = N * G ranks, R rails.
//
// Why compiled: the online selector computes these on every MoE layer call, on the critical path
// between the count exchange and the plan; numpy spends ~15 us of call overhead on a [32, 4] array,
// this loop well under 1 us (the op call itself costs a few).
//
// Same values as the reference: every sum is of int64 counts (exact), converted to float64 once;
// the only float operations are the reference's own (one division for the healthy mean, t * t / q
// per (rail, destination node) for kappa), so the results are bitwise the reference's.
//
// Host only: CPU int64 / bool tensors in (the records may be a strided view), a CPU float64 tensor out.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "../common/ops.h"
#include "host_planning.h"

namespace railwave::cpu {

at::Tensor layer_descriptors(const at::Tensor& records_WN, const at::Tensor& rail_of_gpu_G,
                             const at::Tensor& healthy_NR) {
  RW_CHECK(healthy_NR.dim() == 2, "healthy_NR must be [N, R], got ", healthy_NR.sizes());
  RW_CHECK(rail_of_gpu_G.dim() == 1, "rail_of_gpu_G must be [G], got ", rail_of_gpu_G.sizes());
  const int64_t N = healthy_NR.size(0), R = healthy_NR.size(1), G = rail_of_gpu_G.size(0), W = N * G;
  RW_CHECK(N >= 1 && G >= 1 && R >= 1, "N, G and R must be >= 1, got ", N, ", ", G, ", ", R);
  // records_WN may be a strided view (the count message's first N columns): read with its strides.
  RW_CHECK(records_WN.device().is_cpu(), "records_WN must be a CPU tensor (host planning), got ", records_WN.device());
  RW_CHECK(records_WN.scalar_type() == at::kLong, "records_WN must be int64, got ", records_WN.scalar_type());
  RW_CHECK(records_WN.dim() == 2 && records_WN.size(0) == W && records_WN.size(1) == N, "records_WN has shape ",
           records_WN.sizes(), ", expected [", W, ", ", N, "]");
  check_host(rail_of_gpu_G, "rail_of_gpu_G", at::kLong, {G});
  check_host(healthy_NR, "healthy_NR", at::kBool, {N, R});
  const int64_t* rec = records_WN.data_ptr<int64_t>();
  const int64_t row = records_WN.stride(0), col = records_WN.stride(1);
  const int64_t* rail = rail_of_gpu_G.data_ptr<int64_t>();
  const bool* healthy = healthy_NR.data_ptr<bool>();
  for (int64_t o = 0; o < G; ++o) RW_CHECK(rail[o] >= 0 && rail[o] < R, "rail_of_gpu_G[", o, "] = ", rail[o]);

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
  at::Tensor out = at::empty({6}, records_WN.options().dtype(at::kDouble));
  double* o = out.data_ptr<double>();
  o[0] = static_cast<double>(remote_total);
  o[1] = static_cast<double>(busiest);
  o[2] = static_cast<double>(egress_max);
  o[3] = healthy_ports > 0 ? static_cast<double>(healthy_sum) / static_cast<double>(healthy_ports) : 0.0;
  o[4] = kappa;
  o[5] = static_cast<double>(records_total);
  return out;
}

}  // namespace railwave::cpu
