// The per-row rule of ai.kvlayout::SampleTokens (docs/CONTRACT.md, section 15), written once for
// the CPU kernel (cpu/sample_tokens.cc) and the CUDA kernel (cuda/sample_tokens.cu): the order
// key of a logit, the parameter rule, the weights, and exact products with a float in [0, 1].
//
// Both kernels compute every weight with FixedWeight, bit for bit alike, and every sum of weights
// in integers (exact, so the summation order does not matter): for the same inputs they choose
// the same token, and a kernel's choice does not depend on its threads or reduction order.
#pragma once

#include <cfloat>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVL_SAMPLE_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define KVL_SAMPLE_HD inline
#endif

namespace kvl {
namespace sample {

// Token ids of rows that get no token.
constexpr int64_t kNonFiniteRow = -1;   // a NaN or an infinity among the row's logits
constexpr int64_t kInvalidParams = -2;  // the row's temperature, top_k, top_p or uniform

// The bits of a float32 and the float32 of bits, exact on both sides (memcpy is nvcc's device
// builtin too, a register move there as __float_as_uint is).
template <typename To, typename From>
KVL_SAMPLE_HD To BitCast(From x) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To y;
  memcpy(&y, &x, sizeof y);
  return y;
}
KVL_SAMPLE_HD uint32_t Bits(float f) { return BitCast<uint32_t>(f); }
KVL_SAMPLE_HD float FromBits(uint32_t u) { return BitCast<float>(u); }

// IEEE float32 operations, rounded to nearest, that no compiler may fuse or approximate: the
// library's CUDA flags (--use_fast_math) make `/` approximate and fuse a * b + c into an FMA, so
// the device side calls the _rn intrinsics; the host side is plain arithmetic in a file built
// with -ffp-contract=off (CMakeLists.txt). Subnormals never reach them (FixedWeight), so the
// device's flush-to-zero changes nothing either.
KVL_SAMPLE_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVL_SAMPLE_HD float Sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
KVL_SAMPLE_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVL_SAMPLE_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVL_SAMPLE_HD float Rint(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::rint(a);  // the default rounding mode: to nearest, ties to even, as rintf
#endif
}

KVL_SAMPLE_HD bool IsFinite(float x) { return (Bits(x) & 0x7f800000u) != 0x7f800000u; }

// The row's order as unsigned integers: OrderKey(a) > OrderKey(b) exactly when a > b, for finite
// a and b; -0 takes the key of +0 (they are equal logits: the lower index goes first). No finite
// value has key 0. Integer keys order subnormals exactly, whatever the device's flush-to-zero.
KVL_SAMPLE_HD uint32_t OrderKey(float x) {
  uint32_t b = Bits(x);
  if ((b & 0x7fffffffu) == 0) b = 0;
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The logit of a key (+0 for the key of zero).
KVL_SAMPLE_HD float KeyValue(uint32_t key) {
  return FromBits((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The contract's parameter rule, on the bits (so a subnormal is not taken for zero): temperature
// +-0, positive or +inf; top_k >= 0; top_p in (0, 1]; uniform in [0, 1) (-0 included). A NaN
// fails every test.
KVL_SAMPLE_HD bool ParamsValid(float temperature, int32_t top_k, float top_p, float uniform) {
  const uint32_t t = Bits(temperature), p = Bits(top_p), u = Bits(uniform);
  const bool t_ok = t <= 0x7f800000u || t == 0x80000000u;
  const bool p_ok = p != 0 && p <= 0x3f800000u;
  const bool u_ok = u < 0x3f800000u || u == 0x80000000u;
  return t_ok && top_k >= 0 && p_ok && u_ok;
}

// Greedy rows (valid parameters): temperature 0 or top_k 1.
KVL_SAMPLE_HD bool IsGreedy(float temperature, int32_t top_k) {
  return (Bits(temperature) & 0x7fffffffu) == 0 || top_k == 1;
}

KVL_SAMPLE_HD bool TopPIsOne(float top_p) { return Bits(top_p) == 0x3f800000u; }

// Weights are integers in units of 2^-FixedBits(vocab): the row maximum weighs 2^FixedBits, and
// a sum of `vocab` weights stays below 2^62 (vocab <= 2^ceil(log2 vocab)).
KVL_SAMPLE_HD int FixedBits(int64_t vocab) {
  int c = 0;
  while ((int64_t{1} << c) < vocab) ++c;
  return 62 - c;
}

KVL_SAMPLE_HD float FlushSubnormal(float x) {
  const uint32_t b = Bits(x);
  return (b & 0x7f800000u) == 0 ? FromBits(b & 0x80000000u) : x;
}

// exp(a) for a in [-86, -2^-25]: Cephes' expf (reduction by ln 2 in two parts, the first exact
// for |k| < 2^15; a degree-5 polynomial), about 1 ulp. The result stays normal: k >= -124.
KVL_SAMPLE_HD float ExpNegative(float a) {
  const float k = Rint(Mul(a, 1.44269504088896341f));
  float r = Sub(a, Mul(k, 0.693359375f));
  r = Sub(r, Mul(k, -2.12194440e-4f));
  const float z = Mul(r, r);
  float p = 1.9875691500e-4f;
  p = Add(Mul(p, r), 1.3981999507e-3f);
  p = Add(Mul(p, r), 8.3334519073e-3f);
  p = Add(Mul(p, r), 4.1665795894e-2f);
  p = Add(Mul(p, r), 1.6666665459e-1f);
  p = Add(Mul(p, r), 5.0000001201e-1f);
  const float e = Add(Add(Mul(p, z), r), 1.0f);
  const int n = static_cast<int>(k);
  return Mul(e, FromBits(static_cast<uint32_t>(n + 127) << 23));
}

// The weight of logit x in its row, exp((x - x_max) / temperature) in float32, in units of
// 2^-fixed_bits rounded down (x <= x_max, both finite; temperature > 0 or +inf). Subnormal
// logits, differences and quotients count as zero (what the device's flush-to-zero does; here
// on both sides), a subnormal temperature as FLT_MIN; exponents within 2^-25 of 0 give 1 (as
// float32 rounding does), exponents below -86 give 0 (weights under 2.2e-38 of the maximum's).
KVL_SAMPLE_HD uint64_t FixedWeight(float x, float x_max, float temperature, int fixed_bits) {
  const uint64_t one = uint64_t{1} << fixed_bits;
  const float d = FlushSubnormal(Sub(FlushSubnormal(x), FlushSubnormal(x_max)));
  if ((Bits(d) & 0x7fffffffu) == 0) return one;
  const float t = (Bits(temperature) & 0x7f800000u) == 0 ? FLT_MIN : temperature;
  const float a = Div(d, t);  // < 0, -0 (temperature +inf) or a flushed subnormal
  if ((Bits(a) & 0x7fffffffu) < 0x33000000u) return one;  // |a| < 2^-25
  if (a < -86.0f) return 0;
  // Exact: a power of two times a float, then truncated (both sides convert toward zero).
  return static_cast<uint64_t>(Mul(ExpNegative(a), static_cast<float>(one)));
}

// floor(f * z) and whether f * z was not an integer, exactly, for f in [0, 1] (or -0) and
// z < 2^63: f = m * 2^-s with an integer m < 2^24 and s >= 23, so f * z = (m * z) >> s with an
// 88-bit product.
struct FractionProduct {
  uint64_t floor;
  bool inexact;
};
KVL_SAMPLE_HD FractionProduct MulFraction(float f, uint64_t z) {
  const uint32_t b = Bits(f) & 0x7fffffffu;
  if (b == 0 || z == 0) return {0, false};
  const uint32_t exponent = b >> 23;
  const uint64_t m = exponent == 0 ? (b & 0x7fffffu) : ((b & 0x7fffffu) | 0x800000u);
  const int s = exponent == 0 ? 149 : 150 - static_cast<int>(exponent);
#if defined(__CUDA_ARCH__)
  const uint64_t lo = m * z;
  const uint64_t hi = __umul64hi(m, z);
#else
  const unsigned __int128 product = static_cast<unsigned __int128>(m) * z;
  const uint64_t lo = static_cast<uint64_t>(product);
  const uint64_t hi = static_cast<uint64_t>(product >> 64);
#endif
  if (s >= 128) return {0, true};
  if (s >= 64) {
    const int t = s - 64;
    const uint64_t low_bits = t == 0 ? 0 : (hi & ((uint64_t{1} << t) - 1));
    return {hi >> t, lo != 0 || low_bits != 0};
  }
  return {(lo >> s) | (hi << (64 - s)), (lo & ((uint64_t{1} << s) - 1)) != 0};
}

KVL_SAMPLE_HD uint64_t MulFloor(float f, uint64_t z) { return MulFraction(f, z).floor; }

KVL_SAMPLE_HD uint64_t MulCeil(float f, uint64_t z) {
  const FractionProduct p = MulFraction(f, z);
  return p.floor + (p.inexact ? 1 : 0);
}

}  // namespace sample
}  // namespace kvl
