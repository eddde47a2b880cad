// Host planning of the path model: arrival_copies, the expected (record, target GPU) copies per
// node pair, rail chunk, arrival GPU and target GPU (meaning: megatron_railwave/arrivals.py, the
// numpy reference; tests/unit/test_arrival_copies_op.py checks the two agree).
//
// Letters: N nodes (s source, d destination), G GPUs per node (o owner, l arrival, j target),
// K mask classes (k), L = G - log2(K) low target bits, C rail chunks.
//
// Why compiled: the reference works on [N, N, G, G, G] arrays in ~100 numpy calls, milliseconds
// per layer, most of it call overhead. The selector pays it on every MoE layer call, on the
// critical path. Here it is loops over the same N * N * G lists, each walked at its few interior
// positions, class 0's bit probabilities solved only where a walk needs them, compiled once per G
// (1-8, so the loops over GPUs and bits unroll), an owner that keeps its whole list not walked.
//
// Same bits as the reference: every float operation is its, in its order (numpy's pairwise sum
// where it sums along a last axis, numpy_sum; one term after another where it sums another axis).
// Part bounds and chunk cuts are record counts, integers far below 2^53, so the order in which
// they are added up does not matter.
//
// Host only: CPU float64 / int64 tensors in, a CPU float64 tensor out.

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "../common/ops.h"
#include "host_planning.h"

namespace railwave::cpu {
namespace {

constexpr int kMaxGpus = 8;
constexpr int kMaxClasses = 4;     // traffic.mask_classes: 2**min(2, G)
constexpr int kNewtonSteps = 12;   // arrivals._NEWTON_STEPS
constexpr double kMinSome = 1e-3;  // arrivals._MIN_SOME
constexpr double kTiny = 1e-300;   // arrivals._TINY

using Row = std::array<double, kMaxGpus>;

// traffic.mask_classes: classes of target masks by their top min(2, G) bits.
constexpr int mask_class_bits(int G) { return std::min(2, G); }
constexpr int mask_classes(int G) { return 1 << mask_class_bits(G); }

// One owner's list split into its mask classes (arrivals._Lists): each class's records, where it
// starts, the copies before it, and (once a walk needs them) class 0's low-bit probabilities.
struct OwnerList {
  std::array<Row, kMaxClasses> class_copies{};
  std::array<double, kMaxClasses> class_records{};
  std::array<double, kMaxClasses + 1> starts{};
  std::array<Row, kMaxClasses + 1> before{};
  Row q0{};  // class 0's bit probabilities (_bit_probabilities); the other classes' are bare frequencies
  double some0 = 1.0;
  bool solved = false;
};

// _Lists.of for one list: classes >= 1 hold a top bit on every record (their records are its
// copies), class 0 the rest. Counts only: every sum here is exact in any order.
template <int G, typename Count, int K = mask_classes(G), int low = G - mask_class_bits(G)>
void split_classes(OwnerList& list, double records, const Count* class_copies) {
  double top_sum = 0.0;
  std::array<double, kMaxClasses>& class_records = list.class_records;
  class_records = {};
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < G; ++j) list.class_copies[k][j] = static_cast<double>(class_copies[k * G + j]);
  for (int k = 1; k < K; ++k) {
    double most = list.class_copies[k][low];
    for (int j = low + 1; j < G; ++j) most = std::max(most, list.class_copies[k][j]);
    class_records[k] = most;
    top_sum += most;
  }
  class_records[0] = std::max(records - top_sum, 0.0);
  list.starts = {};
  list.before = {};
  for (int k = 0; k < K; ++k) {
    list.starts[k + 1] = list.starts[k] + class_records[k];
    for (int j = 0; j < G; ++j) list.before[k + 1][j] = list.before[k][j] + list.class_copies[k][j];
  }
  list.solved = false;
}

// arrivals._target_probabilities of one class's low targets.
template <int low>
Row target_probabilities(double records, const Row& copies) {
  Row p{};
  for (int j = 0; j < low; ++j) {
    const double raw = records > 0.0 ? copies[j] / std::max(records, 1.0) : 0.0;
    p[j] = std::min(std::max(raw, 0.0), 1.0);
  }
  return p;
}

// arrivals._bit_probabilities for class 0 of one list (Newton from s = 1 on s = 1 - prod(1 - p_j s)).
template <int low>
void solve_class0(OwnerList& list) {
  const Row p = target_probabilities<low>(list.class_records[0], list.class_copies[0]);
  double some = 1.0;
  for (int step = 0; step < kNewtonSteps; ++step) {
    Row free{};
    double none = 1.0;
    for (int j = 0; j < low; ++j) {
      free[j] = std::max(1.0 - p[j] * some, 0.0);
      none *= free[j];
    }
    Row ratio{};
    for (int j = 0; j < low; ++j) ratio[j] = p[j] / std::max(free[j], kTiny);
    const double slope = none * numpy_sum(ratio.data(), low) - 1.0;
    const double next = std::min(std::max(some - (1.0 - none - some) / std::min(slope, -kTiny), kMinSome), 1.0);
    if (next == some) break;  // a fixed point: the remaining steps would return it unchanged
    some = next;
  }
  for (int j = 0; j < low; ++j) list.q0[j] = std::min(p[j] * some, 1.0);
  list.some0 = some;
  list.solved = true;
}

// arrivals._walk at one position x strictly inside a class of `records` records: expected copies
// per low target among its first x records (bits walked from the highest; masks without bit b
// sort first).
template <int low>
Row walk(double records, const Row& q, double some, double x) {
  const double mass = records / some;  // the empty mask counts too: it sorts first
  double left = x + (mass - records), subtree = mass, taken_so_far = 0.0;
  Row below{}, taken{}, on_path{};
  for (int b = low - 1; b >= 0; --b) {
    const double without = subtree * (1.0 - q[b]);
    const bool take = left >= without;
    below[b] = taken_so_far;
    taken[b] = take ? without : 0.0;
    on_path[b] = take ? 1.0 : 0.0;
    taken_so_far = taken_so_far + taken[b];
    left = left - taken[b];
    subtree = take ? subtree - without : without;
  }
  const double leaf = std::min(std::max(left, 0.0), subtree);
  Row out{};
  for (int j = 0; j < low; ++j) {
    const double above = taken_so_far - below[j] - taken[j];
    out[j] = q[j] * below[j] + on_path[j] * (above + leaf);
  }
  return out;
}

// _Lists.copies_at at one position: all the list's copies at its end; else the copies of the
// classes before the one x falls in (the last starting at or before x) plus, strictly inside
// it, the walk of its low bits and its top bits on every record.
template <int G, int K = mask_classes(G), int low = G - mask_class_bits(G)>
Row copies_at(OwnerList& list, double x) {
  if (x >= list.starts[K]) return list.before[K];
  int k = 0;
  for (int c = 1; c < K; ++c) k += list.starts[c] <= x;
  const double inside = x - list.starts[k];
  Row out = list.before[k];
  if (!(inside > 0.0)) return out;
  Row part{};
  const double records = list.class_records[k];
  if constexpr (low > 0) {
    if (k == 0) {
      if (!list.solved) solve_class0<low>(list);
      part = walk<low>(records, list.q0, list.some0, inside);
    } else {
      part = walk<low>(records, target_probabilities<low>(records, list.class_copies[k]), 1.0, inside);
    }
  }
  for (int j = low; j < G; ++j) part[j] = inside * (list.class_copies[k][j] > 0.0 ? 1.0 : 0.0);
  for (int j = 0; j < G; ++j) out[j] = out[j] + part[j];
  return out;
}

// arrival_copies_into for one G (a compile-time constant: the loops over GPUs and bits unroll) and
// one type of class copies (float64, or the count exchange's int64: exact as float64).
template <int g, typename Count>
void arrival_copies_for(const double* records, const Count* class_copies, const int64_t* relay, int64_t N, int64_t C,
                        double* out) {
  constexpr int64_t G = g;
  constexpr int K = mask_classes(g);

  std::array<OwnerList, kMaxGpus> lists;
  std::array<Row, kMaxGpus> keep_end{}, moved{}, moved_end{};  // [o][l]
  std::array<std::array<Row, kMaxGpus>, kMaxGpus> at_bounds{}, seg{};  // [o][i or l][j]
  std::array<double, kMaxGpus> keep{};
  std::vector<int> cut_owner(static_cast<size_t>(G * C));          // [l, k]: the owner chunk k's end falls in
  std::vector<double> cut_position(static_cast<size_t>(G * C));  // [l, k]: its position in that owner's list
  for (int64_t s = 0; s < N; ++s) {
    for (int64_t d = 0; d < N; ++d) {
      if (s == d) continue;  // local pairs use no rail
      const int64_t* pair_relay = relay + (s * N + d) * G * G;
      // Each owner's list: kept part first, then its moved parts to arrival GPU 0, 1, ... in turn.
      for (int o = 0; o < g; ++o) {
        OwnerList& list = lists[o];
        split_classes<g, Count>(list, records[(s * G + o) * N + d], class_copies + ((s * G + o) * N + d) * K * G);
        keep[o] = static_cast<double>(pair_relay[o * G + o]);
        double run = keep[o];
        for (int l = 0; l < g; ++l) {
          moved[o][l] = l == o ? 0.0 : static_cast<double>(pair_relay[o * G + l]);
          run += moved[o][l];
          moved_end[o][l] = run;
        }
        // Where each part starts: bounds[0] = keep, bounds[l + 1] = where the part for l ends.
        keep_end[o][0] = keep[o];
        for (int l = 1; l < g; ++l) keep_end[o][l] = moved_end[o][l - 1];
      }
      // Chunk cuts inside each arrival block (owners ascending): the owner each cut falls in and
      // the cut's position in that owner's list (arrivals.arrival_copies_NNCGG).
      if (C > 1) {
        for (int l = 0; l < g; ++l) {
          Row block_end{};
          double run = 0.0;
          for (int o = 0; o < g; ++o) {
            run += static_cast<double>(pair_relay[o * G + l]);
            block_end[o] = run;
          }
          const int64_t total = static_cast<int64_t>(block_end[g - 1]);
          int64_t cut = 0;
          for (int64_t k = 0; k + 1 < C; ++k) {
            cut += total / C + (k < total % C ? 1 : 0);
            const double at = static_cast<double>(cut);
            int owner = 0;
            for (int o = 0; o < g; ++o) owner += block_end[o] <= at;
            owner = std::min(owner, g - 1);
            const double block_start = block_end[owner] - static_cast<double>(pair_relay[owner * G + l]);
            const double seg_start = owner == l ? 0.0 : moved_end[owner][l] - moved[owner][l];
            cut_owner[l * C + k] = owner;
            cut_position[l * C + k] = seg_start + at - block_start;
          }
        }
      }
      // Copies at each part's start; a part's copies are the difference to the next part's start.
      for (int o = 0; o < g; ++o) {
        const Row& owner_copies = lists[o].before[K];
        bool whole = true;  // every part starts at the list's end and its copies are finite
        for (int i = 0; i < g; ++i) whole = whole && keep_end[o][i] >= lists[o].starts[K];
        for (int j = 0; j < g; ++j) whole = whole && std::isfinite(owner_copies[j]);
        if (whole) {
          // It keeps its whole list (most owners: RailBalance moves only a pair's excess): every
          // part but the kept one is empty (the general case's x - x, +0.0) and starts at the end.
          at_bounds[o].fill(owner_copies);
          seg[o].fill(Row{});
          seg[o][o] = owner_copies;
          continue;
        }
        for (int i = 0; i < g; ++i) {
          const bool repeated = i > 0 && keep_end[o][i] == keep_end[o][i - 1];
          at_bounds[o][i] = repeated ? at_bounds[o][i - 1] : copies_at<g>(lists[o], keep_end[o][i]);
        }
        for (int l = 0; l + 1 < g; ++l)
          for (int j = 0; j < g; ++j) seg[o][l][j] = at_bounds[o][l + 1][j] - at_bounds[o][l][j];
        for (int j = 0; j < g; ++j) seg[o][g - 1][j] = owner_copies[j] - at_bounds[o][g - 1][j];
        seg[o][o] = at_bounds[o][0];  // the kept part: its first `keep` records
      }
      double* pair_out = out + (s * N + d) * C * G * G;
      for (int l = 0; l < g; ++l) {
        // Sums over owners in ascending order (numpy's order over a non-last axis); j innermost, so
        // the targets' sums run side by side.
        Row total = seg[0][l];
        for (int o = 1; o < g; ++o)
          for (int j = 0; j < g; ++j) total[j] += seg[o][l][j];
        Row previous{};  // copies of the block before chunk k's start
        for (int64_t k = 0; k < C; ++k) {
          Row upto{};
          if (k + 1 == C) {
            upto = total;
          } else {
            const int owner = cut_owner[l * C + k];
            const Row at_cut = copies_at<g>(lists[owner], cut_position[l * C + k]);
            Row before{};  // the block's owners before the cut's, in ascending order
            for (int o = 0; o < owner; ++o)
              for (int j = 0; j < g; ++j) before[j] += seg[o][l][j];
            for (int j = 0; j < g; ++j) {
              const double at_start = owner == l ? 0.0 : at_bounds[owner][l][j];
              upto[j] = before[j] + at_cut[j] - at_start;
            }
          }
          for (int j = 0; j < g; ++j) pair_out[(k * G + l) * G + j] = upto[j] - previous[j];
          previous = upto;
        }
      }
    }
  }
}

template <typename Count>
void arrival_copies_any(const double* records, const Count* class_copies, const int64_t* relay, int64_t N, int64_t G,
                        int64_t C, double* out) {
  switch (G) {
    case 1: return arrival_copies_for<1>(records, class_copies, relay, N, C, out);
    case 2: return arrival_copies_for<2>(records, class_copies, relay, N, C, out);
    case 3: return arrival_copies_for<3>(records, class_copies, relay, N, C, out);
    case 4: return arrival_copies_for<4>(records, class_copies, relay, N, C, out);
    case 5: return arrival_copies_for<5>(records, class_copies, relay, N, C, out);
    case 6: return arrival_copies_for<6>(records, class_copies, relay, N, C, out);
    case 7: return arrival_copies_for<7>(records, class_copies, relay, N, C, out);
    case 8: return arrival_copies_for<8>(records, class_copies, relay, N, C, out);
    default: RW_CHECK(false, "G must be in 1..", kMaxGpus, ", got ", G);
  }
}

}  // namespace

void arrival_copies_into(const double* records, const double* class_copies, const int64_t* relay, int64_t N,
                         int64_t G, int64_t C, double* out) {
  arrival_copies_any(records, class_copies, relay, N, G, C, out);
}

void arrival_copies_into(const double* records, const int64_t* class_copies, const int64_t* relay, int64_t N,
                         int64_t G, int64_t C, double* out) {
  arrival_copies_any(records, class_copies, relay, N, G, C, out);
}

at::Tensor arrival_copies(const at::Tensor& records_NGN, const at::Tensor& class_copies_NGNKG,
                          const at::Tensor& relay_NNGG, int64_t chunks) {
  RW_CHECK(records_NGN.dim() == 3, "records_NGN must be [N, G, N], got ", records_NGN.sizes());
  const int64_t N = records_NGN.size(0), G = records_NGN.size(1), C = chunks;
  RW_CHECK(G >= 1 && G <= kMaxGpus, "G must be in 1..", kMaxGpus, ", got ", G);
  RW_CHECK(C >= 1, "chunks must be >= 1, got ", C);
  check_host(records_NGN, "records_NGN", at::kDouble, {N, G, N});
  check_host(class_copies_NGNKG, "class_copies_NGNKG", at::kDouble, {N, G, N, mask_classes(static_cast<int>(G)), G});
  check_host(relay_NNGG, "relay_NNGG", at::kLong, {N, N, G, G});
  at::Tensor out = at::zeros({N, N, C, G, G}, records_NGN.options());
  arrival_copies_into(records_NGN.data_ptr<double>(), class_copies_NGNKG.data_ptr<double>(),
                      relay_NNGG.data_ptr<int64_t>(), N, G, C, out.data_ptr<double>());
  return out;
}

}  // namespace railwave::cpu
