// CPU twins of records_from_routing, assign_egress and records_per_node_rail.
//
// Letters: T tokens, E experts, N nodes, G GPUs per node, M = 2**G masks, C = N * T capacity.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstring>
#include <vector>

#include "../common/ops.h"
#include "../common/validate.h"

namespace railwave::cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> records_from_routing(const at::Tensor& routing_map,
                                                                                int64_t num_nodes,
                                                                                int64_t gpus_per_node) {
  check_records_args(routing_map, num_nodes, gpus_per_node);
  const at::Tensor map_TE = routing_map.contiguous();
  const int64_t T = map_TE.size(0), E = map_TE.size(1), N = num_nodes, G = gpus_per_node;
  const int64_t M = int64_t{1} << G, C = N * T;
  const int64_t experts_per_node = E / N, experts_per_gpu = E / (N * G);
  const auto* map = reinterpret_cast<const uint8_t*>(map_TE.data_ptr<bool>());

  // Pass 1: the target mask of every (node, token) and the counts per key node * M + mask.
  // Routing rows are sparse (K of E set) and bool bytes are 0 or 1, so scan a row 8 bytes at a
  // time and visit only the set bytes; a table maps each expert to its node and GPU bit.
  std::vector<int32_t> node_of(static_cast<size_t>(E));
  std::vector<uint16_t> bit_of(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    node_of[e] = static_cast<int32_t>(e / experts_per_node);
    bit_of[e] = static_cast<uint16_t>(1u << ((e % experts_per_node) / experts_per_gpu));
  }
  at::Tensor counts_NM = at::zeros({N, M}, map_TE.options().dtype(at::kLong));
  int64_t* counts = counts_NM.data_ptr<int64_t>();
  std::vector<uint16_t> mask_NT(static_cast<size_t>(C), 0);
  std::vector<uint16_t> mask_N(static_cast<size_t>(N));
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* row = map + t * E;
    std::fill(mask_N.begin(), mask_N.end(), 0);
    int64_t e = 0;
    for (; e + 8 <= E; e += 8) {
      uint64_t word;
      std::memcpy(&word, row + e, sizeof(word));
      while (word != 0) {
        const int byte = __builtin_ctzll(word) >> 3;
        mask_N[node_of[e + byte]] |= bit_of[e + byte];
        word &= ~(uint64_t{0xFF} << (byte * 8));
      }
    }
    for (; e < E; ++e) {
      if (row[e]) mask_N[node_of[e]] |= bit_of[e];
    }
    for (int64_t n = 0; n < N; ++n) {
      mask_NT[n * T + t] = mask_N[n];
      counts[n * M + mask_N[n]] += 1;  // column 0 (no record) is cleared below
    }
  }
  for (int64_t n = 0; n < N; ++n) counts[n * M] = 0;

  // Start of each key in canonical order.
  std::vector<int64_t> next(static_cast<size_t>(N * M));
  int64_t total = 0;
  for (int64_t key = 0; key < N * M; ++key) {
    next[key] = total;
    total += counts[key];
  }

  // Pass 2: place every record; walking (node, token) in order keeps tokens ascending per key.
  const auto options = map_TE.options().dtype(at::kLong);
  at::Tensor token_C = at::empty({C}, options), node_C = at::empty({C}, options), mask_C = at::empty({C}, options);
  int64_t* token = token_C.data_ptr<int64_t>();
  int64_t* node = node_C.data_ptr<int64_t>();
  int64_t* mask = mask_C.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* masks = mask_NT.data() + n * T;
    for (int64_t t = 0; t < T; ++t) {
      if (!masks[t]) continue;
      const int64_t pos = next[n * M + masks[t]]++;
      token[pos] = t;
      node[pos] = n;
      mask[pos] = masks[t];
    }
  }
  for (int64_t pos = total; pos < C; ++pos) {
    token[pos] = -1;
    node[pos] = -1;
    mask[pos] = 0;
  }
  return {token_C, node_C, mask_C, counts_NM};
}

std::tuple<at::Tensor, at::Tensor> assign_egress(const at::Tensor& node_R, int64_t owner_gpu, const at::Tensor& counts_N,
                                                 const at::Tensor& keep_N, const at::Tensor& surplus_lo_N,
                                                 const at::Tensor& deficit_hi_NG, const at::Tensor& wave_N) {
  const int64_t G = check_assign_args(node_R, owner_gpu, counts_N, keep_N, surplus_lo_N, deficit_hi_NG, wave_N);
  const int64_t N = counts_N.numel(), n = node_R.numel();
  const at::Tensor node_c = node_R.contiguous(), counts_c = counts_N.contiguous(), keep_c = keep_N.contiguous(),
                   lo_c = surplus_lo_N.contiguous(), hi_c = deficit_hi_NG.contiguous(), wave_c = wave_N.contiguous();
  const int64_t* node = node_c.data_ptr<int64_t>();
  const int64_t* counts = counts_c.data_ptr<int64_t>();
  const int64_t* keep = keep_c.data_ptr<int64_t>();
  const int64_t* surplus_lo = lo_c.data_ptr<int64_t>();
  const int64_t* deficit_hi = hi_c.data_ptr<int64_t>();
  const int64_t* wave = wave_c.data_ptr<int64_t>();

  std::vector<int64_t> start(static_cast<size_t>(N));
  int64_t run = 0;
  for (int64_t d = 0; d < N; ++d) {
    start[d] = run;
    run += counts[d];
  }
  at::Tensor egress_R = at::empty({n}, node_c.options()), wave_R = at::empty({n}, node_c.options());
  int64_t* egress_out = egress_R.data_ptr<int64_t>();
  int64_t* wave_out = wave_R.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t d = node[r];
    if (d < 0) {  // past the last record (records_from_routing's padding)
      egress_out[r] = -1;
      wave_out[r] = -1;
      continue;
    }
    RW_CHECK(d < N, "node_R[", r, "] = ", d, " is not a node of ", N);
    const int64_t pos = r - start[d];
    int64_t egress = owner_gpu;
    if (pos >= keep[d]) {
      // Greedy fill: the proxy is the first GPU whose deficit interval ends after this position.
      const int64_t surplus_pos = std::max<int64_t>(surplus_lo[d] + pos - keep[d], 0);
      const int64_t* hi = deficit_hi + d * G;
      egress = 0;
      for (int64_t l = 0; l < G; ++l) egress += hi[l] <= surplus_pos;
    }
    egress_out[r] = egress;
    wave_out[r] = wave[d];
  }
  return {egress_R, wave_R};
}

at::Tensor records_per_node_rail(const at::Tensor& node_R, const at::Tensor& egress_R, const at::Tensor& rail_of_gpu_G,
                                 int64_t num_nodes, int64_t num_rails) {
  check_node_rail_args(node_R, egress_R, rail_of_gpu_G, num_nodes, num_rails);
  const at::Tensor node_c = node_R.contiguous(), egress_c = egress_R.contiguous(), rail_c = rail_of_gpu_G.contiguous();
  const int64_t* node = node_c.data_ptr<int64_t>();
  const int64_t* egress = egress_c.data_ptr<int64_t>();
  const int64_t* rail_of_gpu = rail_c.data_ptr<int64_t>();
  const int64_t n = node_c.numel(), G = rail_c.numel();
  at::Tensor out_NR = at::zeros({num_nodes, num_rails}, node_c.options());
  int64_t* out = out_NR.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t d = node[r];
    // Padding, and a record whose node, egress or rail is out of range, is left out: the CUDA kernel
    // cannot raise without a host sync, so both devices count only in-range records (the counts then
    // sum to fewer than the records, which is how a caller sees it; ops.records_per_node_rail).
    if (d < 0 || d >= num_nodes || egress[r] < 0 || egress[r] >= G) continue;
    const int64_t rail = rail_of_gpu[egress[r]];
    if (rail < 0 || rail >= num_rails) continue;
    ++out[d * num_rails + rail];
  }
  return out_NR;
}

}  // namespace railwave::cpu
