// Host planning of every layer: rank_schedule (one rank's part of compiling a PathPlan) and
// rail_plan (RailBalance's quotas and relay counts).
//
// Letters: N nodes (s source, d destination), G GPUs per node (o owner, l egress / arrival,
// j target), W = N * G ranks, M = 2**G target masks, V waves, P phases, X transfers.
//
// Meaning (the Python pipeline this replaces on the exchange's path, bit for bit; tests/unit/
// test_rank_schedule_op.py checks it): schedule.compile_schedule (the transfer table, with the
// deliveries of the rank's node only, cut to the rank's transfers: ExecutionSchedule.only_ranks),
// schedule.rank_view (its counts) and the host counts of
// exchange.layout.build_layout. That pipeline is ~400 small numpy calls per layer; here it is a
// few loops over N * N * G * G integers, so the per-layer planning cost is the Python glue.
//
// Host only: CPU int64 tensors in and out, no device data.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <vector>

#include "../common/ops.h"
#include "host_planning.h"

namespace railwave::cpu {
namespace {

struct Transfer {
  int64_t phase, src, dst, rows;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> rank_schedule(
    const at::Tensor& records_NNG, const at::Tensor& quota_NNG, const at::Tensor& relay_NNGG,
    const at::Tensor& wave_NN, const at::Tensor& masks_WM, int64_t rank, int64_t chunks, int64_t num_phases,
    at::IntArrayRef relay_phase_U, at::IntArrayRef rail_phase_V, at::IntArrayRef deliver_phase_R) {
  RW_CHECK(records_NNG.dim() == 3, "records_NNG must be [N, N, G], got ", records_NNG.sizes());
  const int64_t N = records_NNG.size(0), G = records_NNG.size(2), W = N * G;
  RW_CHECK(G >= 1 && G <= 8, "G must be in 1..8, got ", G);
  const int64_t M = int64_t{1} << G, V = static_cast<int64_t>(rail_phase_V.size());
  check_host(records_NNG, "records_NNG", at::kLong, {N, N, G});
  check_host(quota_NNG, "quota_NNG", at::kLong, {N, N, G});
  check_host(relay_NNGG, "relay_NNGG", at::kLong, {N, N, G, G});
  check_host(wave_NN, "wave_NN", at::kLong, {N, N});
  check_host(masks_WM, "masks_WM", at::kLong, {W, M});
  RW_CHECK(rank >= 0 && rank < W, "rank ", rank, " is not in 0..", W - 1);
  RW_CHECK(chunks >= 1 && V % chunks == 0, "chunks=", chunks, " must be >= 1 and divide the ", V, " rail phases");
  const int64_t C = chunks, waves = V / C, U = static_cast<int64_t>(relay_phase_U.size());
  RW_CHECK(U == 1 || (U == V && V > 1), "relay_phase_U has ", U, " entries, expected 1 or the ", V,
           " rail phases (a streamed relay)");
  RW_CHECK(static_cast<int64_t>(deliver_phase_R.size()) == V + 1, "deliver_phase_R has ", deliver_phase_R.size(),
           " entries, expected V + 1 = ", V + 1);
  const int64_t* records = records_NNG.data_ptr<int64_t>();
  const int64_t* quota = quota_NNG.data_ptr<int64_t>();
  const int64_t* relay = relay_NNGG.data_ptr<int64_t>();
  const int64_t* wave = wave_NN.data_ptr<int64_t>();
  const int64_t* masks = masks_WM.data_ptr<int64_t>();
  const int64_t s = rank / G, me = rank % G;
  auto rel = [&](int64_t a, int64_t b, int64_t o, int64_t l) { return relay[((a * N + b) * G + o) * G + l]; };
  auto remote = [&](int64_t a, int64_t b) { return wave[a * N + b] >= 0; };
  for (int64_t a = 0; a < N; ++a) {
    for (int64_t b = 0; b < N; ++b) {
      const int64_t w = wave[a * N + b];
      RW_CHECK(w < waves && (w >= 0) == (a != b), "wave_NN[", a, ", ", b, "] = ", w, " is not a wave of ", waves,
               " (or -1 on the diagonal only)");
    }
  }

  // ---- the transfer table (compile_schedule): relay, rail, then this node's deliveries, of the
  // transfers from or to this rank only (ExecutionSchedule.transfer_ranks: the global table is
  // ~N^2 G transfers and the rank's view reads its own).
  std::vector<Transfer> table;
  auto mine = [&](int64_t src, int64_t dst) { return src == rank || dst == rank; };
  // Room for the unstreamed table at most (a streamed relay may grow it).
  table.reserve(static_cast<size_t>(2 * G + 2 * N * C + 2 * (V + 1) * G));
  auto chunk_rows = [C](int64_t total, int64_t k) { return total / C + (k < total % C ? 1 : 0); };
  if (U == 1) {
    // Stage 1: owner (a, o) -> proxy (a, l), remote pairs summed; the destination nodes run
    // outermost, so that each pair's [G, G] block is read in memory order.
    std::vector<int64_t> rows_OL(static_cast<size_t>(G * G));
    {  // this rank's node only
      const int64_t a = s;
      std::fill(rows_OL.begin(), rows_OL.end(), 0);
      for (int64_t b = 0; b < N; ++b) {
        if (!remote(a, b)) continue;
        const int64_t* block = relay + (a * N + b) * G * G;
        for (int64_t x = 0; x < G * G; ++x) rows_OL[x] += block[x];
      }
      for (int64_t o = 0; o < G; ++o) {
        for (int64_t l = 0; l < G; ++l) {
          const int64_t rows = rows_OL[o * G + l];
          if (o != l && rows && mine(a * G + o, a * G + l)) {
            table.push_back({relay_phase_U[0], a * G + o, a * G + l, rows});
          }
        }
      }
    }
  } else {
    // Streamed (planner.relay_chunk_rows_NNGGC): relay part u carries owner o's share of the rail
    // chunks of phase u on GPU l, the overlap of its interval of the egress rows (owners in GPU
    // order) with the chunk's. Pushed per (a, o, l), phases ascending; the stable sort by phase
    // below gives compile_schedule's (phase, a, o, l) order.
    std::vector<int64_t> rows_U(static_cast<size_t>(V));
    {  // this rank's node only
      const int64_t a = s;
      for (int64_t o = 0; o < G; ++o) {
        for (int64_t l = 0; l < G; ++l) {
          if (o == l || !mine(a * G + o, a * G + l)) continue;
          std::fill(rows_U.begin(), rows_U.end(), 0);
          for (int64_t b = 0; b < N; ++b) {
            if (!remote(a, b)) continue;
            int64_t lo = 0, quota_l = 0;
            for (int64_t p = 0; p < G; ++p) {
              lo += p < o ? rel(a, b, p, l) : 0;
              quota_l += rel(a, b, p, l);
            }
            const int64_t hi = lo + rel(a, b, o, l);
            for (int64_t k = 0, k_lo = 0; k < C && hi > lo; ++k) {
              const int64_t k_hi = k_lo + chunk_rows(quota_l, k);
              rows_U[wave[a * N + b] * C + k] += std::max<int64_t>(std::min(hi, k_hi) - std::max(lo, k_lo), 0);
              k_lo = k_hi;
            }
          }
          for (int64_t u = 0; u < V; ++u) {
            if (rows_U[u]) table.push_back({relay_phase_U[u], a * G + o, a * G + l, rows_U[u]});
          }
        }
      }
    }
  }
  // Stage 2: GPU (a, l) -> GPU (b, l), chunk k of the pair's wave w in rail phase w * C + k.
  for (int64_t a = 0; a < N; ++a) {
    for (int64_t b = 0; b < N; ++b) {
      if (!remote(a, b) || (a != s && b != s)) continue;
      {  // this rank's rail only
        const int64_t l = me;
        const int64_t q = quota[(a * N + b) * G + l];
        for (int64_t k = 0; k < C && q; ++k) {
          const int64_t rows = chunk_rows(q, k);
          if (rows) table.push_back({rail_phase_V[wave[a * N + b] * C + k], a * G + l, b * G + l, rows});
        }
      }
    }
  }
  // Records of owner (a, o) into node s that arrive at GPU (s, l), by mask ([G * M], owner-major):
  // owner o's mask-sorted list is cut in GPU order: GPU l's part (l = o: the kept records) follows
  // those of GPUs < l.
  auto arrival_cells = [&](int64_t a, int64_t l, int64_t* out) {
    for (int64_t o = 0; o < G; ++o) {
      const int64_t* hist = masks + (a * G + o) * M;
      int64_t lo_x = 0;
      for (int64_t p = 0; p < l; ++p) lo_x += rel(a, s, o, p);
      const int64_t hi_x = lo_x + rel(a, s, o, l);
      int64_t c_lo = 0;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t c_hi = c_lo + hist[m];
        out[o * M + m] = std::max<int64_t>(std::min(hi_x, c_hi) - std::max(lo_x, c_lo), 0);
        c_lo = c_hi;
      }
    }
  };
  // Those cells cut into the C chunks (chunk k = the k-th contiguous part of the block in cell
  // order, chunk_rows long): one walk over the cells, fn(k, x, rows) for every nonempty piece.
  auto for_each_chunk_piece = [&](const int64_t* cells, auto&& fn) {
    int64_t total = 0;
    for (int64_t x = 0; x < G * M; ++x) total += cells[x];
    int64_t k = 0, k_end = chunk_rows(total, 0), pos = 0;
    for (int64_t x = 0; x < G * M; ++x) {
      for (int64_t left = cells[x]; left > 0;) {
        while (pos >= k_end) k_end += chunk_rows(total, ++k);  // chunks of 0 rows (total < C) are skipped
        const int64_t take = std::min(left, k_end - pos);
        fn(k, x, take);
        pos += take;
        left -= take;
      }
    }
  };
  // Stage 3 into node s. Owner o's list of records into s is sorted by mask and cut in GPU order
  // (GPU o's part: the kept records). F(x)[j] = copies for target j among the
  // first x records: with P[m][j] the copies of the runs before mask m, F(x) = P[m*] + (x - lo(m*))
  // * bit(m*, j) for the run m* holding x. The ends of the proxies' parts ascend, so one sweep.
  std::vector<int64_t> copies_NGG(static_cast<size_t>(N * G * G), 0);  // [a, arrival l, target j]
  std::vector<int64_t> f_prev(static_cast<size_t>(G)), f_cur(static_cast<size_t>(G)), run_P(static_cast<size_t>(G));
  for (int64_t a = 0; a < N; ++a) {
    if (C > 1 && a != s) continue;  // chunked remote blocks are cut from their arrival cells below
    for (int64_t o = 0; o < G; ++o) {
      const int64_t* hist = masks + (a * G + o) * M;
      int64_t m = 0, lo = 0;  // current run and its start
      std::fill(run_P.begin(), run_P.end(), 0);
      auto value_at = [&](int64_t x, std::vector<int64_t>& out) {
        while (m < M && lo + hist[m] <= x) {
          if (hist[m]) {  // most masks have no records (a record has one to a few targets)
            for (int64_t j = 0; j < G; ++j) run_P[j] += ((m >> j) & 1) ? hist[m] : 0;
            lo += hist[m];
          }
          ++m;
        }
        for (int64_t j = 0; j < G; ++j) out[j] = run_P[j] + (m < M && ((m >> j) & 1) ? x - lo : 0);
      };
      std::fill(f_prev.begin(), f_prev.end(), 0);  // F(0)
      int64_t end = 0;
      for (int64_t l = 0; l < G; ++l) {
        const int64_t moved = rel(a, s, o, l);
        if (!moved) continue;
        end += moved;
        value_at(end, f_cur);
        for (int64_t j = 0; j < G; ++j) copies_NGG[(a * G + l) * G + j] += f_cur[j] - f_prev[j];
        std::swap(f_prev, f_cur);
      }
    }
  }
  std::vector<int64_t> round_N(static_cast<size_t>(N));  // round of each source's first chunk
  for (int64_t a = 0; a < N; ++a) round_N[a] = a == s ? 0 : wave[a * N + s] * C + 1;
  std::vector<int64_t> per_round(static_cast<size_t>((V + 1) * G * G), 0);
  std::vector<int64_t> cells(static_cast<size_t>(G * M));
  for (int64_t a = 0; a < N; ++a) {
    if (C == 1 || a == s) {
      for (int64_t k = 0; k < G * G; ++k) per_round[round_N[a] * G * G + k] += copies_NGG[a * G * G + k];
      continue;
    }
    for (int64_t l = 0; l < G; ++l) {  // chunk k of the block arriving at GPU l: its copies per target
      arrival_cells(a, l, cells.data());
      for_each_chunk_piece(cells.data(), [&](int64_t k, int64_t x, int64_t rows) {
        int64_t* row = per_round.data() + ((round_N[a] + k) * G + l) * G;
        const int64_t m = x % M;
        for (int64_t j = 0; j < G; ++j) row[j] += ((m >> j) & 1) ? rows : 0;
      });
    }
  }
  for (int64_t r = 0; r <= V; ++r) {
    for (int64_t l = 0; l < G; ++l) {
      for (int64_t j = 0; j < G; ++j) {
        const int64_t rows = per_round[(r * G + l) * G + j];
        if (rows && mine(s * G + l, s * G + j)) table.push_back({deliver_phase_R[r], s * G + l, s * G + j, rows});
      }
    }
  }
  // Stable order by phase: a counting sort over the P phases, written straight into the output.
  const int64_t X = static_cast<int64_t>(table.size());
  std::vector<int64_t> phase_start(static_cast<size_t>(num_phases + 1), 0);
  for (const Transfer& x : table) {
    RW_CHECK(x.phase >= 0 && x.phase < num_phases, "transfer phase ", x.phase, " out of range");
    ++phase_start[x.phase + 1];
  }
  for (int64_t p = 0; p < num_phases; ++p) phase_start[p + 1] += phase_start[p];
  at::Tensor table_4X = at::empty({4, X}, records_NNG.options());
  int64_t* t = table_4X.data_ptr<int64_t>();
  for (const Transfer& x : table) {
    const int64_t at = phase_start[x.phase]++;
    t[at] = x.phase;
    t[X + at] = x.src;
    t[2 * X + at] = x.dst;
    t[3 * X + at] = x.rows;
  }

  // ---- the rank view: rows to / from each peer per phase (peer = node on rails, GPU on NVLink).
  std::vector<bool> is_rail(static_cast<size_t>(num_phases), false);
  for (int64_t v = 0; v < V; ++v) {
    RW_CHECK(rail_phase_V[v] >= 0 && rail_phase_V[v] < num_phases, "rail phase ", rail_phase_V[v], " out of range");
    is_rail[rail_phase_V[v]] = true;
  }
  std::vector<bool> is_deliver(static_cast<size_t>(num_phases), false);
  for (int64_t r = 0; r <= V; ++r) {
    RW_CHECK(deliver_phase_R[r] >= 0 && deliver_phase_R[r] < num_phases, "deliver phase ", deliver_phase_R[r],
             " out of range");
    is_deliver[deliver_phase_R[r]] = true;
  }
  for (int64_t u = 0; u < U; ++u) {
    RW_CHECK(relay_phase_U[u] >= 0 && relay_phase_U[u] < num_phases, "relay phase ", relay_phase_U[u], " out of range");
  }
  const int64_t width = std::max(N, G);
  at::Tensor send_PQ = at::zeros({num_phases, width}, records_NNG.options());
  at::Tensor recv_PQ = at::zeros({num_phases, width}, records_NNG.options());
  int64_t* send = send_PQ.data_ptr<int64_t>();
  int64_t* recv = recv_PQ.data_ptr<int64_t>();
  int64_t num_copies = 0;
  for (const Transfer& x : table) {
    const bool rail = is_rail[x.phase];
    if (x.src == rank) send[x.phase * width + (rail ? x.dst / G : x.dst % G)] += x.rows;
    if (x.dst == rank) {
      recv[x.phase * width + (rail ? x.src / G : x.src % G)] += x.rows;
      if (is_deliver[x.phase]) num_copies += x.rows;
    }
  }

  // view: categories [G + 1], kept_N [N], relay_in_NG [N * G], egress_N [N], source_round_N [N],
  // arrival_NGM [N * G * M] (records of owner (a, o) arriving at this GPU, by mask), num_copies [1].
  at::Tensor view = at::zeros({G + 1 + N + N * G + N + N + N * G * M + 1}, records_NNG.options());
  int64_t* v = view.data_ptr<int64_t>();
  int64_t* categories = v;
  int64_t* kept_N = categories + G + 1;
  int64_t* relay_in_NG = kept_N + N;
  int64_t* egress_N = relay_in_NG + N * G;
  int64_t* source_round_N = egress_N + N;
  int64_t* arrival_NGM = source_round_N + N;
  for (int64_t b = 0; b < N; ++b) {
    if (!remote(s, b)) continue;
    for (int64_t l = 0; l < G; ++l) categories[l] += rel(s, b, me, l);
    kept_N[b] = rel(s, b, me, me);
    for (int64_t o = 0; o < G; ++o) relay_in_NG[b * G + o] = o == me ? 0 : rel(s, b, o, me);
    egress_N[b] = quota[(s * N + b) * G + me];
  }
  categories[G] = records[(s * N + s) * G + me];
  for (int64_t a = 0; a < N; ++a) source_round_N[a] = round_N[a];
  for (int64_t a = 0; a < N; ++a) arrival_cells(a, me, arrival_NGM + a * G * M);
  v[view.numel() - 1] = num_copies;

  // ---- layout host counts (exchange.layout.build_layout's HostCounts, same order): counts_N,
  // keep_N, surplus_lo_N, deficit_hi_NG, wave_N, pool_key [G, N], pool_count [G, N], then the
  // arrival counts of rounds 1..V (sources of the round ascending, owner, mask; a source's chunk
  // of the round: the cut of its block).
  int64_t arrive_total = 0;
  for (int64_t a = 0; a < N; ++a) arrive_total += round_N[a] >= 1 ? G * M * C : 0;
  at::Tensor layout = at::zeros({N + N + N + N * G + N + 2 * G * N + arrive_total}, records_NNG.options());
  int64_t* counts_N = layout.data_ptr<int64_t>();
  int64_t* keep_N = counts_N + N;
  int64_t* surplus_lo_N = keep_N + N;
  int64_t* deficit_hi_NG = surplus_lo_N + N;
  int64_t* wave_N = deficit_hi_NG + N * G;
  int64_t* pool_key = wave_N + N;
  int64_t* pool_count = pool_key + G * N;
  int64_t* arrive = pool_count + G * N;
  for (int64_t b = 0; b < N; ++b) {
    counts_N[b] = records[(s * N + b) * G + me];
    // This owner's list (any relay plan, not only the greedy fill) is cut in GPU order: no kept
    // prefix, the line starts at 0 and GPU l's part (l = me: the kept records) ends at the running
    // sum of rel(me, l') over l' <= l (planner.routes.owner_egress_bounds).
    keep_N[b] = 0;
    surplus_lo_N[b] = 0;
    int64_t handed = 0;
    for (int64_t l = 0; l < G; ++l) {
      handed += rel(s, b, me, l);
      deficit_hi_NG[b * G + l] = handed;
    }
    wave_N[b] = wave[s * N + b];
  }
  for (int64_t blk = 0; blk < G; ++blk) {  // owners: this GPU (its kept records), then the others
    const int64_t owner = blk == 0 ? me : (blk - 1 < me ? blk - 1 : blk);
    for (int64_t b = 0; b < N; ++b) {
      pool_key[blk * N + b] = b * G + owner;
      pool_count[blk * N + b] = blk == 0 ? kept_N[b] : relay_in_NG[b * G + owner];
    }
  }
  // Where each (source, chunk) block goes (rounds ascending, then sources), then one walk per
  // source fills its C blocks (the buffer is zeroed).
  std::vector<int64_t*> block_NC(static_cast<size_t>(N * C), nullptr);
  for (int64_t r = 1; r <= V; ++r) {
    const int64_t first = (r - 1) / C * C + 1, k = r - first;
    for (int64_t a = 0; a < N; ++a) {
      if (round_N[a] != first) continue;
      block_NC[a * C + k] = arrive;
      arrive += G * M;
    }
  }
  for (int64_t a = 0; a < N; ++a) {
    if (round_N[a] < 1) continue;
    for_each_chunk_piece(arrival_NGM + a * G * M,
                         [&](int64_t k, int64_t x, int64_t rows) { block_NC[a * C + k][x] += rows; });
  }
  return {table_4X, send_PQ, recv_PQ, view, layout};
}

}  // namespace railwave::cpu

namespace railwave::cpu {

// RailBalance's quotas and relay counts (meaning: planner.railbalance.rail_quota_NNG and
// relay_NNGG, bit for bit; tests/unit/planner/test_rail_plan_op.py).
std::tuple<at::Tensor, at::Tensor> rail_plan(const at::Tensor& records_NNG, const at::Tensor& eligible_NNG,
                                             bool balanced, int64_t phase) {
  RW_CHECK(records_NNG.dim() == 3 && records_NNG.size(0) == records_NNG.size(1), "records_NNG must be [N, N, G], got ",
           records_NNG.sizes());
  const int64_t N = records_NNG.size(0), G = records_NNG.size(2);
  check_host(records_NNG, "records_NNG", at::kLong, {N, N, G});
  check_host(eligible_NNG, "eligible_NNG", at::kBool, {N, N, G});
  const int64_t* records = records_NNG.data_ptr<int64_t>();
  const bool* allowed = eligible_NNG.data_ptr<bool>();
  at::Tensor quota_NNG = at::zeros({N, N, G}, records_NNG.options());
  at::Tensor relay_NNGG = at::empty({N, N, G, G}, records_NNG.options());  // every entry is written below
  int64_t* quota = quota_NNG.data_ptr<int64_t>();
  int64_t* relay = relay_NNGG.data_ptr<int64_t>();
  std::vector<int64_t> keep(static_cast<size_t>(G)), s_lo(static_cast<size_t>(G)), s_hi(static_cast<size_t>(G)),
      d_lo(static_cast<size_t>(G)), d_hi(static_cast<size_t>(G));
  for (int64_t s = 0; s < N; ++s) {
    for (int64_t d = 0; d < N; ++d) {
      const int64_t* rec = records + (s * N + d) * G;
      const bool* ok = allowed + (s * N + d) * G;
      int64_t* q = quota + (s * N + d) * G;
      if (s == d) {  // the local node is never balanced
        std::copy(rec, rec + G, q);
      } else {
        int64_t num_eligible = 0, to_spread = 0;
        for (int64_t l = 0; l < G; ++l) {
          num_eligible += ok[l];
          to_spread += (balanced || !ok[l]) ? rec[l] : 0;
        }
        RW_CHECK(num_eligible >= 1, "node pair (", s, ", ", d, ") has no eligible rail");
        const int64_t base = to_spread / num_eligible, rem = to_spread - base * num_eligible;
        const int64_t rot = (s + d + phase) % num_eligible;
        int64_t pos = -1;
        for (int64_t l = 0; l < G; ++l) {
          if (!ok[l]) continue;
          ++pos;
          const int64_t shifted = ((pos - rot) % num_eligible + num_eligible) % num_eligible;
          q[l] = base + (shifted < rem ? 1 : 0) + (balanced ? 0 : rec[l]);
        }
      }
      // Greedy fill: owners' surpluses end to end against the GPUs' deficits end to end.
      int64_t s_run = 0, d_run = 0;
      for (int64_t l = 0; l < G; ++l) {
        keep[l] = std::min(rec[l], q[l]);
        s_lo[l] = s_run;
        s_run += rec[l] - keep[l];
        s_hi[l] = s_run;
        d_lo[l] = d_run;
        d_run += q[l] - keep[l];
        d_hi[l] = d_run;
      }
      int64_t* r = relay + (s * N + d) * G * G;
      for (int64_t o = 0; o < G; ++o) {
        for (int64_t l = 0; l < G; ++l) {
          r[o * G + l] = std::max<int64_t>(std::min(s_hi[o], d_hi[l]) - std::max(s_lo[o], d_lo[l]), 0);
        }
        r[o * G + o] += keep[o];
      }
    }
  }
  return {quota_NNG, relay_NNGG};
}

}  // namespace railwave::cpu
