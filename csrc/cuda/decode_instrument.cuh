// The decode kernel's instrumentation: two diagnostic build knobs, both 0 (compiled to nothing)
// in product builds. Every hook the kernel calls is defined here; bench/README.md says how to
// build and read them.
//
// KVL_DECODE_STOP=n: the kernel ends after phase n (1: the lengths and the partition; 2: the
// prologue, its first loads landed; 3: the key loop; 4: the CTA's partial written; 5: the split
// merge's arrival, the cluster's first barrier or the last CTA's count at the first merge level,
// before the merge reads), keeping the work before it (a store that depends on it and is never
// taken). Kernel times of builds 1 to 5 against the normal one give each phase's share of a
// decode call's critical path (the output is garbage).
//
// KVL_DECODE_TRACE=1: the CTA that ends row 0's merge (the cluster's rank 0 with a cluster merge;
// with group clusters split 0 prints its cluster's merge as "cluster" and the row's last arrival
// the groups' as "cluster-tree") prints, per launch, the clock64 cycles of its phases from its
// own start: partial written, merge arrival, each merge level's weights and values; the one-level
// merges run twice (the second with the merge's code and data warm) to tell instruction fetch
// from data trips. Split 0, the last live split and the CTA that appends the new row print their
// prologue: the lengths landed, partition known, first steps issued, query fragments ready,
// first step landed. A mark taken with a value (`Mark(v)`) waits for it: the clock is read after
// an instruction that uses v. Each line is one printf (lines of CTAs printing at once do not
// interleave) and names its case (head size, rows, B x Nkv, live keys) so
// tools/perf/trace_summary.py can group lines by case; it ends with the CTA's %globaltimer start.
// KVL_DECODE_TRACE=2 prints instead one line per CTA of row 0 (every split): its prologue marks,
// the cycles and the %globaltimer when its partial is written (before it arrives at a merge), so
// the CTA whose partial comes last can be named; no merge lines.
#pragma once

#include <cstdint>
#include <cstdio>

#include "cuda/ptx.cuh"

#ifndef KVL_DECODE_STOP
#define KVL_DECODE_STOP 0
#endif
#ifndef KVL_DECODE_TRACE
#define KVL_DECODE_TRACE 0
#endif

// In a phase of the decode kernel (a member returning whether the CTA goes on): ends the CTA
// after phase n in a KVL_DECODE_STOP=n build, keeping the work `keep` depends on.
#define KVL_DECODE_STOP_AFTER(n, keep)                               \
  if constexpr (KVL_DECODE_STOP == (n)) {                            \
    ptx::CpAsyncWait<0>();                                           \
    if (keep) static_cast<T*>(buf.output)[0] = FromF<T>(0.0f);       \
    return false;                                                    \
  }

namespace kvl {
namespace cu {

constexpr bool kDecodeTrace = KVL_DECODE_TRACE != 0;

struct DecTrace {
#if KVL_DECODE_TRACE
  static constexpr int kMarks = 10;
  long long c[kMarks];
  int n = 0;
  int hd = 0, rows = 0, keys = 0, bg = 0;  // bg: B x Nkv (the grid has a checker row more)
  __device__ __forceinline__ void Mark() {
    if (n < kMarks) c[n++] = clock64();
  }
  // The clock read after an instruction that uses v: a volatile shared store of it (an empty asm
  // with v as input emitted nothing, and the clock was read when a load of v was issued, not
  // when it landed). Every thread stores to one word: a race on purpose, trace builds only.
  template <typename V>
  __device__ __forceinline__ void Mark(V v) {
    __shared__ unsigned trace_sink;
    *reinterpret_cast<volatile unsigned*>(&trace_sink) = static_cast<unsigned>(v);
    Mark();
  }
  unsigned long long start_ns = 0;  // %globaltimer at the first mark: CTAs against each other
  unsigned long long end_ns = 0;    // %globaltimer at Arrive (0 without)
  long long partial = -1;           // cycles from the start to Arrive
  __device__ __forceinline__ void Start() {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start_ns));
    Mark();
  }
  __device__ __forceinline__ void Arrive() {  // this CTA's partial is written
    partial = clock64() - c[0];
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(end_ns));
  }
  __device__ void Case(int head_dim, int64_t cta_rows, int64_t live_keys, int64_t bg_rows) {
    hd = head_dim;
    rows = int(cta_rows);
    keys = int(live_keys);
    bg = int(bg_rows);
  }
  __device__ long long At(int i) const { return i < n ? c[i] - c[0] : -1; }
  // KVL_TRACE <what> hd=.. rows=.. bg=.. keys=.. <k1>=.. live=.. <k3>=.. cycles c1 .. c9
  // start_ns=.. end_ns=.. partial=.. (-1 for marks not taken).
  __device__ void Line(const char* what, const char* k1, int v1, int live, const char* k3,
                       int v3) const {
    if (threadIdx.x != 0 || blockIdx.y != 0) return;
    printf("KVL_TRACE %s hd=%d rows=%d bg=%d keys=%d %s=%d live=%d %s=%d cycles %lld %lld %lld "
           "%lld %lld %lld %lld %lld %lld start_ns=%llu end_ns=%llu partial=%lld\n",
           what, hd, rows, bg, keys, k1, v1, live, k3, v3, At(1), At(2), At(3), At(4),
           At(5), At(6), At(7), At(8), At(9), start_ns, end_ns, partial);
  }
  __device__ void Print(const char* what, int64_t splits, int64_t live, int64_t groups) const {
    if (KVL_DECODE_TRACE != 1) return;  // the merge's lines
    Line(what, "splits", int(splits), int(live), "groups", int(groups));
  }
  __device__ void PrintPrologue(int64_t split, int64_t live, bool appends) const {
    Line(KVL_DECODE_TRACE == 1 ? "prologue" : "cta", "split", int(split), int(live), "appends",
         int(appends));
  }
#else
  __device__ __forceinline__ void Mark() {}
  template <typename V>
  __device__ __forceinline__ void Mark(V) {}
  __device__ __forceinline__ void Start() {}
  __device__ __forceinline__ void Arrive() {}
  __device__ __forceinline__ void Case(int, int64_t, int64_t, int64_t) {}
  __device__ __forceinline__ void PrintPrologue(int64_t, int64_t, bool) const {}
  __device__ __forceinline__ void Print(const char*, int64_t, int64_t, int64_t) const {}
#endif
};

}  // namespace cu
}  // namespace kvl
