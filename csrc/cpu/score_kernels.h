// The attention's micro-kernels over one tile of kTileKeys keys and a block of RB query rows:
// scores q.k (against a transposed K tile, or by dot products over key rows at token generation)
// and the weighted sum of the V rows into the output rows. K and V rows come as float32 rows or,
// from an int8 cache at token generation, as codes read in place (FloatRows, Int8Rows).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/row_io.h"
#include "cpu/simd.h"

KVL_ISA_BEGIN

// kt[d][i] = rows[i][d] for 8 T rows, d in [0, H), H a multiple of 8: 8 x 8 blocks converted to
// float32 and transposed in registers (AVX2 and AVX-512 levels). The scalar loop it replaces
// stored one float per instruction, 256 bytes apart (~8% of a seq-major S=2048 32/8/128 prefill).
template <typename T>
inline bool TransposeKRows8(const T* const* rows, int64_t H, float* kt) {
#if KVL_ISA_LEVEL >= 1
  if (H % 8 != 0) return false;
  for (int64_t d = 0; d < H; d += 8) {
    Vec8 r[8];
    // Unrolled, so r, t and u live in registers (a loop kept them in a stack array).
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = LoadVec8(rows[i] + d);
    Vec8 t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved: (r0 r1), (r2 r3), ...
      t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
      t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // quads of rows: rows 0-3 (h = 0) and 4-7 (h = 1)
      const Vec8 a0 = t[4 * h], a1 = t[4 * h + 1], b0 = t[4 * h + 2], b1 = t[4 * h + 3];
      u[4 * h + 0] = __builtin_shufflevector(a0, b0, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 1] = __builtin_shufflevector(a0, b0, 2, 3, 10, 11, 6, 7, 14, 15);
      u[4 * h + 2] = __builtin_shufflevector(a1, b1, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 3] = __builtin_shufflevector(a1, b1, 2, 3, 10, 11, 6, 7, 14, 15);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {  // u[k]: dims k and k + 4 of rows 0-3; u[4 + k]: rows 4-7
      const Vec8 lo = __builtin_shufflevector(u[k], u[4 + k], 0, 1, 2, 3, 8, 9, 10, 11);
      const Vec8 hi = __builtin_shufflevector(u[k], u[4 + k], 4, 5, 6, 7, 12, 13, 14, 15);
      std::memcpy(kt + (d + k) * kTileKeys, &lo, sizeof lo);
      std::memcpy(kt + (d + k + 4) * kTileKeys, &hi, sizeof hi);
    }
  }
  return true;
#else
  (void)rows, (void)H, (void)kt;
  return false;
#endif
}

// scores[r][j] = q_r . k_j for RB query rows and kTileKeys keys (k transposed: kt[d][j]).
template <int RB>
inline void ScoreBlock(const float* const* q, const float* kt, int64_t H, float* scores) {
  for (int j0 = 0; j0 < kTileKeys; j0 += 2 * kVW) {
    VecF acc[RB][2] = {};
    for (int64_t d = 0; d < H; ++d) {
      const VecF k0 = Load(kt + d * kTileKeys + j0);
      const VecF k1 = Load(kt + d * kTileKeys + j0 + kVW);
      for (int r = 0; r < RB; ++r) {
        const VecF qd = Splat(q[r][d]);
        acc[r][0] += qd * k0;
        acc[r][1] += qd * k1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      Store(scores + r * kTileKeys + j0, acc[r][0]);
      Store(scores + r * kTileKeys + j0 + kVW, acc[r][1]);
    }
  }
}

// The K or V rows of a tile as float32 vectors, for the dot-product micro-kernels: Get(j, d) is
// elements [d, d + kVW) of row j, d < head_pad (float32 rows are zero padded to head_pad; code
// rows are read in place only where H = head_pad, so no load passes a row's end).
// FloatRows: float32 rows (a float32 cache in place, or rows dequantized into the scratch).
struct FloatRows {
  const float* const* rows;
  static constexpr int64_t kElemBytes = sizeof(float);
  VecF Get(int j, int64_t d) const { return Load(rows[j] + d); }
  const void* Row(int j) const { return rows[j]; }
};
// Int8Rows: an int8 cache's codes read in place and widened in registers (vpmovsxbd + vcvtdq2ps at
// AVX2/AVX-512), exact. The scales are applied outside the micro-kernels (AttentionTask): folded
// into the queries for K, into the weights (PER_TOKEN) or the output (per channel / tensor) for V.
struct Int8Rows {
  const int8_t* const* rows;
  static constexpr int64_t kElemBytes = 1;
  // (Intrinsics: GCC 12 turns __builtin_convertvector of an int8 vector into kVW scalar
  // conversions, which made this path 2.5x slower than dequantizing into the scratch.)
  VecF Get(int j, int64_t d) const {
    const int8_t* p = rows[j] + d;
#if KVL_ISA_LEVEL == 2
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<VecF>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
#elif KVL_ISA_LEVEL == 1
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<VecF>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
    return VecF{static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                static_cast<float>(p[3])};
#endif
  }
  const void* Row(int j) const { return rows[j]; }
};

// The same scores by dot products over key rows (zero padded queries): cheaper than transposing
// the tile when a head has a single row block (token generation).
// Each step also prefetches into L1 the key row 4 ahead and the value row the PV pass will read:
// the tile's rows sit in L2/L3, and in seq-major order they are Nkv*H apart, so the hardware L1
// prefetchers do not bring them (shared-cache decode, AVX2: +10 to 50%, both layouts).
template <int RB, typename KS, typename VS>
inline void ScoreDot(const float* const* q, const KS& k, const VS& v, int tile, int64_t head_pad,
                     float* scores) {
  const int64_t kb = head_pad * KS::kElemBytes, vb = head_pad * VS::kElemBytes;
  for (int j = 0; j < tile; ++j) {
    for (int64_t o = 0; o < vb; o += 64) {
      __builtin_prefetch(static_cast<const char*>(v.Row(j)) + o, 0, 3);
    }
    if (j + 4 < tile) {
      for (int64_t o = 0; o < kb; o += 64) {
        __builtin_prefetch(static_cast<const char*>(k.Row(j + 4)) + o, 0, 3);
      }
    }
    VecF acc[RB] = {};
    for (int64_t d = 0; d < head_pad; d += kVW) {
      const VecF kv = k.Get(j, d);
      for (int r = 0; r < RB; ++r) acc[r] += Load(q[r] + d) * kv;
    }
    int r = 0;
    for (; r + 4 <= RB; r += 4) {
      HorizontalSum4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], scores + r * kTileKeys + j,
                     kTileKeys);
    }
    if constexpr (RB % 4 == 1) {
      scores[r * kTileKeys + j] = HorizontalSum(acc[r]);
    } else if constexpr (RB % 4 != 0) {  // 2 or 3 rows: one tree, zeros for the missing
      const VecF zero = Splat(0.0f);
      float sums[4];
      HorizontalSum4(acc[r], acc[r + 1], RB % 4 == 3 ? acc[(r + 2) % RB] : zero, zero, sums, 1);
      for (int i = 0; i < RB % 4; ++i) scores[(r + i) * kTileKeys + j] = sums[i];
    }
  }
  for (int r = 0; r < RB; ++r) {
    std::fill(scores + r * kTileKeys + tile, scores + (r + 1) * kTileKeys, 0.0f);
  }
}

// o[r][:] += sum_j p[r][j] * v_j for RB rows; v rows are head_pad long.
template <int RB, typename VS>
inline void AccumulateBlock(const float* p, const VS& v, int tile, int64_t head_pad,
                            float* const* o) {
  for (int64_t d0 = 0; d0 < head_pad; d0 += kDimStep) {
    VecF acc[RB][2];
    for (int r = 0; r < RB; ++r) {
      acc[r][0] = Load(o[r] + d0);
      acc[r][1] = Load(o[r] + d0 + kVW);
    }
    for (int j = 0; j < tile; ++j) {
      const VecF v0 = v.Get(j, d0);
      const VecF v1 = v.Get(j, d0 + kVW);
      for (int r = 0; r < RB; ++r) {
        const VecF pj = Splat(p[r * kTileKeys + j]);
        acc[r][0] += pj * v0;
        acc[r][1] += pj * v1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      Store(o[r] + d0, acc[r][0]);
      Store(o[r] + d0 + kVW, acc[r][1]);
    }
  }
}

// o[r][:] += sum_{j in [lo[r], hi[r])} p[r][j] * v_j: AccumulateBlock restricted to each row's
// own columns.
template <int RB, typename VS>
void AccumulateRanges(const float* p, const VS& v, const int* lo, const int* hi,
                      int64_t head_pad, float* const* o) {
  for (int r = 0; r < RB; ++r) {
    for (int j = lo[r]; j < hi[r]; ++j) {
      const VecF pj = Splat(p[r * kTileKeys + j]);
      for (int64_t d = 0; d < head_pad; d += kVW) {
        Store(o[r] + d, Load(o[r] + d) + pj * v.Get(j, d));
      }
    }
  }
}

KVL_ISA_END
