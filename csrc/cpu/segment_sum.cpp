// CPU twin of segment_sum: out[s] = cast(((0 + v[i0]) + v[i1]) + ...) over the rows of segment s in
// index order, accumulated in float32 (float64 for float64 input).
//
// Segment-major: a counting sort lists each segment's rows in index order, then every segment is
// summed in a small accumulator row that stays in cache and is cast once. This reads the values
// once and writes the output once (the reference widens all values, then index_add_s, then casts).
// Compiled with -ffp-contract=off: every addition rounds on its own, as on the GPU (__fadd_rn).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "../common/float_bits.cuh"
#include "../common/ops.h"
#include "../common/validate.h"
#include "alloc.h"

namespace railwave::cpu {
namespace {

// Built twice (AVX2 and baseline x86-64), picked at load time: the widening and narrowing loops
// run about 1.5x faster with AVX2. Same IEEE operations in both: the results are bitwise equal.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RW_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define RW_CPU_CLONES
#endif

template <class In, class Out>
RW_CPU_CLONES void sum_segments(const typename In::Storage* values, const int64_t* rows_of_segment, const int64_t* segment_start,
                  int64_t num_segments, int64_t width, typename Out::Storage* out) {
  using Acc = typename AccumulatorOf<In>::type;
  std::vector<Acc> acc(static_cast<size_t>(width));
  Acc* a = acc.data();
  const Acc zero = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    typename Out::Storage* dst = out + s * width;
    const int64_t first = segment_start[s], last = segment_start[s + 1];
    if (first == last) {
      for (int64_t c = 0; c < width; ++c) dst[c] = narrow<Out>(zero);
      continue;
    }
    // ((0 + v[i0]) + v[i1]) + ... + v[ik], cast: the first addition starts the accumulator and the
    // last one writes the output directly (fewer passes over the row; the same operations).
    const typename In::Storage* row = values + rows_of_segment[first] * width;
    if (last - first == 1) {
      for (int64_t c = 0; c < width; ++c) dst[c] = narrow<Out>(add_rn(zero, widen<In>(row[c])));
      continue;
    }
    for (int64_t c = 0; c < width; ++c) a[c] = add_rn(zero, widen<In>(row[c]));
    for (int64_t j = first + 1; j < last - 1; ++j) {
      row = values + rows_of_segment[j] * width;
      for (int64_t c = 0; c < width; ++c) a[c] = add_rn(a[c], widen<In>(row[c]));
    }
    row = values + rows_of_segment[last - 1] * width;
    for (int64_t c = 0; c < width; ++c) dst[c] = narrow<Out>(add_rn(a[c], widen<In>(row[c])));
  }
}

template <class In>
void sum_segments_to(at::ScalarType out_dtype, const void* values, const int64_t* rows, const int64_t* start,
                     int64_t num_segments, int64_t width, void* out) {
  const auto* v = static_cast<const typename In::Storage*>(values);
  switch (out_dtype) {
    case at::kFloat: return sum_segments<In, F32>(v, rows, start, num_segments, width, static_cast<float*>(out));
    case at::kDouble: return sum_segments<In, F64>(v, rows, start, num_segments, width, static_cast<double*>(out));
    case at::kBFloat16: return sum_segments<In, BF16>(v, rows, start, num_segments, width, static_cast<uint16_t*>(out));
    case at::kHalf: return sum_segments<In, F16>(v, rows, start, num_segments, width, static_cast<uint16_t*>(out));
    default: RW_CHECK(false, "unsupported out_dtype ", out_dtype);
  }
}

}  // namespace

at::Tensor segment_sum(const at::Tensor& values, const at::Tensor& segment_ids, int64_t num_segments,
                       at::ScalarType out_dtype) {
  check_segment_sum_args(values, segment_ids, num_segments, out_dtype);
  const at::Tensor v = values.contiguous(), ids_c = segment_ids.contiguous();
  const int64_t n = v.size(0), width = n ? v.numel() / n : row_width_bytes(v) / v.element_size();
  std::vector<int64_t> out_shape = v.sizes().vec();
  out_shape[0] = num_segments;
  at::Tensor out = empty_output(out_shape, v.options().dtype(out_dtype));

  // Counting sort of the rows by segment (stable: rows ascending within a segment).
  const int64_t* ids = ids_c.const_data_ptr<int64_t>();
  std::vector<int64_t> start(static_cast<size_t>(num_segments) + 1, 0);
  // Rows whose id is outside [0, S) are left out, as the CUDA kernel leaves them out: the exchange
  // gives padding rows such an id, so that no segment walks the padding.
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= 0 && ids[i] < num_segments) ++start[ids[i] + 1];
  }
  for (int64_t s = 0; s < num_segments; ++s) start[s + 1] += start[s];
  std::vector<int64_t> next(start.begin(), start.end() - 1), rows(static_cast<size_t>(start[num_segments]));
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] >= 0 && ids[i] < num_segments) rows[next[ids[i]]++] = i;
  }

  const void* in = v.const_data_ptr();
  void* dst = out.data_ptr();
  switch (v.scalar_type()) {
    case at::kFloat: sum_segments_to<F32>(out_dtype, in, rows.data(), start.data(), num_segments, width, dst); break;
    case at::kDouble: sum_segments_to<F64>(out_dtype, in, rows.data(), start.data(), num_segments, width, dst); break;
    case at::kBFloat16: sum_segments_to<BF16>(out_dtype, in, rows.data(), start.data(), num_segments, width, dst); break;
    case at::kHalf: sum_segments_to<F16>(out_dtype, in, rows.data(), start.data(), num_segments, width, dst); break;
    default: RW_CHECK(false, "unsupported values dtype ", v.scalar_type());
  }
  return out;
}

}  // namespace railwave::cpu
