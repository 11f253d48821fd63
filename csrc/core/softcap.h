// softcap: score = c * tanh(score / c), within float rounding of the exact value for every finite
// c > 0 (relative error ~2e-7 of the result). tanh(y) as 1 - 2 / (exp(2y) + 1) alone cancels for
// small |y|: its absolute error ~6e-8 becomes c * 6e-8 after the product (0.86 off ORT at
// c = 1e8), and a hardware tanh approximation (CUDA fast math) is off by ~5e-4 relative. Below
// |y| = 0.625 an odd polynomial y + y^3 P(y^2) (fitted to tanh on [0, 0.625], < 1 ulp) keeps the
// relative error; above, the exponential form no longer cancels. NaN stays NaN; x = +-inf gives
// +-c, as c * tanh(+-inf). The CPU kernels evaluate the same rule on vectors (gqa_cpu.cc).
#pragma once

#include <cmath>

#include "core/kv_strides.h"  // KVL_HOST_DEVICE

namespace kvl {

// P(z) = P0 + P1 z + P2 z^2 + P3 z^3 + P4 z^4, tanh(y) ~ y + y^3 P(y^2) for |y| < kSoftcapPolyLimit.
constexpr float kTanhP0 = -3.3333285220e-01f;
constexpr float kTanhP1 = 1.3331512665e-01f;
constexpr float kTanhP2 = -5.3744657902e-02f;
constexpr float kTanhP3 = 2.0653124519e-02f;
constexpr float kTanhP4 = -5.7189625645e-03f;
constexpr float kSoftcapPolyLimit = 0.625f;

// 1 / c, or 0 when that overflows (subnormal c): then y = x / c by a division.
KVL_HOST_DEVICE float SoftcapInverse(float c) {
  const float inv = 1.0f / c;
  return std::isfinite(inv) ? inv : 0.0f;
}

KVL_HOST_DEVICE float Softcap(float x, float c, float inv_c) {
  const float y = inv_c != 0.0f ? x * inv_c : x / c;
  const float z = y * y;
  if (!(z >= kSoftcapPolyLimit * kSoftcapPolyLimit)) {  // NaN takes the polynomial: stays NaN
    float p = kTanhP4;
    p = p * z + kTanhP3;
    p = p * z + kTanhP2;
    p = p * z + kTanhP1;
    p = p * z + kTanhP0;
    return (y + y * z * p) * c;
  }
  const float ay = y < 0.0f ? -y : y;
  const float big = 1.0f - 2.0f / (expf(ay + ay) + 1.0f);
  return (y < 0.0f ? -big : big) * c;
}

}  // namespace kvl
