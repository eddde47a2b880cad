// flow_plan: the min-max relay plan of FLOW / FLOW_WAVES (meaning: planner.flow.flow_relay_reference,
// bit for bit; tests/unit/planner/test_flow.py). Integer loads, the same unit order, the same
// candidate keys (sum of the stages' peaks after, largest touched load after, added work, GPU index)
// and the same sweeps.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "../common/ops.h"
#include "host_planning.h"

namespace railwave::cpu {

namespace {

struct Unit {
  int64_t s, d, o, size, k, cell;
  const int64_t* copies;  // [G] this unit's copies per target (into the unit table)
};

}  // namespace

at::Tensor flow_plan(const at::Tensor& records_NNG, const at::Tensor& copies_NNGG, const at::Tensor& eligible_NNG,
                     const at::Tensor& wave_NN, const at::Tensor& rail_of_gpu_G, int64_t num_waves, int64_t num_rails,
                     int64_t nvlink_cost, int64_t nic_cost, int64_t units, int64_t sweeps) {
  RW_CHECK(records_NNG.dim() == 3 && records_NNG.size(0) == records_NNG.size(1), "records_NNG must be [N, N, G], got ",
           records_NNG.sizes());
  const int64_t N = records_NNG.size(0), G = records_NNG.size(2), R = num_rails, Q = std::max(G, num_rails);
  check_host(records_NNG, "records_NNG", at::kLong, {N, N, G});
  check_host(copies_NNGG, "copies_NNGG", at::kLong, {N, N, G, G});
  check_host(eligible_NNG, "eligible_NNG", at::kBool, {N, N, G});
  check_host(wave_NN, "wave_NN", at::kLong, {N, N});
  check_host(rail_of_gpu_G, "rail_of_gpu_G", at::kLong, {G});
  RW_CHECK(units >= 1 && sweeps >= 0 && num_waves >= 0, "units must be >= 1 and sweeps, num_waves >= 0");
  const int64_t* records = records_NNG.data_ptr<int64_t>();
  const int64_t* copies = copies_NNGG.data_ptr<int64_t>();
  const bool* eligible = eligible_NNG.data_ptr<bool>();
  const int64_t* wave = wave_NN.data_ptr<int64_t>();
  const int64_t* rail = rail_of_gpu_G.data_ptr<int64_t>();
  for (int64_t l = 0; l < G; ++l) RW_CHECK(rail[l] >= 0 && rail[l] < R, "rail_of_gpu[", l, "] outside [0, R)");
  for (int64_t x = 0; x < N * N; ++x) RW_CHECK(wave[x] < num_waves, "wave_NN holds a wave >= num_waves");

  // loads[((v * 6 + kind) * N + node) * Q + q]: kind 0/1 relay NVLink out/in (wave 0's slot: one
  // phase before every wave), 2/3 NIC up/down, 4/5 delivery NVLink out/in.
  constexpr int64_t K = 6;
  const int64_t V = std::max<int64_t>(num_waves, 1);
  std::vector<int64_t> loads(static_cast<size_t>(V * K * N * Q), 0);
  auto at_load = [&](int64_t v, int64_t kind, int64_t node, int64_t q) -> int64_t& {
    return loads[static_cast<size_t>(((v * K + kind) * N + node) * Q + q)];
  };
  for (int64_t s = 0; s < N; ++s) {  // the local node's delivery copies, in wave 0
    for (int64_t o = 0; o < G; ++o) {
      const int64_t* c = copies + ((s * N + s) * G + o) * G;
      for (int64_t j = 0; j < G; ++j) {
        if (j == o) continue;
        at_load(0, 4, s, o) += c[j] * nvlink_cost;
        at_load(0, 5, s, j) += c[j] * nvlink_cost;
      }
    }
  }

  // Units of the remote cells (s, d, o) ascending, k ascending; copies split as plan.chunk_sizes.
  std::vector<Unit> table;
  std::vector<int64_t> unit_copies;
  int64_t cell = 0;
  for (int64_t s = 0; s < N; ++s) {
    for (int64_t d = 0; d < N; ++d) {
      if (wave[s * N + d] < 0) continue;
      for (int64_t o = 0; o < G; ++o) {
        const int64_t rec = records[(s * N + d) * G + o];
        if (rec <= 0) continue;
        const int64_t* c = copies + ((s * N + d) * G + o) * G;
        for (int64_t k = 0; k < units; ++k) {
          const int64_t size = rec / units + (k < rec % units ? 1 : 0);
          if (size <= 0) continue;
          table.push_back(Unit{s, d, o, size, k, cell, nullptr});
          for (int64_t j = 0; j < G; ++j) unit_copies.push_back(c[j] / units + (k < c[j] % units ? 1 : 0));
        }
        ++cell;
      }
    }
  }
  for (size_t x = 0; x < table.size(); ++x) table[x].copies = unit_copies.data() + x * static_cast<size_t>(G);
  std::sort(table.begin(), table.end(), [](const Unit& a, const Unit& b) {
    if (a.size != b.size) return a.size > b.size;
    if (a.k != b.k) return a.k < b.k;
    return a.cell < b.cell;
  });

  // Peaks of each stage (relay: wave 0's slot only; rail and delivery per wave): one max segment
  // tree per (wave, stage) over its 2 x N x Q loads, so that a unit's add or removal updates a
  // peak in O(log(N Q)) (rescanning the loads after a removal at the peak made 32 x 8 cost
  // ~100 ms per plan).
  int64_t leaves = 1;
  while (leaves < 2 * N * Q) leaves *= 2;
  std::vector<int64_t> tree(static_cast<size_t>(V * 3 * 2 * leaves), 0);
  auto tree_of = [&](int64_t v, int64_t kind) -> int64_t* {
    return tree.data() + static_cast<size_t>((v * 3 + kind / 2) * 2 * leaves);
  };
  for (int64_t v = 0; v < V; ++v) {  // fill the leaves from the fixed loads, then the inner nodes
    for (int64_t k0 = 0; k0 < K; k0 += 2) {
      int64_t* t = tree_of(v, k0);
      const int64_t* base = &at_load(v, k0, 0, 0);
      for (int64_t x = 0; x < 2 * N * Q; ++x) t[leaves + x] = base[x];
      for (int64_t x = leaves - 1; x >= 1; --x) t[x] = std::max(t[2 * x], t[2 * x + 1]);
    }
  }
  auto touch = [&](int64_t v, int64_t kind, int64_t node, int64_t q, int64_t delta) {
    int64_t& load = at_load(v, kind, node, q);
    load += delta;
    int64_t* t = tree_of(v, kind);
    int64_t x = leaves + ((kind % 2) * N + node) * Q + q;
    t[x] = load;
    for (x /= 2; x >= 1; x /= 2) t[x] = std::max(t[2 * x], t[2 * x + 1]);
  };
  // Adds (sign +1) or removes (-1) a unit on the rail of GPU l.
  auto apply = [&](const Unit& u, int64_t l, int64_t sign) {
    const int64_t v = wave[u.s * N + u.d], r = rail[l];
    if (l != u.o) {
      touch(0, 0, u.s, u.o, sign * u.size * nvlink_cost);
      touch(0, 1, u.s, l, sign * u.size * nvlink_cost);
    }
    touch(v, 2, u.s, r, sign * u.size * nic_cost);
    touch(v, 3, u.d, r, sign * u.size * nic_cost);
    int64_t sent = 0;
    for (int64_t j = 0; j < G; ++j) {
      if (j == l) continue;
      sent += u.copies[j];
      if (u.copies[j]) touch(v, 5, u.d, j, sign * u.copies[j] * nvlink_cost);
    }
    if (sent) touch(v, 4, u.d, l, sign * sent * nvlink_cost);
  };
  // The current peak of kinds {k0, k0 + 1} of wave v.
  auto class_peak = [&](int64_t v, int64_t k0) -> int64_t { return tree_of(v, k0)[1]; };
  constexpr int64_t kNone = std::numeric_limits<int64_t>::min();
  // Key: (sum of the stages' peaks after, largest touched load after, added work, index).
  auto best_rail = [&](const Unit& u) -> int64_t {
    const int64_t v = wave[u.s * N + u.d];
    const int64_t relay_peak = class_peak(0, 0), rail_peak = class_peak(v, 2), deliver_peak = class_peak(v, 4);
    // The destination's delivery NVLink-in after the unit's copies: the two largest over targets with copies.
    int64_t top1 = kNone, top2 = kNone, top1_j = -1, total = 0;
    for (int64_t j = 0; j < G; ++j) {
      total += u.copies[j];
      if (u.copies[j] <= 0) continue;
      const int64_t after = at_load(v, 5, u.d, j) + u.copies[j] * nvlink_cost;
      if (after > top1) {
        top2 = top1;
        top1 = after;
        top1_j = j;
      } else if (after > top2) {
        top2 = after;
      }
    }
    const bool* ok = eligible + (u.s * N + u.d) * G;
    int64_t best = -1, best_sum = 0, best_touched = 0, best_work = 0;
    for (int64_t l = 0; l < G; ++l) {
      if (!ok[l]) continue;
      const int64_t r = rail[l], relay = u.size * nvlink_cost, wire = u.size * nic_cost;
      const int64_t nic_after = std::max(at_load(v, 2, u.s, r) + wire, at_load(v, 3, u.d, r) + wire);
      int64_t relay_after = kNone;
      int64_t work = 2 * wire;
      if (l != u.o) {
        relay_after = std::max(at_load(0, 0, u.s, u.o) + relay, at_load(0, 1, u.s, l) + relay);
        work += 2 * relay;
      }
      int64_t deliver_after = kNone;
      const int64_t sent = total - u.copies[l];
      if (sent > 0) {
        deliver_after = at_load(v, 4, u.d, l) + sent * nvlink_cost;
        work += 2 * sent * nvlink_cost;  // out of GPU (d, l) and into the targets
      }
      const int64_t in_after = top1_j == l ? top2 : top1;
      if (in_after != kNone) deliver_after = std::max(deliver_after, in_after);
      const int64_t touched = std::max({nic_after, relay_after, deliver_after});
      const int64_t sum = std::max(relay_peak, relay_after) + std::max(rail_peak, nic_after) +
                          std::max(deliver_peak, deliver_after);
      if (best < 0 || sum < best_sum || (sum == best_sum && touched < best_touched) ||
          (sum == best_sum && touched == best_touched && work < best_work)) {
        best = l;
        best_sum = sum;
        best_touched = touched;
        best_work = work;
      }
    }
    RW_CHECK(best >= 0, "node pair (", u.s, ", ", u.d, ") has no eligible rail");
    return best;
  };

  std::vector<int64_t> rail_X(table.size(), -1);
  for (int64_t sweep = 0; sweep <= sweeps; ++sweep) {
    for (size_t x = 0; x < table.size(); ++x) {
      if (sweep) apply(table[x], rail_X[x], -1);
      rail_X[x] = best_rail(table[x]);
      apply(table[x], rail_X[x], +1);
    }
  }

  at::Tensor relay_NNGG = at::zeros({N, N, G, G}, records_NNG.options());
  int64_t* relay = relay_NNGG.data_ptr<int64_t>();
  for (size_t x = 0; x < table.size(); ++x) {
    const Unit& u = table[x];
    relay[((u.s * N + u.d) * G + u.o) * G + rail_X[x]] += u.size;
  }
  for (int64_t s = 0; s < N; ++s) {  // the local pair: every owner keeps its records
    for (int64_t o = 0; o < G; ++o) relay[((s * N + s) * G + o) * G + o] = records[(s * N + s) * G + o];
  }
  return relay_NNGG;
}

}  // namespace railwave::cpu
