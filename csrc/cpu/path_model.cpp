// Host planning of the path selector: path_estimates, the estimated seconds of one layer on RAIL
// (the input's sending windows) and on JOINT (cyclic waves in rail chunks) from the gathered
// counts (meaning: megatron_railwave/path_model.py, path_estimates' numpy, the reference;
// tests/unit/test_arrival_copies_op.py checks the two agree).
//
// Letters: N nodes (s source, d destination), G GPUs per node (o owner, l arrival, j target),
// C rail chunks, P phases (RAIL: one per window; JOINT: (N - 1) waves x C chunks).
//
// Why compiled: the selector runs it on every MoE layer call, between the count exchange and the
// plan, on the critical path; in numpy it is ~300 small calls (0.4-0.5 ms at 4 x 8). Every sum is
// taken in numpy's order (numpy_sum, or one term after another where numpy reduces a non-last
// axis), so both give the same bits.
//
// Host only: the gathered CPU int64 counts in (as the count exchange leaves them, so the selector
// pays no conversions in Python), a CPU float64 tensor out.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "../common/ops.h"
#include "host_planning.h"

namespace railwave::cpu {
namespace {

// A path's rail phases and their delivery rounds, in seconds (path_model._Rounds).
struct Rounds {
  int64_t P = 0;
  std::vector<double> rail;      // [P] each rail phase's busiest rail port
  std::vector<double> into;      // [P, N, G] each round's seconds into each target GPU
  std::vector<double> out;       // [P, N, G] out of each arrival GPU
  std::vector<double> busiest;   // [P] each round's busiest GPU port
};

// _Rounds.of: rail seconds per phase and the round's copies [P, N, G_l, G_j] already in seconds.
Rounds rounds_of(std::vector<double> rail, const std::vector<double>& wire, int64_t P, int64_t N, int64_t G) {
  Rounds r;
  r.P = P;
  r.rail = std::move(rail);
  r.into.assign(static_cast<size_t>(P * N * G), 0.0);
  r.out.assign(static_cast<size_t>(P * N * G), 0.0);
  r.busiest.assign(static_cast<size_t>(P), 0.0);
  for (int64_t p = 0; p < P; ++p) {
    double most = 0.0;  // numpy's max(initial=0.0)
    for (int64_t d = 0; d < N; ++d) {
      const double* w = wire.data() + ((p * N + d) * G) * G;
      for (int64_t j = 0; j < G; ++j) {  // into: sum over l (a non-last axis: one after another)
        double sum = 0.0;
        for (int64_t l = 0; l < G; ++l) sum = l == 0 ? w[j] : sum + w[l * G + j];
        r.into[(p * N + d) * G + j] = sum;
        most = std::max(most, sum);
      }
      for (int64_t l = 0; l < G; ++l) {  // out: sum over j (the last axis)
        const double sum = numpy_sum(w + l * G, G);
        r.out[(p * N + d) * G + l] = sum;
        most = std::max(most, sum);
      }
    }
    r.busiest[p] = most;
  }
  return r;
}

// _dispatch_seconds: rail phase v + 1 after rail phase v, delivery round v after rail phase v and round v - 1.
double dispatch_seconds(const Rounds& r, double phase_s) {
  double rail_end = 0.0, delivery_end = 0.0;
  for (int64_t v = 0; v < r.P; ++v) {
    rail_end += phase_s + r.rail[v];
    delivery_end = std::max(rail_end, delivery_end) + r.busiest[v];
  }
  return delivery_end;
}

// _combine_seconds: the rounds back from the start, sharing every GPU's ports with combine's local
// round back (a round waits for `share` of the overlap), rail phase v after round v, the relay last.
double combine_seconds(const Rounds& r, const std::vector<double>& local_out, const std::vector<double>& local_in,
                       double phase_s, double relay_s, double share, int64_t NG) {
  // Combine runs dispatch backwards: port 0 is dispatch's in-port (the local round's targets), port 1 its out-port.
  std::vector<double> left[2] = {local_in, local_out};
  std::vector<double> slowed[2] = {std::vector<double>(NG), std::vector<double>(NG)};
  std::vector<double> ends[2] = {std::vector<double>(NG), std::vector<double>(NG)};
  double round_end = 0.0, rail_end = 0.0;
  for (int64_t v = 0; v < r.P; ++v) {
    bool running = false;
    for (const auto& part : left)
      for (double x : part) running = running || x != 0.0;
    if (running) {
      const double* ports[2] = {r.into.data() + v * NG, r.out.data() + v * NG};
      double end = round_end;
      for (int side = 0; side < 2; ++side) {
        double side_end = round_end;
        for (int64_t i = 0; i < NG; ++i) {
          slowed[side][i] = share * std::min(ports[side][i], left[side][i]);
          ends[side][i] = round_end + ports[side][i] + slowed[side][i];
          side_end = std::max(side_end, ends[side][i]);
        }
        end = side == 0 ? side_end : std::max(end, side_end);
      }
      for (int side = 0; side < 2; ++side)
        for (int64_t i = 0; i < NG; ++i)
          left[side][i] = std::max(left[side][i] - slowed[side][i] - (end - ends[side][i]), 0.0);
      round_end = end;
    } else {
      round_end += r.busiest[v];
    }
    rail_end = std::max(rail_end, round_end) + phase_s + r.rail[v];
  }
  double local_left = 0.0;
  for (const auto& part : left) {
    double most = 0.0;
    for (double x : part) most = std::max(most, x);
    local_left = std::max(local_left, most);
  }
  return std::max(rail_end + relay_s, round_end + local_left);
}

}  // namespace

at::Tensor path_estimates(const at::Tensor& records_WN, const at::Tensor& copies_WNKG, const at::Tensor& eligible_NNG,
                          const at::Tensor& window_NN, int64_t num_windows, int64_t chunks, double record_bytes,
                          double nvlink_bytes_per_s, double rail_bytes_per_s, double rail_phase_s, double layer_s,
                          double combine_share) {
  RW_CHECK(eligible_NNG.dim() == 3 && eligible_NNG.size(0) == eligible_NNG.size(1),
           "eligible_NNG must be [N, N, G], got ", eligible_NNG.sizes());
  const int64_t N = eligible_NNG.size(0), G = eligible_NNG.size(2), W = N * G, C = chunks, V = num_windows, NG = N * G;
  RW_CHECK(G >= 1 && G <= 8, "G must be in 1..8, got ", G);
  const int64_t K = int64_t{1} << std::min<int64_t>(2, G);  // traffic.mask_classes
  RW_CHECK(C >= 1, "chunks must be >= 1, got ", C);
  RW_CHECK(V >= 0, "num_windows must be >= 0, got ", V);
  check_host(records_WN, "records_WN", at::kLong, {W, N});
  check_host(copies_WNKG, "copies_WNKG", at::kLong, {W, N, K, G});
  check_host(eligible_NNG, "eligible_NNG", at::kBool, {N, N, G});
  check_host(window_NN, "window_NN", at::kLong, {N, N});
  // The gathered counts as the reference reads them: records_NGN [s, o, d] in float64 and each
  // rank's class copies for its own node summed over the classes, local_copies [w, j] (rank
  // w = s * G + o; the only copies read here; counts: exact as float64 in any order); the
  // arrival model reads the int64 class copies itself. records_NNG [s, d, o] for the relay.
  const int64_t* records_w = records_WN.data_ptr<int64_t>();
  const int64_t* copies_w = copies_WNKG.data_ptr<int64_t>();
  std::vector<double> records_f(static_cast<size_t>(W * N));
  std::vector<double> local_copies(static_cast<size_t>(W * G), 0.0);
  for (int64_t i = 0; i < W * N; ++i) records_f[i] = static_cast<double>(records_w[i]);
  for (int64_t w = 0; w < W; ++w) {
    const int64_t row = w * N + w / G;  // rank w's row for its own node
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < G; ++j) local_copies[w * G + j] += static_cast<double>(copies_w[(row * K + k) * G + j]);
  }
  at::Tensor records_NNG = at::empty({N, N, G}, records_WN.options());
  int64_t* rec_nng = records_NNG.data_ptr<int64_t>();
  for (int64_t s = 0; s < N; ++s)
    for (int64_t o = 0; o < G; ++o)
      for (int64_t d = 0; d < N; ++d) rec_nng[(s * N + d) * G + o] = records_w[(s * G + o) * N + d];
  const at::Tensor relay_NNGG = std::get<1>(rail_plan(records_NNG, eligible_NNG, /*balanced=*/true, /*phase=*/0));
  // The pair's healthy rails (o eligible for (s, d)) as float64 [s, o, d].
  const bool* allowed = eligible_NNG.data_ptr<bool>();
  std::vector<double> eligible_f(static_cast<size_t>(N * G * N));
  for (int64_t s = 0; s < N; ++s)
    for (int64_t o = 0; o < G; ++o)
      for (int64_t d = 0; d < N; ++d) eligible_f[(s * G + o) * N + d] = allowed[(s * N + d) * G + o] ? 1.0 : 0.0;
  const double* records = records_f.data();
  const double* eligible = eligible_f.data();
  const int64_t* window = window_NN.data_ptr<int64_t>();
  auto nvlink_s = [&](double copies_) { return copies_ * record_bytes / nvlink_bytes_per_s; };
  auto rail_s = [&](double records_) { return records_ * record_bytes / rail_bytes_per_s; };

  // _Loads.of: per-rail records of each pair, the relay's and the local round's ports.
  std::vector<double> remote(static_cast<size_t>(N * G * N)), per_rail(static_cast<size_t>(N * N));
  std::vector<double> relay_out(static_cast<size_t>(NG)), relay_in(static_cast<size_t>(NG));
  std::vector<double> excess(static_cast<size_t>(N)), deficit(static_cast<size_t>(N));
  for (int64_t s = 0; s < N; ++s)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < N; ++d) remote[(s * G + g) * N + d] = records[(s * G + g) * N + d] * (s == d ? 0.0 : 1.0);
  std::vector<double> pair(static_cast<size_t>(N * N)), healthy(static_cast<size_t>(N * N));
  for (int64_t s = 0; s < N; ++s) {
    for (int64_t d = 0; d < N; ++d) {  // sums over g, a non-last axis: one after another
      double sum = 0.0, rails = 0.0;
      for (int64_t g = 0; g < G; ++g) {
        sum = g == 0 ? remote[s * G * N + d] : sum + remote[(s * G + g) * N + d];
        rails = g == 0 ? eligible[s * G * N + d] : rails + eligible[(s * G + g) * N + d];
      }
      pair[s * N + d] = sum;
      healthy[s * N + d] = std::max(rails, 1.0);
      per_rail[s * N + d] = sum / healthy[s * N + d];
    }
  }
  for (int64_t s = 0; s < N; ++s) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t d = 0; d < N; ++d) {
        const double share = pair[s * N + d] * eligible[(s * G + g) * N + d] / healthy[s * N + d];
        excess[d] = std::max(remote[(s * G + g) * N + d] - share, 0.0);
        deficit[d] = std::max(share - remote[(s * G + g) * N + d], 0.0);
      }
      relay_out[s * G + g] = numpy_sum(excess.data(), N);
      relay_in[s * G + g] = numpy_sum(deficit.data(), N);
    }
  }
  std::vector<double> local_out(static_cast<size_t>(NG)), local_in(static_cast<size_t>(NG));
  std::vector<double> row(static_cast<size_t>(G));
  for (int64_t d = 0; d < N; ++d) {
    for (int64_t o = 0; o < G; ++o) {  // out of owner (d, o): over targets j, the last axis
      for (int64_t j = 0; j < G; ++j) row[j] = local_copies[(d * G + o) * G + j] * (o == j ? 0.0 : 1.0);
      local_out[d * G + o] = numpy_sum(row.data(), G);
    }
    for (int64_t j = 0; j < G; ++j) {  // into target (d, j): over owners o, a non-last axis
      double sum = 0.0;
      for (int64_t o = 0; o < G; ++o) {
        const double x = local_copies[(d * G + o) * G + j] * (o == j ? 0.0 : 1.0);
        sum = o == 0 ? x : sum + x;
      }
      local_in[d * G + j] = sum;
    }
  }
  std::vector<double> wire(static_cast<size_t>(N * N * C * G * G), 0.0);
  arrival_copies_into(records, copies_w, relay_NNGG.data_ptr<int64_t>(), N, G, C, wire.data());
  for (int64_t block = 0; block < N * N * C; ++block)  // a copy that arrives on its target stays there
    for (int64_t l = 0; l < G; ++l)
      for (int64_t j = 0; j < G; ++j) wire[(block * G + l) * G + j] *= l == j ? 0.0 : 1.0;

  double before_out = 0.0, before_in = 0.0, most_out = 0.0, most_in = 0.0;
  for (int64_t i = 0; i < NG; ++i) {
    before_out = std::max(before_out, relay_out[i] + local_out[i]);
    before_in = std::max(before_in, relay_in[i] + local_in[i]);
    most_out = std::max(most_out, relay_out[i]);
    most_in = std::max(most_in, relay_in[i]);
  }
  const double before_rail = nvlink_s(std::max(before_out, before_in));
  const double relay_s = nvlink_s(std::max(most_out, most_in));
  for (int64_t i = 0; i < NG; ++i) {
    local_out[i] = nvlink_s(local_out[i]);
    local_in[i] = nvlink_s(local_in[i]);
  }

  // RAIL: one round per sending window, whole (path_model._Loads.windows).
  std::vector<double> rail_P(static_cast<size_t>(V)), wire_P(static_cast<size_t>(V * N * G * G), 0.0);
  std::vector<double> sent(static_cast<size_t>(N * N)), wsum(static_cast<size_t>(N * N * G * G));
  for (int64_t sd = 0; sd < N * N; ++sd)  // over chunks, a non-last axis
    for (int64_t lj = 0; lj < G * G; ++lj) {
      double sum = 0.0;
      for (int64_t k = 0; k < C; ++k) sum = k == 0 ? wire[(sd * C) * G * G + lj] : sum + wire[(sd * C + k) * G * G + lj];
      wsum[sd * G * G + lj] = sum;
    }
  for (int64_t p = 0; p < V; ++p) {
    for (int64_t sd = 0; sd < N * N; ++sd) sent[sd] = (window[sd] == p ? 1.0 : 0.0) * per_rail[sd];
    double most = 0.0;
    for (int64_t s = 0; s < N; ++s) most = std::max(most, numpy_sum(sent.data() + s * N, N));  // sent by s
    for (int64_t d = 0; d < N; ++d) {  // received by d: over s, a non-last axis
      double sum = 0.0;
      for (int64_t s = 0; s < N; ++s) sum = s == 0 ? sent[d] : sum + sent[s * N + d];
      most = std::max(most, sum);
    }
    rail_P[p] = rail_s(most);
    for (int64_t d = 0; d < N; ++d)
      for (int64_t lj = 0; lj < G * G; ++lj) {
        double sum = 0.0;  // the einsum over s: one after another from zero
        for (int64_t s = 0; s < N; ++s) sum += (window[s * N + d] == p ? 1.0 : 0.0) * wsum[(s * N + d) * G * G + lj];
        wire_P[(p * N + d) * G * G + lj] = nvlink_s(sum);
      }
  }
  const Rounds rail_rounds = rounds_of(std::move(rail_P), wire_P, V, N, G);

  // JOINT: cyclic waves k = 1 .. N - 1 (node s to s + k mod N), each in C chunks (_Loads.cyclic).
  const int64_t P = (N - 1) * C;
  std::vector<double> joint_rail(static_cast<size_t>(P)), joint_wire(static_cast<size_t>(P * N * G * G));
  for (int64_t k = 1; k < N; ++k) {
    double most = 0.0;
    for (int64_t d = 0; d < N; ++d) most = std::max(most, per_rail[((d - k + N) % N) * N + d]);
    for (int64_t c = 0; c < C; ++c) {
      const int64_t p = (k - 1) * C + c;
      joint_rail[p] = rail_s(most / static_cast<double>(C));
      for (int64_t d = 0; d < N; ++d) {
        const double* w = wire.data() + ((((d - k + N) % N) * N + d) * C + c) * G * G;
        for (int64_t lj = 0; lj < G * G; ++lj) joint_wire[(p * N + d) * G * G + lj] = nvlink_s(w[lj]);
      }
    }
  }
  const Rounds joint_rounds = rounds_of(std::move(joint_rail), joint_wire, P, N, G);

  at::Tensor out = at::empty({2}, records_WN.options().dtype(at::kDouble));
  double* est = out.data_ptr<double>();
  const Rounds* paths[2] = {&rail_rounds, &joint_rounds};
  for (int i = 0; i < 2; ++i)
    est[i] = layer_s + before_rail + dispatch_seconds(*paths[i], rail_phase_s) +
             combine_seconds(*paths[i], local_out, local_in, rail_phase_s, relay_s, combine_share, NG);
  return out;
}

}  // namespace railwave::cpu
