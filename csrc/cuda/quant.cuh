// Quantized KV caches on the device (ORT 1.32's contract, docs/CONTRACT.md section 13): the
// cache element types, the one switch from a call's kv_bits to them, the codes written when a
// row is appended (bit for bit the CPU op's, core/dtype.h) and the values read back. Internal to
// csrc/cuda/.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/ptx.cuh"

namespace kvl {
namespace cu {

// A byte of a packed int4 cache: two codes, biased by 8; channel 2i in the low nibble of byte i.
struct PackedInt4 {
  uint8_t bits;
};

// A byte of a float8 e4m3fn cache (1 sign, 4 exponent bits of bias 7, 3 mantissa bits, no inf).
struct Fp8E4M3 {
  uint8_t bits;
};

// C, a cache element type: T itself (unquantized), int8_t, PackedInt4 or Fp8E4M3.
template <typename C>
constexpr bool kQuantCache = std::is_same<C, int8_t>::value ||
                             std::is_same<C, PackedInt4>::value || std::is_same<C, Fp8E4M3>::value;
template <typename C>
constexpr int kCacheBits = std::is_same<C, PackedInt4>::value ? 4 : 8;  // quantized caches only
template <typename C>
constexpr bool kFp8Cache = std::is_same<C, Fp8E4M3>::value;

template <typename C>
struct CacheTag {
  using type = C;
};

// The one switch from a call's cache to its element type: fn(CacheTag<C>{}) with C = T without
// quantization, int8_t with 8 bits (Fp8E4M3 for a float8e4m3fn cache), PackedInt4 with 4.
template <typename T, typename Fn>
decltype(auto) DispatchCache(const GqaShape& s, Fn&& fn) {
  if (s.kv_bits == 8 && s.fp8_cache()) return fn(CacheTag<Fp8E4M3>{});
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

// Thread t of a CTA of kv head h asks for line t of the head's static K then V scales in its SM's
// L1 (per channel: the 128-byte lines of its HD floats, H == HD in the quantized decode
// instances; per tensor: the one; PER_TOKEN: none), where the plan says
// (GqaCudaPlan::decode_scales_early). A CTA reads them at three points of its path, each a trip
// to memory: the appended row's quantization (StoreQuantRows, one dependent trip per value a lane
// stores), the query tile (K's) and the warps' merge (V's).
template <int HD>
__device__ __forceinline__ void PrefetchKvScales(const GqaShape& s, const GqaCudaBuffers& buf,
                                                 int h, int t) {
  constexpr int kLines = HD / 32;  // of one tensor's channel scales
  if (t >= 2 * kLines) return;
  const bool v = t >= kLines;
  const KvQuant quant = v ? s.v_quant : s.k_quant;
  const float* scale = v ? buf.v_scale : buf.k_scale;
  const int line = v ? t - kLines : t;
  if (quant == KvQuant::kPerChannel) {
    ptx::PrefetchL1(scale + h * HD + 32 * line);
  } else if (quant == KvQuant::kPerTensor && line == 0) {
    ptx::PrefetchL1(scale);
  }
}

// ---- float8 e4m3fn, bit for bit the CPU op's (core/dtype.h FloatToFp8E4M3 / Fp8E4M3ToFloat) ---
// Encoding: round to nearest even, saturating: |x| >= 448 and +-Inf give +-448 (0x7e with the
// sign), NaN gives NaN (0x7f with the sign), -0 gives 0x80; subnormals are multiples of 2^-9.
__device__ __forceinline__ uint8_t FloatToFp8(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  const float a = __uint_as_float(abs_bits);
  if (a >= 448.0f) return static_cast<uint8_t>(sign | 0x7eu);
  if (a < 0x1p-6f) return static_cast<uint8_t>(sign | static_cast<uint32_t>(rintf(__fmul_rn(a, 512.0f))));
  const uint32_t rounded = (abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - (120u << 3);
  return static_cast<uint8_t>(sign | (code > 0x7eu ? 0x7eu : code));
}
// Decoding, exact: (8 | m) << e (or 2m when e == 0) times 2^-10; NaN for S.1111.111.
__device__ __forceinline__ float Fp8ToFloat(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const int mag = e == 0 ? 2 * m : (8 | m) << e;
  const float v = static_cast<float>(mag) * 0x1p-10f;
  if ((b & 0x7f) == 0x7f) return __int_as_float(0x7fc00000);
  return (b & 0x80) ? -v : v;
}

// ---- PER_TOKEN (docs/CONTRACT.md section 14): one scale per cache row ------------------------
// The largest code: 127 (int8), 7 (int4), 448 (fp8).
template <typename C>
constexpr float kTokenQMax = kFp8Cache<C> ? 448.0f : (kCacheBits<C> == 4 ? 7.0f : 127.0f);
// A scale cache holds one float per cache row at the cache's strides with head_dim 1
// (MakeKvScaleStrides): the row at element offset `off` of a cache of CacheRow-element rows
// has its scale at off / CacheRow (every stride is a multiple of a row).
KVL_HOST_DEVICE int64_t ScaleIndex(const GqaShape& s, int64_t off) {
  return off / KvRowElements(s.head_size, s.kv_bits);
}
// scale = amax / qmax (a correctly rounded division whatever --use_fast_math says), inv =
// scale > 0 ? 1 / scale : 0 (correctly rounded, as the CPU op's 1.0f / scale); a non-finite row
// (`finite` false) gets scale NaN and inv 0 (its values are stored as 0). dtype.h PerTokenScale.
__device__ __forceinline__ float TokenScale(float amax, bool finite, float qmax, float* inv) {
  if (!finite) {
    *inv = 0.0f;
    return __int_as_float(0x7fc00000);
  }
  const float scale = __fdiv_rn(amax, qmax);
  *inv = scale > 0.0f ? __frcp_rn(scale) : 0.0f;
  return scale;
}

// ---- reading: float32(q) * scale --------------------------------------------------------------
// The value of channel d of a row of codes (float32(q); an fp8 byte decoded).
__device__ __forceinline__ int CodeAt(const int8_t* row, int64_t d) { return row[d]; }
__device__ __forceinline__ int CodeAt(const PackedInt4* row, int64_t d) {
  const int byte = row[d / 2].bits;
  return ((d & 1) ? (byte >> 4) : (byte & 15)) - 8;
}
__device__ __forceinline__ float ValueAt(const int8_t* row, int64_t d) { return float(row[d]); }
__device__ __forceinline__ float ValueAt(const PackedInt4* row, int64_t d) {
  return float(CodeAt(row, d));
}
__device__ __forceinline__ float ValueAt(const Fp8E4M3* row, int64_t d) {
  return Fp8ToFloat(row[d].bits);
}
// The scale of channel d of the row at element offset `off` of kv head h: static (k_scale /
// v_scale) or the row's own (PER_TOKEN: `tokens`, the scale cache the row's strides address).
__device__ __forceinline__ float ReadScale(const GqaShape& s, const float* scale,
                                           const float* tokens, KvQuant quant, int64_t h,
                                           int64_t d, int64_t off) {
  if (quant == KvQuant::kPerToken) return tokens[ScaleIndex(s, off)];
  return ChannelScale(scale, quant, s.head_size, h, d);
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

// The fp16 pair (1152, 1152): the bias of Int8x4ToBiasedHalfPairs.
constexpr uint32_t kInt8HalfBiasPair = 0x64806480u;
constexpr float kInt8HalfBias = 1152.0f;

// Four int8 codes (bytes 0..3 of w) as two pairs of fp16 holding 1152 + code, exactly (1024 +
// the biased byte): Int8x4ToPairs without its subtraction, for an MMA operand whose products are
// corrected afterwards by 1152 x the sum of the other operand (the decode's biased int8 step).
__device__ __forceinline__ void Int8x4ToBiasedHalfPairs(uint32_t w, uint32_t& p01,
                                                        uint32_t& p23) {
  const uint32_t x = w ^ 0x80808080u;  // code + 128, as unsigned bytes
  p01 = __byte_perm(x, 0x64646464u, 0x4140);
  p23 = __byte_perm(x, 0x64646464u, 0x4342);
}

// Four int8 codes (bytes 0..3 of w) as two pairs of T: p01 = (byte 0, byte 1), p23 = (2, 3).
template <typename T>
__device__ __forceinline__ void Int8x4ToPairs(uint32_t w, uint32_t& p01, uint32_t& p23) {
  if constexpr (std::is_same<T, __half>::value) {
    const __half2 bias = PairOf<__half2>(kInt8HalfBiasPair);
    Int8x4ToBiasedHalfPairs(w, p01, p23);
    p01 = HalfPairBits(__hsub2(PairOf<__half2>(p01), bias));
    p23 = HalfPairBits(__hsub2(PairOf<__half2>(p23), bias));
  } else {
    const uint32_t x = w ^ 0x80808080u;  // code + 128, as unsigned bytes
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

// Four float8 e4m3fn bytes of w as two pairs of T: p01 = (byte 0, byte 1), p23 = (2, 3). Every
// e4m3 value (NaN too) is exact in fp16 (the hardware's fp8x2 -> half2), and in bf16 through
// float32.
template <typename T>
__device__ __forceinline__ void Fp8x4ToPairs(uint32_t w, uint32_t& p01, uint32_t& p23) {
  const __half2 h01 = __half2(__nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3));
  const __half2 h23 = __half2(__nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3));
  if constexpr (std::is_same<T, __half>::value) {
    p01 = HalfPairBits(h01);
    p23 = HalfPairBits(h23);
  } else {
    p01 = HalfPairBits(__float22bfloat162_rn(__half22float2(h01)));
    p23 = HalfPairBits(__float22bfloat162_rn(__half22float2(h23)));
  }
}

// The product of two pairs of T (PER_TOKEN: value codes times their keys' scales), rounded to T.
template <typename T>
__device__ __forceinline__ uint32_t MulPairs(uint32_t a, uint32_t b) {
  if constexpr (std::is_same<T, __half>::value) {
    return HalfPairBits(__hmul2(PairOf<__half2>(a), PairOf<__half2>(b)));
  } else {
    return HalfPairBits(__hmul2(PairOf<__nv_bfloat162>(a), PairOf<__nv_bfloat162>(b)));
  }
}

}  // namespace cu
}  // namespace kvl
