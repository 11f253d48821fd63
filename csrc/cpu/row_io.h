// Row I/O: T rows (float32, float16, bfloat16) to float32 and back, and the cache rows of a
// quantized cache (int8, int4, fp8; per tensor, per channel or per token scales) decoded into
// float32 and encoded from it. The one place a cache row changes representation, except int8
// rows at token generation, which score_kernels.h's Int8Rows reads in place.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dtype.h"
#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/simd.h"

KVL_ISA_BEGIN

// float8e4m3fn byte -> float32, as a table of dtype.h's decoding (1 KB, stays in L1): the
// dequantization loop is then a load (a gather where the level has one) and a multiply.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) value[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
  }
};
const Fp8Table kFp8Table;

template <typename T>
inline float Get(const void* base, int64_t index) {
  return ToFloat(static_cast<const T*>(base)[index]);
}

// dtype.h's HalfToFloat without branches, so that a loop of it vectorizes (SSE2 at the portable
// level): the exponent is rebiased in place; inf/nan get a second rebias to 255; a zero or
// subnormal h is rebuilt as 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact, every operand and
// result a float32 normal (no denormal slow path, unaffected by FTZ/DAZ).
inline float HalfToFloatBranchFree(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = bits & 0x0f800000u;
  const uint32_t inf_nan = 0u - static_cast<uint32_t>(exp == 0x0f800000u);  // all ones or 0
  const uint32_t tiny = 0u - static_cast<uint32_t>(exp == 0);
  const uint32_t normal = bits + (112u << 23) + (inf_nan & (112u << 23));
  const uint32_t sub = FloatToBits(BitsToFloat(bits + (113u << 23)) - BitsToFloat(113u << 23));
  return BitsToFloat((sub & tiny) | (normal & ~tiny) | sign);
}

// x[0, n) = src[0, n) as float32, exact: the bulk conversion of every T row (cache rows, queries,
// new K/V). float16 at the AVX2 and AVX-512 levels: F16C's vcvtph2ps, 8 or 16 per instruction
// (which quiets a signaling NaN that HalfToFloat keeps: every value converted here is an operand
// of arithmetic, which quiets it anyway, so results are the same bits). float16 at the portable
// level and in tails: HalfToFloatBranchFree; bfloat16: a 16-bit shift (both vectorized by the
// compiler at each level). A loop of HalfToFloat's branches does not vectorize: it read a
// float16 cache ~3x slower than this (32/8/128 seq-major decode, L = 4096, one thread).
template <typename T>
inline void ToFloatRow(const T* src, int64_t n, float* x) {
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(x, src, static_cast<size_t>(n) * sizeof(float));
  } else if constexpr (std::is_same<T, BFloat16>::value) {
    for (int64_t d = 0; d < n; ++d) x[d] = BFloat16ToFloat(src[d].bits);
  } else {
    int64_t d = 0;
#if KVL_ISA_LEVEL == 2
    for (; d + 16 <= n; d += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(x + d, _mm512_cvtph_ps(h));
    }
#elif KVL_ISA_LEVEL == 1
    for (; d + 8 <= n; d += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      _mm256_storeu_ps(x + d, _mm256_cvtph_ps(h));
    }
#endif
    for (; d < n; ++d) x[d] = HalfToFloatBranchFree(src[d].bits);
  }
}

#if KVL_ISA_LEVEL >= 1
// 8 T values as float32, exact (ToFloatRow's conversions, one vector).
template <typename T>
inline Vec8 LoadVec8(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    Vec8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same<T, Half>::value) {
      return reinterpret_cast<Vec8>(_mm256_cvtph_ps(h));
    } else {
      return reinterpret_cast<Vec8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}
#endif

// One cache row -> float32 x[0, H): the T values, or the codes of a quantized cache times their
// scales (`which`: 0 key, 1 value; h: the kv head; token_scale: the row's scale, PER_TOKEN). The
// one place a cache row becomes float32 values, except int8 rows at token generation, which
// Int8Rows reads in place. T rows convert through ToFloatRow; each code loop is a plain
// element-wise map (int8 / fp8 decode, times one or H scales), which the compiler vectorizes at
// each CPU level.
template <typename T>
inline void LoadRow(const Call<T>& c, const uint8_t* row, int which, int64_t h, float token_scale,
                    float* x) {
  const int64_t H = c.s.head_size;
  if (!c.s.quantized()) {
    ToFloatRow(reinterpret_cast<const T*>(row), H, x);
    return;
  }
  const bool per_token = c.s.per_token();
  const float* sc = per_token ? &token_scale : c.scale[which] + h * c.scale_pitch[which];
  const bool per_channel = !per_token && c.scale_pitch[which] != 0;
  if (c.s.fp8_cache()) {
    const float* fp8 = kFp8Table.value;
    if (per_channel) {
      for (int64_t d = 0; d < H; ++d) x[d] = fp8[row[d]] * sc[d];
    } else {
      const float s0 = sc[0];
      for (int64_t d = 0; d < H; ++d) x[d] = fp8[row[d]] * s0;
    }
    return;
  }
  if (c.s.kv_bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    if (per_channel) {
      for (int64_t d = 0; d < H; ++d) x[d] = static_cast<float>(q[d]) * sc[d];
    } else {
      const float s0 = sc[0];
      for (int64_t d = 0; d < H; ++d) x[d] = static_cast<float>(q[d]) * s0;
    }
    return;
  }
  // int4: code + 8 per nibble, even channel low.
  for (int64_t i = 0; i < H / 2; ++i) {
    const int lo = (row[i] & 0x0f) - 8, hi = (row[i] >> 4) - 8;
    x[2 * i] = static_cast<float>(lo) * sc[per_channel ? 2 * i : 0];
    x[2 * i + 1] = static_cast<float>(hi) * sc[per_channel ? 2 * i + 1 : 0];
  }
  if (H % 2 != 0) {
    x[H - 1] = static_cast<float>((row[H / 2] & 0x0f) - 8) * sc[per_channel ? H - 1 : 0];
  }
}

// LoadRow into dst[0, head_pad), zero padded past H (the micro-kernels read whole vectors);
// returns dst.
template <typename T>
inline const float* LoadPaddedRow(const Call<T>& c, const uint8_t* row, int which, int64_t h,
                                  float token_scale, float* dst) {
  LoadRow(c, row, which, h, token_scale, dst);
  for (int64_t d = c.s.head_size; d < c.head_pad; ++d) dst[d] = 0.0f;
  return dst;
}

// float32 x[0, H) -> one cache row: T values, or codes of a quantized cache (dtype.h's rule, on
// x rounded to T first, in place: ORT quantizes the rotated K and V it holds in T). PER_TOKEN:
// the row's scale (dtype.h's PerTokenScale) goes to *token_scale; a non-finite row stores code 0
// everywhere (scale NaN).
template <typename T>
inline void StoreRow(const Call<T>& c, float* x, int which, int64_t h, uint8_t* row,
                     float* token_scale) {
  const int64_t H = c.s.head_size;
  if (!c.s.quantized()) {
    T* r = reinterpret_cast<T*>(row);
    for (int64_t d = 0; d < H; ++d) r[d] = FromFloat<T>(x[d]);
    return;
  }
  for (int64_t d = 0; d < H; ++d) x[d] = ToFloat(FromFloat<T>(x[d]));
  const float* inv = c.inv_scale[which] + h * c.scale_pitch[which];
  int64_t step = c.scale_pitch[which] != 0 ? 1 : 0;
  float token_inv = 0.0f;
  if (c.s.per_token()) {
    *token_scale = PerTokenScale(x, H, c.qmax, &token_inv);
    if (*token_scale != *token_scale) std::fill(x, x + H, 0.0f);  // codes 0, read back NaN
    inv = &token_inv;
    step = 0;
  }
  if (c.s.fp8_cache()) {
    for (int64_t d = 0; d < H; ++d) row[d] = QuantizeFp8(x[d], inv[d * step]);
    return;
  }
  if (c.s.kv_bits == 8) {
    int8_t* q = reinterpret_cast<int8_t*>(row);
    for (int64_t d = 0; d < H; ++d) q[d] = QuantizeInt8(x[d], inv[d * step]);
    return;
  }
  for (int64_t i = 0; i < (H + 1) / 2; ++i) {
    const uint8_t lo = Int4Nibble(x[2 * i], inv[2 * i * step]);
    const int64_t d = 2 * i + 1;
    const uint8_t hi = d < H ? Int4Nibble(x[d], inv[d * step]) : 8;  // odd H: code 0
    row[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

// dst[d] = src[d] x kv head h's static scale of element d, d < H (`which`: 0 key, 1 value; per
// channel H scales a head, per tensor one): an int8 cache read in place (Int8Rows) takes its K
// scales in the queries and its V scales in the output.
template <typename T>
inline void TimesHeadScales(const Call<T>& c, int which, int64_t h, const float* src, float* dst) {
  const float* sc = c.scale[which] + h * c.scale_pitch[which];
  const int64_t step = c.scale_pitch[which] != 0 ? 1 : 0;
  for (int64_t d = 0; d < c.s.head_size; ++d) dst[d] = src[d] * sc[d * step];
}

KVL_ISA_END
