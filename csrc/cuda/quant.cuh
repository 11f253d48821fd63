// Quantized KV caches on the device (ORT 1.32's contract, docs/CONTRACT.md section 13): the
// cache element types, the one switch from a call's kv_bits to them, the codes written when a
// row is appended (bit for bit the CPU op's, core/dtype.h) and the values read back. Internal to
// csrc/cuda/.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"

namespace kvl {
namespace cu {

// A byte of a packed int4 cache: two codes, biased by 8; channel 2i in the low nibble of byte i.
struct PackedInt4 {
  uint8_t bits;
};

// C, a cache element type: T itself (unquantized), int8_t or PackedInt4.
template <typename C>
constexpr bool kQuantCache = std::is_same<C, int8_t>::value || std::is_same<C, PackedInt4>::value;
template <typename C>
constexpr int kCacheBits = std::is_same<C, int8_t>::value ? 8 : 4;  // quantized caches only

template <typename C>
struct CacheTag {
  using type = C;
};

// The one switch from a call's cache to its element type: fn(CacheTag<C>{}) with C = T without
// quantization, int8_t with 8 bits, PackedInt4 with 4.
template <typename T, typename Fn>
decltype(auto) DispatchCache(const GqaShape& s, Fn&& fn) {
  if (s.kv_bits == 8) return fn(CacheTag<int8_t>{});
  if (s.kv_bits == 4) return fn(CacheTag<PackedInt4>{});
  return fn(CacheTag<T>{});
}

// Stored elements of one cache row (KvRowElements): head_size, or its packed int4 bytes.
KVL_HOST_DEVICE int64_t CacheRow(const GqaShape& s) { return KvRowElements(s.head_size, s.kv_bits); }

// ---- writing: ORT's MLAS rule, bit for bit (core/dtype.h QuantizeCode) -----------------------
// inv = float32(1 / scale), a zero scale quantizing as 1 (MLAS's guard; the op refuses scales
// <= 0); __frcp_rn is the correctly rounded reciprocal whatever --use_fast_math says.
__device__ __forceinline__ float QuantInverse(float scale) {
  return scale != 0.0f ? __frcp_rn(scale) : 1.0f;
}
// clamp(rint(x * inv)) as max(lo, min(hi, q)) in ORT's order: NaN gives hi, +-Inf the ends.
__device__ __forceinline__ int QuantCode(float x, float inv, float lo, float hi) {
  float q = rintf(__fmul_rn(x, inv));
  q = q < hi ? q : hi;  // std::min(hi, q)
  q = lo < q ? q : lo;  // std::max(lo, q)
  return static_cast<int>(q);
}
// The scale of channel d of kv head h (flat k_scale / v_scale: h * H + d per channel).
__device__ __forceinline__ float ChannelScale(const float* scale, KvQuant quant, int64_t H,
                                              int64_t h, int64_t d) {
  return quant == KvQuant::kPerChannel ? scale[h * H + d] : scale[0];
}

// ---- reading: float32(q) * scale --------------------------------------------------------------
// The code of channel d of a row of codes.
__device__ __forceinline__ int CodeAt(const int8_t* row, int64_t d) { return row[d]; }
__device__ __forceinline__ int CodeAt(const PackedInt4* row, int64_t d) {
  const int byte = row[d / 2].bits;
  return ((d & 1) ? (byte >> 4) : (byte & 15)) - 8;
}

// ---- codes to T pairs in registers (the decode kernel's MMA operands) -------------------------
// Every code is an integer in [-128, 127], exact in fp16 and bf16. fp16 by the exponent trick:
// the half 0x64XX is 1024 + XX exactly, so the biased byte (code + 128) placed under 0x64 and
// 1152 subtracted gives the code; bf16 (7 mantissa bits) through float32 the same way (2^23).
template <typename T>
__device__ __forceinline__ uint32_t HalfPairBits(T h2);
template <>
__device__ __forceinline__ uint32_t HalfPairBits(__half2 h) {
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t HalfPairBits(__nv_bfloat162 h) {
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <typename T2>
__device__ __forceinline__ T2 PairOf(uint32_t bits) {
  return *reinterpret_cast<const T2*>(&bits);
}

// Four int8 codes (bytes 0..3 of w) as two pairs of T: p01 = (byte 0, byte 1), p23 = (2, 3).
template <typename T>
__device__ __forceinline__ void Int8x4ToPairs(uint32_t w, uint32_t& p01, uint32_t& p23) {
  const uint32_t x = w ^ 0x80808080u;  // code + 128, as unsigned bytes
  if constexpr (std::is_same<T, __half>::value) {
    const __half2 bias = __half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    p01 = HalfPairBits(__hsub2(PairOf<__half2>(__byte_perm(x, 0x64646464u, 0x4140)), bias));
    p23 = HalfPairBits(__hsub2(PairOf<__half2>(__byte_perm(x, 0x64646464u, 0x4342)), bias));
  } else {
    auto f = [&](unsigned sel) {  // 2^23 + byte, less 2^23 + 128
      return __uint_as_float(__byte_perm(x, 0x4B000000u, sel)) - 8388736.0f;
    };
    p01 = HalfPairBits(__floats2bfloat162_rn(f(0x7440), f(0x7441)));
    p23 = HalfPairBits(__floats2bfloat162_rn(f(0x7442), f(0x7443)));
  }
}

// Eight int4 nibbles of w (nibble k at bits 4k..4k+3, each code + 8) as four pairs of T:
// p[j] = (nibble j, nibble j + 4). The nibble under 0x64 (fp16: 1024 + u) or 0x43 (bf16:
// 128 + u), less 1032 or 136.
template <typename T>
__device__ __forceinline__ void Int4x8ToPairs(uint32_t w, uint32_t (&p)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t u = (w >> (4 * j)) & 0x000F000Fu;
    if constexpr (std::is_same<T, __half>::value) {
      const __half2 bias = __half2(__ushort_as_half(0x6408), __ushort_as_half(0x6408));  // 1032
      p[j] = HalfPairBits(__hsub2(PairOf<__half2>(u | 0x64006400u), bias));
    } else {
      const __nv_bfloat162 bias = __nv_bfloat162(__ushort_as_bfloat16(0x4308),
                                                 __ushort_as_bfloat16(0x4308));  // 136
      p[j] = HalfPairBits(__hsub2(PairOf<__nv_bfloat162>(u | 0x43004300u), bias));
    }
  }
}

}  // namespace cu
}  // namespace kvl
