// Thin wrappers over the PTX instructions the attention kernels are built from (sm_80+):
// cp.async (global -> shared without registers), ldmatrix (shared -> mma fragments) and
// mma.sync m16n8k16 with float accumulators. Fragment layouts are the PTX ISA's:
//   lane = 4 * g + t (g = lane / 4, t = lane % 4)
//   A (16 x 16, row-major) a0: (g, 2t..2t+1)  a1: (g+8, 2t..)  a2: (g, 2t+8..)  a3: (g+8, 2t+8..)
//   B (16 x 8, k x n)      b0: (2t..2t+1, g)  b1: (2t+8.., g)
//   C (16 x 8, float)      c0, c1: (g, 2t..2t+1)  c2, c3: (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace kvl {
namespace ptx {

__device__ __forceinline__ unsigned SharedAddress(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// The L2 prefetch size of cp.async (0: none; 128 or 256 bytes): on a miss of one 16-byte copy,
// L2 fetches the whole span from DRAM instead of the 32-byte sectors asked for. A tuning build
// knob; the default is the measured one (docs/DECISIONS.md, "cp.async L2 prefetch").
#ifndef KVL_CP_ASYNC_L2_PREFETCH
#define KVL_CP_ASYNC_L2_PREFETCH 128
#endif
#if KVL_CP_ASYNC_L2_PREFETCH == 256
#define KVL_CP_ASYNC_CG "cp.async.cg.shared.global.L2::256B"
#elif KVL_CP_ASYNC_L2_PREFETCH == 128
#define KVL_CP_ASYNC_CG "cp.async.cg.shared.global.L2::128B"
#elif KVL_CP_ASYNC_L2_PREFETCH == 0
#define KVL_CP_ASYNC_CG "cp.async.cg.shared.global"
#else
#error "KVL_CP_ASYNC_L2_PREFETCH must be 0, 128 or 256"
#endif

// The 128-byte line holding `p` into this SM's L1 (and the L2), without a register or a wait.
__device__ __forceinline__ void PrefetchL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// 16 bytes global -> shared.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src) {
  asm volatile(KVL_CP_ASYNC_CG " [%0], [%1], 16;\n" ::"r"(SharedAddress(smem_dst)), "l"(gmem_src)
               : "memory");
}
// 16 bytes global -> shared; `valid` false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile(KVL_CP_ASYNC_CG " [%0], [%1], 16, %2;\n" ::"r"(SharedAddress(smem_dst)),
               "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
// 4 bytes global -> shared (cp.async.ca: the only form below 16 bytes); `valid` false writes 4
// zero bytes and reads nothing.
__device__ __forceinline__ void CpAsync4(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(SharedAddress(smem_dst)),
               "l"(gmem_src), "r"(src_bytes)
               : "memory");
}
// 16 bytes global -> shared, the destination as a shared-window address.
__device__ __forceinline__ void CpAsync16At(unsigned smem_addr, const void* gmem_src) {
  asm volatile(KVL_CP_ASYNC_CG " [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");  // orders the reads after it
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row)));
}
// The same, each matrix transposed (lane 4g+t receives elements (2t, g) and (2t+1, g)).
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SharedAddress(row)));
}

// The same two, the row as a shared-window address.
__device__ __forceinline__ void LdMatrixX4At(uint32_t (&r)[4], unsigned row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr));
}
__device__ __forceinline__ void LdMatrixX4TransAt(uint32_t (&r)[4], unsigned row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row_addr));
}

// c += a * b, m16n8k16, float accumulators; T is __half or __nv_bfloat16.
#define KVL_MMA16816(AB)                                                                       \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, "    \
               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                             \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void Mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same<T, __half>::value) {
    KVL_MMA16816("f16");
  } else {
    static_assert(std::is_same<T, __nv_bfloat16>::value, "mma.sync: fp16 or bf16");
    KVL_MMA16816("bf16");
  }
}
#undef KVL_MMA16816

// Two floats as one 32-bit pair of T, `lo` in the low half (the smaller column index).
template <typename T>
__device__ __forceinline__ uint32_t PackPair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t PackPair<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t PackPair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The C fragments of two adjacent 8-column n-tiles of m16n8k16 (`lo`: columns 0-7, `hi`: 8-15),
// rounded to T, as the A fragment of one 16-deep k-step: the C layout of a score tile is the A
// layout of P in P V, so softmax weights go to the next MMA without shared memory.
template <typename T>
__device__ __forceinline__ void ScoresToA(uint32_t (&a)[4], const float (&lo)[4],
                                          const float (&hi)[4]) {
  a[0] = PackPair<T>(lo[0], lo[1]);
  a[1] = PackPair<T>(lo[2], lo[3]);
  a[2] = PackPair<T>(hi[0], hi[1]);
  a[3] = PackPair<T>(hi[2], hi[3]);
}

}  // namespace ptx
}  // namespace kvl
