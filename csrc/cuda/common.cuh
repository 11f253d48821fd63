// Device helpers shared by the CUDA kernel files: error checks, element conversions, warp
// reductions and the clamped per-batch geometry. Internal to csrc/cuda/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "core/kv_strides.h"
#include "core/softcap.h"
#include "cuda/gqa_cuda.h"

namespace kvl {
namespace cu {

// Whether every pointer is 16-byte aligned (null counts as aligned): the host's test before a
// kernel's 16-byte path.
inline bool Aligned16(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return bits % 16 == 0;
}

inline Status CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): ") + what + ": " +
                       cudaGetErrorString(err));
}

// ---- element conversions ---------------------------------------------------------------------
__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The two (or one, for float) elements of a 32-bit word of a row.
__device__ __forceinline__ float2 Unpack(uint32_t w, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 Unpack(uint32_t w, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

constexpr int kWarp = 32;
constexpr int kMaxHeadSize = 256;

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Batch entry b's length values as the inputs hold them (query_len 0 without query_seqlens).
struct EntryLengths {
  int32_t seqlens_k;
  int32_t query_len;
};
// A 32-bit global load in volatile asm, a strong one (relaxed, gpu scope: read at L2, not kept in
// L1), for the load a kernel's whole path waits on: NVVM does not sink it to its first use, as it
// did the decode kernel's lengths (after its sixteen query loads and their address arithmetic).
// ptxas still schedules it among independent loads (sm_90a: after ten of the sixteen; what moved
// it up was taking the branch out of the query address code, decode_prologue.cuh).
__device__ __forceinline__ int32_t LoadNow(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// kNow: the loads through LoadNow.
template <bool kNow = false>
__device__ __forceinline__ EntryLengths ReadLengths(const GqaShape& s, const GqaCudaBuffers& buf,
                                                    int64_t b) {
  if constexpr (kNow) {
    return {LoadNow(buf.seqlens_k + b), s.has_query_seqlens ? LoadNow(buf.query_seqlens + b) : 0};
  }
  return {buf.seqlens_k[b], s.has_query_seqlens ? buf.query_seqlens[b] : 0};
}

__device__ __forceinline__ BatchGeometry Geo(const GqaShape& s, const GqaCudaBuffers& buf,
                                             int64_t b) {
  const EntryLengths n = ReadLengths(s, buf, b);
  return ClampedBatchGeometry(s, n.seqlens_k, n.query_len);
}

__device__ __forceinline__ int64_t WrittenRows(const GqaShape& s, const BatchGeometry& g) {
  return s.is_first_prompt() ? s.seq_len : g.new_rows;  // a first prompt writes padding rows
}

// Keys per split: the live keys spread over `target` splits, in whole units, at least
// `min_keys` (a multiple of unit). Depends on the live length and the target only, so the
// partition (and the rounding) is the same whatever the capacity that sized the grid. In the
// integer type I the caller names: the decode kernel's uint32_t (key counts of int32 lengths),
// whose division is a few instructions where int64_t's is a called routine.
template <typename I>
__host__ __device__ __forceinline__ I SplitChunk(I keys, I target, I unit, I min_keys) {
  // keys + target - 1 for up to 2^31 keys: unsigned 32-bit or any 64-bit type.
  static_assert(std::is_unsigned<I>::value || sizeof(I) == 8, "SplitChunk: uint32_t or 64-bit");
  const I per = (keys + target - 1) / target;
  const I chunk = (per + unit - 1) / unit * unit;
  return chunk > min_keys ? chunk : min_keys;
}

}  // namespace cu
}  // namespace kvl
