// The tensor-core prefill kernel's sizes (prefill_sm80.cu) as pure constexpr arithmetic, shared
// with the plan rules (plan_rules.h); plain C++.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVL_TC_HD __host__ __device__
#else
#define KVL_TC_HD
#endif

namespace kvl {
namespace cu {

constexpr int kTcWarps = 4;
constexpr int kTcRows = 64;  // (token, head) rows per CTA: 4 warps x 16 rows

// Query tokens per CTA: every head of the KV group for each (G <= kTcRows, checked by the plan).
KVL_TC_HD constexpr int64_t TcTokens(int64_t group) { return kTcRows / group; }
// The tensor-core tile width of a head size: rounded up to a multiple of 32.
constexpr int64_t TcHeadDim(int64_t head_size) { return (head_size + 31) / 32 * 32; }
// Keys per tile: 64, or 32 for heads above 128 (their O accumulators take the registers).
KVL_TC_HD constexpr int TcKeys(int64_t hd) { return hd > 128 ? 32 : 64; }
// Row pitch of the shared tiles, in elements: 16 bytes of padding put the 8 rows an ldmatrix
// reads on distinct banks.
KVL_TC_HD constexpr int64_t TcPitch(int64_t hd) { return hd + 8; }
constexpr size_t TcSmemBytes(int64_t hd, size_t elem) {
  return elem * TcPitch(hd) * (kTcRows + 2 * 2 * TcKeys(hd));  // Q, and K + V in two stages
}

}  // namespace cu
}  // namespace kvl
