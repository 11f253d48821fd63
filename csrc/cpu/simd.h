// SIMD primitives of one CPU level (isa_level.h): float32 vectors as wide as the level has, through
// GCC/Clang vector extensions, and the lane operations the kernels build on (broadcast,
// horizontal sums, exp, softcap).
#pragma once

#include <cstdint>
#include <cstring>

#include "core/softcap.h"
#include "cpu/isa_level.h"

KVL_ISA_BEGIN

// ---- float32 vectors through GCC/Clang vector extensions: the widest the level has -----------
#if KVL_ISA_LEVEL == 2
constexpr int kVW = 16;
#elif KVL_ISA_LEVEL == 1
constexpr int kVW = 8;
#else
constexpr int kVW = 4;
#endif
typedef float VecF __attribute__((vector_size(kVW * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kVW * sizeof(int32_t))));

inline VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }
// x in every lane, as one broadcast (a load-port vbroadcastss from memory). Not VecF{} + x: that
// is a scalar add then a shuffle (0 + x is not x for x = -0), both on the FP ports the FMAs of
// the micro-kernels need (AVX2 prefill: one add per broadcast, one per 2 FMAs).
inline VecF Splat(float x) {
#if KVL_ISA_LEVEL == 2
  return reinterpret_cast<VecF>(_mm512_set1_ps(x));
#elif KVL_ISA_LEVEL == 1
  return reinterpret_cast<VecF>(_mm256_set1_ps(x));
#else
  return VecF{x, x, x, x};
#endif
}

// Sum of a vector's lanes by halving shuffles (log2(kVW) vector adds, not kVW scalar ones).
inline float HorizontalSum(VecF v) {
#if KVL_ISA_LEVEL == 2
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif KVL_ISA_LEVEL == 1
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
#endif
  return v[0];
}

// The lane sums of 4 vectors, out[i * stride] = sum of v_i's lanes: one halving tree over all
// four (3 or 4 shuffle-add levels, the first two merging vectors), not 4 separate ones (a
// quarter of the shuffles, which compete with the FMAs for a port).
inline void HorizontalSum4(VecF a, VecF b, VecF c, VecF d, float* out, int64_t stride) {
#if KVL_ISA_LEVEL == 2
  const VecF ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                          29, 30, 31);
  const VecF cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                          29, 30, 31);
  VecF x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  constexpr int kStep = 4;
#elif KVL_ISA_LEVEL == 1
  const VecF ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const VecF cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  VecF x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
  constexpr int kStep = 2;
#else
  const VecF ab =
      __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
  const VecF cd =
      __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
  const VecF x =
      __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
  constexpr int kStep = 1;
#endif
  for (int i = 0; i < 4; ++i) out[i * stride] = x[i * kStep];
}

// exp(x) for a vector, relative error ~2e-7; inputs below -87 (and -inf) give exactly 0.
inline VecF VecExp(VecF x) {
  const VecF lo = Splat(-87.0f), hi = Splat(88.0f);
  const auto underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // x = n*ln2 + r, |r| <= ln2/2; the magic constant rounds to nearest.
  const VecF magic = Splat(12582912.0f);
  const VecF n = (x * 1.44269504088896341f + magic) - magic;
  VecF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  VecF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const VecF result = p * scale;
  return underflow ? Splat(0.0f) : result;
}

// core/softcap.h's rule (c * tanh(x / c) at float rounding for every finite c), on a vector;
// the exponential form is computed only when a lane needs it.
inline VecF VecSoftcap(VecF x, float c, float inv_c) {
  const VecF y = inv_c != 0.0f ? x * inv_c : x / Splat(c);
  const VecF z = y * y;
  VecF p = Splat(kTanhP4);
  p = p * z + kTanhP3;
  p = p * z + kTanhP2;
  p = p * z + kTanhP1;
  p = p * z + kTanhP0;
  const VecF small = y + y * z * p;
  const auto use_big = z >= kSoftcapPolyLimit * kSoftcapPolyLimit;  // false for NaN: polynomial
  bool any_big = false;
  for (int l = 0; l < kVW; ++l) any_big |= use_big[l] != 0;
  if (!any_big) return small * c;
  const auto neg = y < 0.0f;
  const VecF ay = neg ? -y : y;
  const VecF big = 1.0f - 2.0f / (VecExp(ay + ay) + 1.0f);
  const VecF t = use_big ? (neg ? -big : big) : small;
  return t * c;
}

#if KVL_ISA_LEVEL >= 1
// 8 floats: the AVX2 and AVX-512 levels' unit of the K tile's transposition (TransposeKRows8).
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
#endif

KVL_ISA_END
