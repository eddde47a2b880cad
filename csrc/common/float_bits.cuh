// Float conversions on raw bits, shared by the CPU twins and the CUDA kernels (no torch headers).
//
// Why not the compilers' own conversions: the CPU twin and the GPU kernel must give the same bits,
// and both must equal torch's CPU casts (c10::BFloat16 / c10::Half): round to nearest even, with
// c10's NaN encodings (bf16 0x7FC0, fp16 sign | 0x7E00). One integer implementation used on both
// sides makes that hold by construction.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define RW_HD __host__ __device__ __forceinline__
#else
#define RW_HD inline
#endif

namespace railwave {

RW_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

RW_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

// bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 bits.
RW_HD float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// fp32 -> bf16, round to nearest even (c10::detail::round_to_nearest_even).
RW_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // A select, not an early return: the CPU loops over rows vectorize.
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);  // NaN -> 0x7FC0
}

// fp16 -> fp32 is exact (subnormals included).
RW_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    // Subnormal or zero: mantissa * 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return bits_to_float(sign | float_to_bits(magnitude));
  }
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// fp32 -> fp16, round to nearest even, overflow to inf (c10's fp16_ieee_from_fp32_value).
RW_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf (65504 is odd)
  uint32_t kept, dropped, half;
  if (magnitude < 0x38800000u) {
    // Below the smallest normal fp16 (2^-14): result = round(value / 2^-24), a subnormal.
    const uint32_t exponent = magnitude >> 23;
    if (exponent < 102u) return sign;  // < 2^-25: rounds to zero
    const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    kept = significand >> shift;
    dropped = significand & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
  } else {
    // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits.
    kept = (magnitude - 0x38000000u) >> 13;
    dropped = magnitude & 0x1FFFu;
    half = 0x1000u;
  }
  if (dropped > half || (dropped == half && (kept & 1u))) ++kept;  // a carry may reach the exponent
  return static_cast<uint16_t>(sign | kept);
}

// Additions rounded to nearest at every step, never fused: the fixed-order sums depend on it.
// (The CPU twins are compiled with -ffp-contract=off; on the GPU the _rn intrinsics forbid FMA.)
RW_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

RW_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// Element traits of the floating dtypes the ops accept: storage type, exact widening to the
// accumulator, rounding from it. Narrowing from double goes through float, as torch's casts do.
struct F32 {
  using Storage = float;
  RW_HD static float to_float(float v) { return v; }
  RW_HD static float from_float(float a) { return a; }
};
struct F64 {
  using Storage = double;
  RW_HD static double to_double(double v) { return v; }
  RW_HD static double from_double(double a) { return a; }
};
struct BF16 {
  using Storage = uint16_t;
  RW_HD static float to_float(uint16_t v) { return bf16_to_float(v); }
  RW_HD static uint16_t from_float(float a) { return float_to_bf16(a); }
};
struct F16 {
  using Storage = uint16_t;
  RW_HD static float to_float(uint16_t v) { return f16_to_float(v); }
  RW_HD static uint16_t from_float(float a) { return float_to_f16(a); }
};

// Accumulator of an input dtype: float64 for float64, float32 otherwise.
template <class In> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<F64> { using type = double; };

template <class In> RW_HD typename AccumulatorOf<In>::type widen(typename In::Storage v) {
  if constexpr (sizeof(typename In::Storage) == 8) {
    return In::to_double(v);
  } else {
    return In::to_float(v);
  }
}

template <class Out> RW_HD typename Out::Storage narrow(float a) {
  if constexpr (sizeof(typename Out::Storage) == 8) {
    return Out::from_double(static_cast<double>(a));
  } else {
    return Out::from_float(a);
  }
}

template <class Out> RW_HD typename Out::Storage narrow(double a) {
  if constexpr (sizeof(typename Out::Storage) == 8) {
    return Out::from_double(a);
  } else {
    return Out::from_float(static_cast<float>(a));
  }
}

}  // namespace railwave
