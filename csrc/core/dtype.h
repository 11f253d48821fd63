// Storage types of the op (float32, float16, bfloat16) and their exact conversions to and from
// float32. Kernels store in T and compute in float32. Also the codes of a quantized KV cache
// (ORT 1.32's rule, bit for bit: docs/CONTRACT.md section 13).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace kvl {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE binary16 -> binary32, exact (normals, subnormals, inf, nan).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return BitsToFloat(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp == 0) {
    if (mant == 0) return BitsToFloat(sign);
    // Subnormal: value = mant * 2^-24, exactly representable in float32.
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

// binary32 -> binary16 with round-to-nearest-even, overflow to inf, nan kept.
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatToBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) return sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520 -> inf
  if (abs < 0x38800000u) {                        // below the smallest normal half: subnormal
    // Adding 0.5 (2^-1) aligns the value so float rounding performs the half's RNE.
    const float shifted = BitsToFloat(abs) + 0.5f;
    return sign | static_cast<uint16_t>(FloatToBits(shifted) - 0x3f000000u);
  }
  const uint32_t mant_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) + round
  return sign | static_cast<uint16_t>(rounded >> 13);
}

inline float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

inline uint16_t FloatToBFloat16(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // nan
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float ToFloat(float v) { return v; }
inline float ToFloat(Half v) { return HalfToFloat(v.bits); }
inline float ToFloat(BFloat16 v) { return BFloat16ToFloat(v.bits); }

template <typename T>
inline T FromFloat(float v);
template <>
inline float FromFloat<float>(float v) {
  return v;
}
template <>
inline Half FromFloat<Half>(float v) {
  return Half{FloatToHalf(v)};
}
template <>
inline BFloat16 FromFloat<BFloat16>(float v) {
  return BFloat16{FloatToBFloat16(v)};
}

// ---- quantized KV cache codes (ORT's MLAS rule) --------------------------------------------
// A value x (float32, after rounding to T) is stored as q = clamp(rint(x * (1 / scale))), with
// round-half-even and q in [-128, 127] (int8) or [-8, 7] (int4); NaN saturates to the top
// (127 / 7), +-Inf to the ends. Read back as q * scale. A scale of 0 quantizes as 1 (ORT's guard;
// the op's validation refuses scales <= 0). int4 codes are stored biased, q + 8, two per byte:
// even channel in the low nibble, odd channel in the high one; an odd head_size pairs its last
// channel with q = 0 (nibble 8).
inline float QuantInverseScale(float scale) { return scale != 0.0f ? 1.0f / scale : 1.0f; }

// The clamp order is ORT's: std::min(hi, NaN) is hi.
inline int QuantizeCode(float x, float inv_scale, float lo, float hi) {
  const float q = std::rint(x * inv_scale);
  return static_cast<int>(std::max(lo, std::min(hi, q)));
}
inline int8_t QuantizeInt8(float x, float inv_scale) {
  return static_cast<int8_t>(QuantizeCode(x, inv_scale, -128.0f, 127.0f));
}
inline uint8_t Int4Nibble(float x, float inv_scale) {
  return static_cast<uint8_t>((QuantizeCode(x, inv_scale, -8.0f, 7.0f) + 8) & 0x0f);
}

// ---- float8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no inf; NaN = S.1111.111)
// Decoding, exact: |x| = 2^(e - 7) * (1 + m / 8), or m * 2^-9 when e == 0; an integer form
// ((8 | m) << e, or 2m) times 2^-10 that a compiler vectorizes (shifts, convert, selects).
inline float Fp8E4M3ToFloat(uint8_t b) {
  const int32_t e = (b >> 3) & 15, m = b & 7;
  const int32_t mag = e == 0 ? 2 * m : (8 | m) << e;
  const float v = static_cast<float>(mag) * 0x1p-10f;
  if ((b & 0x7f) == 0x7f) return std::numeric_limits<float>::quiet_NaN();
  return (b & 0x80) ? -v : v;
}

// Encoding with round-to-nearest-even, saturating: |x| >= 448 (and +-Inf) gives +-448, NaN gives
// NaN (0x7f with the sign), -0 gives 0x80.
inline uint8_t FloatToFp8E4M3(float x) {
  const uint32_t u = FloatToBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs_bits = u & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return sign | 0x7f;
  const float a = BitsToFloat(abs_bits);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < 0x1p-6f) {  // subnormal range: multiples of 2^-9 (a * 2^9 is exact), 8 -> 2^-6
    return sign | static_cast<uint8_t>(std::rint(a * 512.0f));
  }
  // Round float32's 23 mantissa bits to 3 (RNE, a carry moves to the exponent), rebias 127 -> 7.
  const uint32_t rounded = (abs_bits + 0x7ffffu + ((abs_bits >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - (120u << 3);
  return sign | static_cast<uint8_t>(code > 0x7eu ? 0x7eu : code);
}

// Static fp8 scales (PER_TENSOR / PER_CHANNEL): q = fp8(x * (1 / scale)), read q * scale.
inline uint8_t QuantizeFp8(float x, float inv_scale) { return FloatToFp8E4M3(x * inv_scale); }

// ---- PER_TOKEN (ai.kvlayout, docs/CONTRACT.md section 14) -----------------------------------
// One row x[0, H) (float32, after rounding to T): scale = amax / qmax (qmax 127 int8, 7 int4, 448
// fp8), codes as the static rule with inv = 1 / scale (0 when scale is 0). A row holding a NaN or
// an Inf gets scale NaN and codes 0 (it reads back NaN).
inline float PerTokenQMax(int64_t bits, bool fp8) { return fp8 ? 448.0f : (bits == 4 ? 7.0f : 127.0f); }

// The row's scale (NaN for a non-finite row); *inv gets what quantizing multiplies by.
inline float PerTokenScale(const float* x, int64_t n, float qmax, float* inv) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t d = 0; d < n; ++d) {
    const float a = std::fabs(x[d]);
    finite &= a <= std::numeric_limits<float>::max();  // false for Inf and NaN
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    *inv = 0.0f;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float scale = amax / qmax;
  *inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  return scale;
}

}  // namespace kvl
