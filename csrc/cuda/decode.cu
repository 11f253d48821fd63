// Token generation (and chunks of a few tokens) on tensor cores, fp16/bf16, sm_80 and newer.
//
// CTA = (key split, batch x kv head), 4 warps (8 in the wide instance). Its rows are the S x G
// (token, query head) rows of one KV group, at most 16: one m16 tile, so every K/V byte is read
// once per group and the scores and P V products run on mma.sync m16n8k16 (the CUDA-core form of
// this kernel was bound by its FMAs and shuffles, not by HBM). Each warp owns every fourth
// (eighth) KS-key step of the split and streams its own rows through DecStages cp.async stages:
// no CTA barrier inside the key loop. At the end the warps merge in shared memory, and with
// several splits the last CTAs to finish merge the splits through DecodeMergeTree (counters kept
// across calls and reset by their last arrival, or the workspace's zeroed by a memset before the
// launch): no combine kernel. On sm_90 a row's splits launched as one thread-block cluster merge
// through its shared memory instead.
//
// The kernel also does the prepare kernel's work for its rows (prepare_rows.cuh): each CTA
// norms, rotates and scales its group's queries itself, the CTA whose key split holds a new row
// appends it to the cache before it issues the loads that read it, and one grid row past the
// B x Nkv rows checks the lengths (LaunchDecodeTc adds it where the op keeps a length record).
// A decode step launches this kernel (plus the counters' memset where they are not kept across
// calls) instead of prepare + decode.
#include <algorithm>
#include <type_traits>

#include <cooperative_groups.h>
#include <cuda/atomic>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/prepare_rows.cuh"
#include "cuda/ptx.cuh"

namespace kvl {
namespace cu {
namespace {

// Build knob KVL_DECODE_STOP=n (benchmarking only; 0, the default, compiles nothing): the kernel
// ends after phase n (1: the lengths and the partition; 2: the prologue, its first loads landed;
// 3: the key loop; 4: the CTA's partial written; 5: the split merge's arrival, the cluster's first
// barrier or the last CTA's count at the first merge level, before the merge reads), keeping the
// work before it (a store that depends on it and is never taken). bench_cuda.py's kernel times
// of builds 1 to 5 against the normal one give each phase's share of a decode call's critical
// path (the output is garbage). bench/README.md says how.
#ifndef KVL_DECODE_STOP
#define KVL_DECODE_STOP 0
#endif
#define KVL_DECODE_STOP_AFTER(n, keep)                               \
  if constexpr (KVL_DECODE_STOP == (n)) {                            \
    ptx::CpAsyncWait<0>();                                           \
    if (keep) static_cast<T*>(buf.output)[0] = FromF<T>(0.0f);       \
    return;                                                          \
  }

// Build knob KVL_DECODE_TRACE=1 (benchmarking only; 0, the default, compiles nothing): the CTA that
// ends row 0's merge (the cluster's rank 0 with a cluster merge; with group clusters split 0 prints
// its cluster's merge as "cluster" and the row's last arrival the groups' as "cluster-tree")
// prints, per launch, the clock64 cycles of its phases from its own start: partial written, merge
// arrival, each merge level's weights and values; the one-level merges run twice (the second with
// the merge's code and data warm) to tell instruction fetch from data trips. Split 0, the last live
// split and the CTA that appends the new row print their prologue: the lengths landed, partition
// known, first steps issued, query fragments ready, first step landed. A mark taken with a value
// (`Mark(v)`) waits for it: the clock is read after an instruction that uses v. Each line is one
// printf (lines of CTAs printing at once do not interleave) and names its case (head size, rows, B
// x Nkv, live keys) so bench/trace_summary.py can group lines by case; it ends with the CTA's
// %globaltimer start. KVL_DECODE_TRACE=2 prints instead one line per CTA of row 0 (B x Nkv row 0,
// every split): its prologue marks, the cycles and the %globaltimer when its partial is written
// (before it arrives at a merge), so the CTA whose partial comes last can be named
// (bench/trace_summary.py); no merge lines, and no CTA prints before its own partial.
// bench/README.md says how.
#ifndef KVL_DECODE_TRACE
#define KVL_DECODE_TRACE 0
#endif
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
  // when it landed: review of the twelfth session). Every thread stores to one word: a race on
  // purpose, trace builds only.
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

// Warps of a decode CTA: four, or eight in the wide instance (kernels.h; the kernel's W).
constexpr int kDecWarpsOf4 = kDecodeCtaThreads / kWarp;
constexpr int kDecWideWarps = kDecodeWideCtaThreads / kWarp;
// The head tiles the wide instance is compiled for (DecodeTcWideServes): 128 and 64, the tiles of
// the shapes it was measured at (MakePlan says which calls take it, and the measurements); packed
// heads have their own eight-warp instance at tile 192 (DecodeKernelFor).
constexpr bool DecWideHd(int64_t hd) { return hd == 128 || hd == 64; }
static_assert(kDecodeRows % kDecWarpsOf4 == 0 && kDecodeRows % kDecWideWarps == 0,
              "each warp prepares kDecodeRows / warps rows");
static_assert(kDecodeRows == kRowsPerCta, "the plan sizes decode slots in kRowsPerCta rows");

// The tile width of a head size: rounded up to a multiple of 32 (padding columns are zero).
constexpr int64_t DecHeadDim(int64_t head_size) { return (head_size + 31) / 32 * 32; }
// Keys per warp step: 16 (one P V k-step) for wide heads, 32 for narrow ones, so a step moves
// 4 to 16 KB of K and V.
__host__ __device__ constexpr int DecKeys(int hd) { return hd <= 64 ? 32 : 16; }
// cp.async stages per warp, both in flight while the oldest is waited for (the next step is
// issued before the wait). Two, not three: 70 KB of stages at head size 128 (74 KB at 64) let
// three CTAs share an SM instead of two, and at many rows more CTAs at once read faster than
// more stages per warp (each CTA's reads are bounded by its loads in flight; on the H200,
// 28/4/128 B=8 L=4k 29.5 -> 26.8 us, 9/3/64 B=64 L=16k 211 -> 197: docs/BENCHMARKS.md, fourteenth
// session); a K-then-V issue order instead of K and V rows alternately changed nothing there.
// Build knob KVL_DECODE_STAGES=n (benchmarking only; 0, the default, keeps two): n stages for
// heads up to 128 (at most 2 above: three stages of four warps would not fit an sm_80 SM).
#ifndef KVL_DECODE_STAGES
#define KVL_DECODE_STAGES 0
#endif
static_assert(KVL_DECODE_STAGES == 0 || KVL_DECODE_STAGES >= 2, "KVL_DECODE_STAGES: 0 or >= 2");
__host__ __device__ constexpr int DecStages(int hd) {
  return KVL_DECODE_STAGES > 2 && hd <= 128 ? KVL_DECODE_STAGES : 2;
}
// Build knob KVL_DECODE_NO_PLAIN=1 (benchmarking only): every call runs the full instance.
#ifndef KVL_DECODE_NO_PLAIN
#define KVL_DECODE_NO_PLAIN 0
#endif
// Row pitch in elements: 16 bytes of padding put the 8 rows an ldmatrix reads on distinct banks.
__host__ __device__ constexpr int DecPitch(int hd) { return hd + 8; }
// K and V stage tiles at head sizes that are multiples of 64: rows of HD elements, unpadded, row
// j's 16-byte chunk c stored at chunk c ^ (j % 8), so the 8 rows an ldmatrix reads still fall on
// distinct banks and every 8 lanes of a copy write one aligned 128-byte line. With the padded
// pitch, a 16-byte cp.async of a warp wrote lines it shared with the next row: Nsight Compute
// counted 8 to 12 shared wavefronts per copy where 4 suffice and 24 L2 sectors per copy where
// 16 suffice (1.5x the bytes from L2 at 28/4/128 B=64 L=16k, 44 M requests against cuDNN's
// 17 M; H200, docs/BENCHMARKS.md, seventeenth session). Other head sizes keep the padded rows.
__host__ __device__ constexpr bool DecSwizzled(int hd) { return hd % 64 == 0; }
// The swizzled tiles' shared addresses are one XOR plus an immediate per copy or ldmatrix: every
// tile starts on a 128-byte boundary of the shared window (checked once per CTA) and a row is a
// whole number of 128-byte lines, so bits 4-6 of a chunk's address are its chunk index mod 8, and
// a lane's address for chunk position c ^ k is its address for c with those bits XORed by k.
// DecKvAt's form cost about 15 more instructions per warp step for the copies and about 45 for
// the ldmatrix addresses at head size 128; the XOR form measured 1% faster at the median of 28
// decode points and up to 5% at B=1 (H200, docs/BENCHMARKS.md, eighteenth session). Copying the
// padded tiles' row order instead (a warp-wide copy reading adjacent rows) measured no change,
// also at 9/3/64 kv_layout=1, whose gap it was meant to close.
// Element offset of (row j, column d) in a K or V stage tile of head dim HD.
template <int HD>
__device__ __forceinline__ int DecKvAt(int j, int d) {
  if constexpr (DecSwizzled(HD)) {
    return j * HD + ((((d >> 3) ^ (j & 7))) << 3) + (d & 7);
  } else {
    return j * DecPitch(HD) + d;
  }
}

// The slot a warp's stage ring leaves free until its key loop starts (slot ST - 1: the prologue
// fills slots 0 .. ST - 2) holds, before that: in warp 0's, the CTA's query tile (kDecodeRows
// rows of pitch DecPitch, at its start); in every warp's, at its end, the warp's raw query rows
// (kDecodeRows / warps x HD floats) then its float scratch (HD floats).
__host__ __device__ constexpr size_t DecSlotElems(int hd) {
  return size_t(2) * DecKeys(hd) * DecPitch(hd);
}
constexpr bool DecSlotHoldsPrologue(int hd, int warps) {  // fp16/bf16 elements (2 bytes)
  return kDecodeRows * DecPitch(hd) * 2 + (kDecodeRows / warps + 1) * hd * sizeof(float) <=
         DecSlotElems(hd) * 2;
}
static_assert(DecSlotHoldsPrologue(32, kDecWarpsOf4) && DecSlotHoldsPrologue(64, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(96, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(128, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(160, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(192, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(224, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(256, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(128, kDecWideWarps) &&
                  DecSlotHoldsPrologue(64, kDecWideWarps) &&
                  DecSlotHoldsPrologue(192, kDecWideWarps),
              "the query tile, raw rows and scratch fit one free stage slot");

// After the key loop: the warps' partials (red_o, rows of DecRedPitch floats), then the
// CTA's partial for a merge through the cluster's shared memory: kDecodeRows x hd values, then
// the rows' maxima and sums. The pitch puts the 8-byte fragment stores of a half warp (rows
// gq = 0..3, columns 2 tq) on 32 distinct banks: at a pitch of hd a warp's 8 rows fell on the
// same banks (ncu: 45% excess shared wavefronts in the kernel, tenth session).
__host__ __device__ constexpr int DecRedPitch(int hd) { return hd + 8; }
__host__ __device__ constexpr size_t DecClusterPartialOffset(int hd, int warps) {
  return size_t(warps) * kDecodeRows * DecRedPitch(hd);
}
// The global merge's copies of the slots' m and l: [slot][row] at this pitch (odd, so a warp
// reading one row's slots hits 32 banks).
constexpr int kDecMergeRowPitch = kDecodeRows + 1;
constexpr size_t DecSmemBytes(int hd, size_t elem, int warps) {
  const size_t stages = size_t(warps) * DecStages(hd) * DecSlotElems(hd) * elem;
  const size_t merge =
      sizeof(float) * (DecClusterPartialOffset(hd, warps) + kDecodeRows * (hd + 2));
  const size_t weights =
      sizeof(float) * (kDecodeRows * kMaxDecodeSplits + 2 * kMaxDecodeSplits * kDecMergeRowPitch);
  return std::max(stages, std::max(merge, weights));
}

// Thread-block clusters (sm_90): a barrier of every thread of the cluster that orders each
// CTA's shared-memory writes before it against the reads after it in the others, and the
// address of `p`'s counterpart in the shared memory of the cluster's CTA `rank`. The plan asks
// for a cluster launch only where the kernel was compiled for sm_90 or newer
// (DecodeTcClustersFit); code compiled for an older target traps rather than merge wrongly.
__device__ __forceinline__ void ClusterSync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}
__device__ __forceinline__ const float* ClusterPeer(const float* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  __trap();
  return p;
#endif
}

// acc += x * wt, one fused multiply-add per component: the arithmetic of every merge of
// partials here (warps, cluster, global), so their bits agree.
__device__ __forceinline__ void Fma4(float4& acc, const float4& x, float wt) {
  acc.x = fmaf(x.x, wt, acc.x);
  acc.y = fmaf(x.y, wt, acc.y);
  acc.z = fmaf(x.z, wt, acc.z);
  acc.w = fmaf(x.w, wt, acc.w);
}
// Four output values of a row, scaled and rounded to T.
template <typename T>
__device__ __forceinline__ void StoreScaled4(T* out, const float4& v, float sc) {
  out[0] = FromF<T>(v.x * sc);
  out[1] = FromF<T>(v.y * sc);
  out[2] = FromF<T>(v.z * sc);
  out[3] = FromF<T>(v.w * sc);
}

// K items (each a row's values d .. d + 3; the first k_items of them are real) of a merge of
// n <= N split partials, where load(k, sp, m, l, x) gives partial sp's maximum, sum and four
// values for item k: every load of every item is issued before any is used (one round trip to
// where the partials lie: the cluster's shared memory or L2), and an empty partial (weight 0)
// adds zeros through a select, not a skipped branch (the compiler sank a partial's load into
// such a branch, after the other loads had landed: docs/BENCHMARKS.md, nineteenth session). The
// arithmetic and its order are the staged global merge's (split order, l sums in WarpSum's
// butterfly), so the bits do not depend on which of them ran: the plan picks clusters from the
// capacity. Gives each item's weighted sum of the values in acc, the merge's maximum in mx and
// its sum in lsum.
template <int N, int K, typename Load>
__device__ __forceinline__ void MergeFewPartials(int n, int k_items, Load load, float4 (&acc)[K],
                                                 float (&mx)[K], float (&lsum)[K]) {
  static_assert(N >= 2 && N <= 16 && (N & (N - 1)) == 0, "WarpSum's butterfly over N lanes");
  float pm[K][N], pl[K][N];
  float4 px[K][N];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (k < k_items && sp < n) load(k, sp, pm[k][sp], pl[k][sp], px[k][sp]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    mx[k] = -INFINITY;
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (sp < n) mx[k] = fmaxf(mx[k], pm[k][sp]);
    }
    float lw[N] = {};  // l x weight of each split, 0 past the live ones
    acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 zero = acc[k];
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (sp >= n) continue;  // compile-time sp against the count: a predicate
      const float wt = PartialWeight(pm[k][sp], pl[k][sp], mx[k]);
      // An empty partial adds nothing, whatever it holds (no 0 x Inf): x = 0 and wt = 0 leave
      // acc as it is (it is never -0: it starts at +0 and a sum with +0 is +0), as a skip would.
      const bool empty = wt == 0.0f;
      const float4 x = empty ? zero : px[k][sp];
      lw[sp] = empty ? 0.0f : __fmul_rn(pl[k][sp], wt);  // never contracted: rounded once
      Fma4(acc[k], x, wt);
    }
    // WarpSum's butterfly (xor 16, 8, 4, 2, 1) over lanes holding lw[0 .. N-1], zeros
    // elsewhere: the steps above N add zeros (exact), then lane i adds lane i + w's sum.
#pragma unroll
    for (int w = N / 2; w >= 1; w /= 2) {
#pragma unroll
      for (int i = 0; i < w; ++i) lw[i] = __fadd_rn(lw[i], lw[i + w]);
    }
    lsum[k] = lw[0];
  }
}
// One item: load(sp, m, l, x).
template <int N, typename Load>
__device__ __forceinline__ float4 MergeFewPartials(int n, Load load, float& mx, float& lsum) {
  float4 acc[1];
  float m1[1], l1[1];
  MergeFewPartials<N, 1>(
      n, 1, [&](int, int sp, float& m, float& l, float4& x) { load(sp, m, l, x); }, acc, m1, l1);
  mx = m1[0];
  lsum = l1[0];
  return acc[0];
}

// Global merges of at most this many partials take MergeFewPartials' single trip per item
// rather than a staged weights pass and then the values (the two give the same bits for up to
// 32 partials: one l x weight per lane of the staged pass's WarpSum). Build knob
// KVL_DECODE_FEW_MERGE=n (benchmarking only; a power of two from 2 to 16, 8 by default).
#ifndef KVL_DECODE_FEW_MERGE
#define KVL_DECODE_FEW_MERGE 8
#endif
constexpr int kDecodeFewMerge = KVL_DECODE_FEW_MERGE;
// Build knob KVL_DECODE_FEW_PAIRS=0 (benchmarking only): one item per thread per trip always.
#ifndef KVL_DECODE_FEW_PAIRS
#define KVL_DECODE_FEW_PAIRS 1
#endif

// The grid's checker row (blockIdx.y == B x Nkv): the lengths of every (batch entry, token), as
// the prepare kernel checks them, one item per thread over the row's CTAs. A row of its own: the
// check on a working CTA (split 0 with a full cache) made that CTA's partial the last of its row
// in 12 of 14 launches at B=1 (KVL_DECODE_TRACE=2, docs/BENCHMARKS.md, thirteenth session), and
// moving it later in that CTA only moved the wait. Nothing waits on it (every kernel clamps what
// it reads), but the kernel ends with it: each of its threads takes B x S / (splits x 128) items
// one after another, each a chain of loads, so at thousands of batch entries with one split
// (short caches) it can outlast the working CTAs (reasoned in review, not measured; more checker
// rows would spread it).
template <int kDecThreads>
__device__ __forceinline__ void CheckLengthsRow(const GqaShape& s, const GqaCudaBuffers& buf) {
  const int64_t items = s.batch * s.seq_len;
  for (int64_t i = int64_t(blockIdx.x) * kDecThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kDecThreads) {
    CheckLengths(s, buf, i / s.seq_len, i % s.seq_len);
  }
}

// The plain instances of the kernel serve the calls that use none of the features below:
// DecodePlain, on the host, from the shape. Their shape says so as constants (PlainShape; the
// kernel reads an optional input only where the shape's flag says it exists), so every test of
// a feature folds away and the code on a CTA's path is shorter: a B=1 call is a prologue and a
// merge run once per CTA, whose code is fetched cold (43% of the warp samples waited for
// instructions: docs/BENCHMARKS.md, twelfth session; measured: thirteenth session). The
// arithmetic is the same code, with constants. A one-token call (S = 1, every decode step) takes
// the instance whose shape also says S = 1: a CTA's rows are then the group's heads of one
// token, and the per-row token arithmetic folds away (sm_90 SASS of the fp16 head size 128
// instance: 952 -> 698 instructions before the first copy of the key loop; twenty-third
// session, where a cold call at B=1 spent most of its time waiting for instructions).
__host__ __device__ inline bool DecodePlain(const GqaShape& s) {
  return KVL_DECODE_NO_PLAIN == 0 && !s.has_attention_bias && !(s.softcap > 0.0f) &&
         s.local_window < 0 && !s.sliding_window_cache && !s.has_head_sink && !s.smooth_softmax &&
         !s.has_q_norm && !s.has_k_norm && !s.has_query_seqlens && s.causal;
}
// Which instance serves a call: the full one, the plain one, or the plain one for one token;
// or, where the plan packs heads (GqaCudaPlan::decode_packed, DecodePackedServes), the plain one
// for one token with all kv heads of a batch entry in one CTA.
enum class DecodeForm : int { kFull, kPlain, kPlainOneToken, kPackedHeads };
__host__ __device__ inline DecodeForm DecodeFormOf(const GqaShape& s) {
  if (!DecodePlain(s)) return DecodeForm::kFull;
  return s.seq_len == 1 ? DecodeForm::kPlainOneToken : DecodeForm::kPlain;
}
__device__ __forceinline__ GqaShape PlainShape(GqaShape s, bool one_token) {
  if (one_token) s.seq_len = 1;
  s.has_attention_bias = false;
  s.softcap = 0.0f;
  s.local_window = -1;
  s.sliding_window_cache = false;
  s.has_head_sink = false;
  s.smooth_softmax = false;
  s.has_q_norm = false;
  s.has_k_norm = false;
  s.has_query_seqlens = false;
  s.causal = true;
  return s;
}
// W warps: four, or eight in the wide instance (DecWideHd, one token; packed heads at tile 192:
// DecodeKernelFor).
template <typename T, int HD, DecodeForm kForm, int W>
__global__ void __launch_bounds__(W * kWarp)
    DecodeTcKernel(GqaShape s_arg, GqaCudaBuffers buf, KvStrides present_st, int64_t splits,
                   int64_t split_target, int cluster, float* part_o, float* part_m, float* part_l,
                   unsigned* counters) {
  // Packed heads (kPack): a CTA serves every kv head of batch entry blockIdx.y. Seq-major rows of
  // one token's kv heads lie side by side, so its stage tiles hold whole token rows of HD = Nkv x
  // SH columns (SH = 64, the head size), read contiguously, where the per-head CTAs read 128-byte
  // rows Nkv x 128 bytes apart at different times (a DRAM cost: docs/BENCHMARKS.md, twenty-eighth
  // session). Its CTA rows are the Nkv x G query heads, row r of kv head r / G; Q K^T and P V run
  // once per kv head over that head's SH columns, each row keeping its own head's scores and its
  // own head's P V products (the others are computed and dropped, never added), so the
  // accumulators are SH wide and every row gets the per-head kernel's arithmetic, in its order.
  constexpr bool kPack = kForm == DecodeForm::kPackedHeads;
  constexpr int SH = kPack ? 64 : HD;  // columns of one head in the stage tiles
  static_assert(!kPack || (HD % SH == 0 && HD / SH <= kDecodeRows), "whole heads per tile");
  const GqaShape s = kForm == DecodeForm::kFull
                         ? s_arg
                         : PlainShape(s_arg, kForm == DecodeForm::kPlainOneToken || kPack);
  constexpr int kDecWarps = W, kDecThreads = W * kWarp;
  // The checker row (ptxas lays its code right after this branch whatever the source order or
  // a __builtin_expect says: the working CTAs jump over it once).
  if (blockIdx.y >= s.batch * (kPack ? 1 : s.kv_num_heads)) {
    CheckLengthsRow<kDecThreads>(s, buf);
    return;
  }
  constexpr int KS = DecKeys(HD), ST = DecStages(HD), P = DecPitch(HD);
  constexpr int NT = KS / 8;  // score n-tiles (8 keys each)
  constexpr int KT = HD / 16;   // k-steps of Q K^T over a stage tile
  constexpr int DTO = SH / 8;   // output n-tiles (8 dimensions each) of a row
  constexpr int KTQ = SH / 16;  // k-steps of a row's query
  constexpr int NH = HD / SH;   // heads per stage tile (1 but packed)
  extern __shared__ __align__(128) unsigned char dec_smem[];
  // The XOR address forms need the tiles on 128-byte boundaries (an invariant of the build:
  // dec_smem's alignment, so never taken).
  if (DecSwizzled(HD) && (ptx::SharedAddress(dec_smem) & 127u) != 0) __trap();
  __shared__ float red_m[kDecWarps][kDecodeRows], red_l[kDecWarps][kDecodeRows];
  __shared__ float row_scale[kDecodeRows];
  __shared__ float red_w[kDecWarps][kDecodeRows], row_m[kDecodeRows], row_l[kDecodeRows];
  __shared__ bool merges_splits;
  DecTrace trace, prologue_trace;  // the merge's marks; the prologue's (split 0, the appender)
  trace.Start();
  prologue_trace.Start();

  // Head and row indices in 32 bits (a 64-bit division is a called routine of tens of
  // instructions, and these were on every CTA's path to its first load, profiled at B=1).
  const int Gi = static_cast<int>(s.num_heads) / static_cast<int>(s.kv_num_heads);
  const int64_t H = s.head_size, G = Gi, N = s.num_heads;
  const int nkv = static_cast<int>(s.kv_num_heads);
  // <= kDecodeRows (the dispatch guarantees it)
  const int64_t rows = kPack ? nkv * G : s.seq_len * G;
  // bg: the grid row (batch entry x kv head, or the batch entry where packed), which owns the
  // merge's partial slots and counters. g: the kv head (0 where packed: the token rows' start).
  const int64_t bg = blockIdx.y, b = kPack ? bg : int(blockIdx.y) / nkv,
                g = kPack ? 0 : int(blockIdx.y) % nkv;
  // CTA row r (< kDecodeRows): token r / G, query head g * G + r % G.
  // r / G by a float reciprocal, not an integer division per row (about 17 instructions each,
  // on the path to the query loads): exact for r < kDecodeRows, since (r + 0.5) / G lies at
  // least 1 / (2 G) from an integer and the product is off by less than 2e-6.
  const float inv_g = __frcp_rn(static_cast<float>(Gi));
  // (Packed: one token, and row r is query head r.)
  auto row_tok = [&](int64_t r) -> int64_t {
    if constexpr (kPack) return 0;
    return static_cast<int>((static_cast<float>(r) + 0.5f) * inv_g);
  };
  auto row_head = [&](int64_t r) -> int64_t {
    if constexpr (kPack) return r;
    return g * G + static_cast<int>(r) - static_cast<int>(row_tok(r)) * Gi;
  };
  const int64_t split = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int gq = lane / 4, tq = lane % 4;  // fragment row group, thread in group
  // This warp's stages: [stage][K, V] tiles of KS x P elements, a tile's rows placed by DecKvAt
  // (a swizzled tile fills the first KS x HD). Its free slot (DecSlotElems) holds, until the key
  // loop, the query tile (warp 0's), the raw query rows of the warp and its float scratch.
  T* wsm = reinterpret_cast<T*>(dec_smem) + size_t(warp) * ST * DecSlotElems(HD);
  float* x = reinterpret_cast<float*>(wsm + ST * DecSlotElems(HD)) - HD;
  constexpr int QR = kDecodeRows / kDecWarps, QE = HD / kWarp;  // rows per warp, values per lane
  float* q_raw = x - QR * HD;                                     // [QR][HD]
  T* q_tile = reinterpret_cast<T*>(dec_smem) + (ST - 1) * DecSlotElems(HD);

  // The lengths first in the source (every later step waits on them; LoadNow, common.cuh), then
  // the raw queries of this warp's rows (r = warp + W j), whose addresses do not depend on them,
  // kept raw in registers: the partition and the first steps' copies go out before anything
  // waits on a query (a warp issues in order: a conversion or store of a query value here held
  // up the whole prologue until the query loads landed). (sm_80, not measured: ptxas spills 24
  // bytes at head size 224 and 4 at 128 with this prologue, 4 at one head size before it.)
  const EntryLengths lengths = ReadLengths<true>(s, buf, b);
  prologue_trace.Mark(lengths.seqlens_k);  // the lengths landed
  T qv[QR][QE];
#pragma unroll
  for (int j = 0; j < QR; ++j) {
    // Row 0's address for rows past S x G (never read): no branch around the address
    // arithmetic, whose block boundaries let the compiler sink the lengths load below them.
    const int64_t r = warp + j * kDecWarps, rr = r < rows ? r : 0;
    const T* src = TokenInputs<T>(s, buf, b, row_tok(rr)).q + row_head(rr) * H;
#pragma unroll
    for (int e = 0; e < QE; ++e) {
      const int64_t d = lane + e * kWarp;
      qv[j][e] = r < rows && d < H ? src[d] : FromF<T>(0.0f);
    }
  }
  const BatchGeometry geo = ClampedBatchGeometry(s, lengths.seqlens_k, lengths.query_len);
  auto row_keys = [&](int64_t r) {
    return r < rows ? QueryKeyRange(s, geo, row_tok(r)) : KeyRange{0, 0};
  };

  // Keys any row needs (rows of one token share a range), then this split's share of them,
  // partitioned here from the lengths on the device.
  int64_t key_lo = INT64_MAX, key_hi = 0;
  for (int64_t tok = 0; tok < s.seq_len; ++tok) {
    const KeyRange kr = QueryKeyRange(s, geo, tok);
    if (kr.lo < kr.hi) {
      key_lo = min(key_lo, kr.lo);
      key_hi = max(key_hi, kr.hi);
    }
  }
  int64_t k_begin = 0, k_end = 0, chunk = 1;
  if (key_lo < key_hi) {
    // In 32 bits (SplitChunk): live keys number at most 2^31 (int32 lengths), targets 256.
    using U = uint32_t;
    const U keys = static_cast<U>(key_hi - key_lo);
    const U target = DecodeMergeTree::SplitTarget<U>(split_target, keys, rows, H);
    chunk = SplitChunk<U>(keys, target, KS, kMinDecodeSplitKeys);
    k_begin = min(key_hi, key_lo + split * chunk);
    k_end = min(key_hi, k_begin + chunk);
  }
  // The splits that hold live keys are a prefix of the grid, the same in every CTA of the row
  // (the partition follows the live length; the capacity only sized the grid). Split 0 always
  // counts, so a row without live keys is still written. The others have no keys, no new row to
  // append (a row's owner holds its key) and a partial that would weigh exactly 0 in every
  // merge: they leave now, and the merges take the live prefix only (the same bits: an empty
  // partial adds nothing). With a large cache and a short sequence, most of the grid.
  // At most the launched splits (the plan sizes the grid for the most keys a row can hold):
  // clamped all the same, since a count above the grid would leave a counter kept across calls
  // non-zero and every later merge on the stream early.
  const int64_t live =
      min(splits, key_lo < key_hi ? int64_t(uint32_t(key_hi - key_lo + chunk - 1) / uint32_t(chunk))
                                  : int64_t(1));
  const bool extra = s.has_head_sink || s.smooth_softmax;
  auto out_row = [&](int64_t r) {  // output row of CTA row r
    return static_cast<T*>(buf.output) + ((b * s.seq_len + row_tok(r)) * N + row_head(r)) * H;
  };
  auto row_sink = [&](int64_t r) {
    return s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[row_head(r)]) : 0.0f;
  };
  prologue_trace.Mark(k_end ^ live);  // the partition known
  if constexpr (KVL_DECODE_TRACE != 0) {  // the case each trace line names
    const int64_t live_keys = key_lo < key_hi ? key_hi - key_lo : 0;
    trace.Case(static_cast<int>(H), rows, live_keys, s.batch * s.kv_num_heads);
    prologue_trace.Case(static_cast<int>(H), rows, live_keys, s.batch * s.kv_num_heads);
  }
  KVL_DECODE_STOP_AFTER(1, (k_begin ^ k_end ^ live) == 0x5a5a5a5a)
  if (split >= live) {
    return;  // in a cluster too: a CTA that exits no longer holds up the cluster's barriers
  }
  const int64_t steps = (k_end - k_begin + KS - 1) / KS;  // of the CTA; warp w takes w, w+W, ...
  const int64_t my_steps = steps > warp ? (steps - warp + kDecWarps - 1) / kDecWarps : 0;

  // Rows of this (batch, kv head): key j at base + (j - cache_base) * seq stride, in either
  // layout (cache_base: 0 unless a sliding window cache stages the rows, sliding.cu).
  const T* pk = static_cast<const T*>(buf.present_key) + present_st.Offset(b, g, 0);
  const T* pv = static_cast<const T*>(buf.present_value) + present_st.Offset(b, g, 0);
  const int64_t seq_stride = present_st.seq;
  const int64_t row_width = kPack ? nkv * H : H;  // elements of a stage row (packed: HD)
  const int chunks = static_cast<int>(row_width / 8);  // 16-byte chunks of a row (H % 8 == 0)
  constexpr int CPR = HD / 8;                  // chunk slots per row; those >= chunks are padding
  // A lane copies the same (row j, chunk c) slots of every step: j and c depend on the lane only.
  constexpr int kCopies = (KS * CPR + kWarp - 1) / kWarp;
  // Offsets inside a step in 32 bits: KS rows x the seq stride (<= kv heads x H, bounded by
  // CheckCudaSupport) fit, and the issue below is on every step's path (64-bit offset math was
  // a third of a short split's instructions, profiled at B=1).
  const int32_t stride32 = static_cast<int32_t>(seq_stride);
  // This warp's i-th step: its stage slot (in 32 bits: a warp's steps number below 2^27, and a
  // 64-bit modulo by the stage count was eight instructions on every step's path) and its first
  // key.
  auto step_slot = [&](int64_t i) { return wsm + (static_cast<int>(i) % ST) * DecSlotElems(HD); };
  auto step_key = [&](int64_t i) { return k_begin + (warp + i * kDecWarps) * KS; };
  auto issue = [&](int64_t i) {
    T* ks = step_slot(i);
    T* vs = ks + KS * P;
    const int64_t k0 = step_key(i);  // < k_end: a row of the cache
    const T* kstep = pk + (k0 - geo.cache_base) * seq_stride;
    const T* vstep = pv + (k0 - geo.cache_base) * seq_stride;
    const int rows_here = static_cast<int>(min(int64_t(KS), k_end - k0));
    // Every step but a split's last holds KS rows: its copies need no row test, zero-fill
    // operand or select, and their offsets from the lane's first copy are compile-time for the
    // shared side and one multiply-add for the global side (the predicated form below cost
    // about 11 instructions per 16-byte copy in the sm_90a SASS of head size 64; measured on the
    // H200: 1 to 8% less decode time, docs/BENCHMARKS.md, ninth session).
    if (kWarp % CPR == 0 && rows_here == KS) {
      // A lane copies chunk c = lane % CPR of rows lane / CPR + R it: one pointer per tensor,
      // advanced by R rows per copy (head sizes 32, 64, 128, 256; the others take the general
      // form below).
      constexpr int R = kWarp % CPR == 0 ? kWarp / CPR : 1;  // rows per warp-wide copy
      const int c = lane % CPR, j0 = lane / CPR;
      if constexpr (DecSwizzled(HD)) {
        // Swizzled tiles: a lane copies chunk c of RL consecutive rows from j0 RL on (RL is a
        // multiple of 8, so row j0 RL + it's chunk c lands at position c ^ it % 8: it known at
        // compile time, one XOR per copy); a warp-wide copy reads R rows RL apart, each whole.
        constexpr int RL = KS / R;
        static_assert(RL % 8 == 0, "rows per lane: whole swizzle periods");
        const int jb = j0 * RL;  // the lane's first row
        if (c < chunks) {
          const T* kg = kstep + jb * seq_stride + c * 8;
          const T* vg = vstep + jb * seq_stride + c * 8;
          const unsigned ka = ptx::SharedAddress(ks + jb * HD + c * 8);  // bits 4-6: c
#pragma unroll
          for (int it = 0; it < RL; ++it) {
            const unsigned a = (ka ^ unsigned((it & 7) << 4)) + unsigned(it * HD * 2);
            ptx::CpAsync16At(a, kg + it * seq_stride);
            ptx::CpAsync16At(a + unsigned(KS * P * 2), vg + it * seq_stride);
          }
        }
        return;
      }
      if (c < chunks) {
        const T* kg = kstep + j0 * seq_stride + c * 8;
        const T* vg = vstep + j0 * seq_stride + c * 8;
        const int64_t step_r = R * seq_stride;
        // V through kd + KS * P (vs's offset as an immediate), not a second pointer: one more
        // live register spilled at head size 128.
        T* kd = ks + j0 * P + c * 8;
#pragma unroll
        for (int it = 0; it < KS / R; ++it) {
          ptx::CpAsync16(kd + it * R * P, kg + it * step_r);
          ptx::CpAsync16(kd + KS * P + it * R * P, vg + it * step_r);
        }
      }
      return;
    }
#pragma unroll
    for (int it = 0; it < kCopies; ++it) {
      const int idx = lane + it * kWarp, j = idx / CPR, c = idx % CPR;  // compile-time divisor
      if (idx >= KS * CPR || c >= chunks) continue;
      const bool valid = j < rows_here;  // past the split's end: zero rows (row k0 is read)
      const int32_t off = valid ? j * stride32 + c * 8 : 0;
      ptx::CpAsync16(ks + DecKvAt<HD>(j, c * 8), kstep + off, valid);
      ptx::CpAsync16(vs + DecKvAt<HD>(j, c * 8), vstep + off, valid);
    }
  };
  // The new K/V rows of this kv head (positions past + i) are appended by the CTA whose split
  // reads them (split 0 takes the rows no split reads, a first prompt's padding); the other
  // CTAs never read them. That CTA first issues the steps that read old rows only, then appends
  // and waits for every warp's rows, then issues the rest: only the loads of new rows wait.
  const int64_t written = WrittenRows(s, geo);
  auto appends = [&](int64_t i) {
    const int64_t p = geo.past + i;
    // Its split: the one whose keys [k_begin, k_end) hold p (no division on the path).
    return (key_lo <= p && p < key_hi) ? (k_begin <= p && p < k_end) : split == 0;
  };
  bool appended = false;  // uniform over the CTA
  for (int64_t i = 0; i < written && !appended; ++i) appended = appends(i);
  // The appending CTA loads each warp's first new (token, kv head) rows now, raw, every slice at
  // once: they land while the first steps go out and the queries are stored. (Loaded in the
  // append, slice by slice, they made that CTA, the last of its cluster or merge at B = 1, 1,900
  // to 4,100 cycles late: docs/BENCHMARKS.md, thirtieth session.)
  constexpr int KE = (SH + kWarp - 1) / kWarp;  // values per lane of a head's row
  const int nh = kPack ? nkv : 1;               // kv heads a CTA appends
  const int64_t first_i = kPack ? warp / nh : warp;
  NewKvRow<T, KE> first_row;
  if (appended && first_i < written) {
    first_row.Load(s, buf, b, first_i, kPack ? warp % nh : g, lane);
  }
  auto reads_new_rows = [&](int i) { return appended && min(step_key(i) + KS, k_end) > geo.past; };
  int issued = 0;  // the first ST - 1 steps, each its own group (empty ones too: the wait
                   // below counts groups)
  for (; issued < ST - 1 && issued < my_steps && !reads_new_rows(issued); ++issued) {
    issue(issued);
    ptx::CpAsyncCommit();
  }
  // The raw queries to the warp's scratch rows: the first wait on their loads, now behind the
  // first steps' copies.
#pragma unroll
  for (int j = 0; j < QR; ++j) {
#pragma unroll
    for (int e = 0; e < QE; ++e) q_raw[j * HD + lane + e * kWarp] = ToF(qv[j][e]);
  }
  if (appended) {
    // Packed: the rows of every kv head, one (token, head) per warp in turn; the warp's first
    // was loaded above.
    for (int64_t ih = warp; ih < written * nh; ih += kDecWarps) {
      const int64_t i = kPack ? ih / nh : ih, hk = kPack ? ih % nh : g;
      if (!appends(i)) continue;
      NewKvRow<T, KE> row = first_row;
      if (ih != warp) row.Load(s, buf, b, i, hk, lane);
      AppendKvRow<T>(s, buf, present_st, geo, b, i, hk, ClampedRotaryPosition(s, buf, geo, b, i),
                     row, x, lane);
    }
    __syncthreads();  // every warp's rows before any warp's copies read them
  }
  for (; issued < ST - 1; ++issued) {
    if (issued < my_steps) issue(issued);
    ptx::CpAsyncCommit();
  }
  prologue_trace.Mark();  // the first steps issued (after the append, in the appending CTA)

  // The queries, while the first steps load: row r (token r / G, head g * G + r % G) normed,
  // rotated and scaled, rounded to T into the query tile (zeros past H, past S x G rows and for
  // tokens past query_seqlens, which are never read), then as A fragments in registers for the
  // whole kernel: rows gq and gq + 8.
#pragma unroll
  for (int j = 0; j < QR; ++j) {
    const int64_t r = warp + j * kDecWarps, tok = row_tok(r);
    T* qt = q_tile + r * P;
    if (r < rows && (s.is_first_prompt() || tok < geo.new_rows)) {
      float* qr = q_raw + j * HD;  // the warp's own row: normed and rotated in place
      __syncwarp();                // every lane's raw values before rotary pairs cross lanes
      NormRotate<T>(s, buf, true, ClampedRotaryPosition(s, buf, geo, b, tok), qr, lane);
      for (int64_t d = lane; d < SH; d += kWarp) qt[d] = FromF<T>(d < H ? qr[d] * s.scale : 0.0f);
    } else {
      for (int64_t d = lane; d < SH; d += kWarp) qt[d] = FromF<T>(0.0f);
    }
  }
  __syncthreads();
  uint32_t qa[KTQ][4];
#pragma unroll
  for (int kk = 0; kk < KTQ; ++kk) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = kk * 16 + (e / 2) * 8 + 2 * tq;
      qa[kk][e] = *reinterpret_cast<const uint32_t*>(q_tile + (gq + (e % 2) * 8) * P + d);
    }
  }
  __syncthreads();  // every warp holds its fragments: warp 0's free slot may take a step
  prologue_trace.Mark();  // the query tile in every warp's fragments
  KVL_DECODE_STOP_AFTER(2, qa[0][0] == 0x5a5a5a5au && qa[KTQ - 1][3] == 0xa5a5a5a5u)
  // Padding columns [row_width, HD) of every stage are zeroed once, now that no slot holds the
  // tile or a scratch row; the copies write columns [0, row_width) only.
  for (int64_t idx = lane; HD > row_width && idx < ST * 2 * KS * (HD - row_width); idx += kWarp) {
    const int row = static_cast<int>(idx / (HD - row_width));  // of the ST x {K, V} tiles
    wsm[(row / KS) * KS * P +
        DecKvAt<HD>(row % KS, static_cast<int>(row_width + idx % (HD - row_width)))] =
        FromF<T>(0.0f);
  }

  // This thread's two rows: their key ranges inside the split. Rows past S x G are idle: their
  // query is zero and they are never written, so they need no masks. With at most 8 rows, the
  // second row of every thread is idle and its softmax is skipped (a uniform branch).
  const bool idle[2] = {gq >= rows, gq + 8 >= rows};
  const bool upper = rows > 8;
  KeyRange kr[2] = {row_keys(gq), row_keys(gq + 8)};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    kr[hr].lo = max(kr[hr].lo, k_begin);
    kr[hr].hi = min(kr[hr].hi, k_end);
  }
  const T* bias = s.has_attention_bias ? static_cast<const T*>(buf.attention_bias) : nullptr;
  const bool raw_scores = !(s.softcap > 0.0f) && bias == nullptr;  // no softcap, no bias
  const float inv_softcap = s.softcap > 0.0f ? SoftcapInverse(s.softcap) : 0.0f;
  int64_t bias_row[2] = {0, 0};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t r = gq + hr * 8;
    if (bias != nullptr && r < rows) {
      const int64_t bb = s.bias_batch == 1 ? 0 : b, bh = s.bias_heads == 1 ? 0 : row_head(r);
      bias_row[hr] = ((bb * s.bias_heads + bh) * s.seq_len + row_tok(r)) * s.bias_total;
    }
  }

  // Packed: the kv heads of this thread's rows gq and gq + 8 (NH or more for idle rows: no
  // head's pass is theirs).
  const int head_lo = kPack ? gq / Gi : 0, head_hi = kPack ? (gq + 8) / Gi : 0;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DTO][4];
#pragma unroll
  for (int n = 0; n < DTO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  for (int64_t i = 0; i < my_steps; ++i) {
    // The slot of step i - 1 was read by every lane before the barrier closing that step, so
    // step i + ST - 1 goes into it before waiting: ST steps in flight during the wait.
    __syncwarp();
    if (i + ST - 1 < my_steps) issue(i + ST - 1);
    ptx::CpAsyncCommit();
    ptx::CpAsyncWait<ST - 1>();  // this lane's copies of step i have landed
    __syncwarp();                // ... and every lane's
    if constexpr (KVL_DECODE_TRACE != 0) {
      if (i == 0) {
        prologue_trace.Mark();  // warp 0's first step landed
        if (KVL_DECODE_TRACE == 1 && (split == 0 || appended || split == live - 1)) {
          prologue_trace.PrintPrologue(split, live, appended);
        }
      }
    }
    const T* ks = step_slot(i);
    const T* vs = ks + KS * P;
    const int64_t k0 = step_key(i);
    // Swizzled tiles: the lane's ldmatrix rows (K: keys (mi / 2) 8 + l, chunk mi % 2; V: keys
    // (mi % 2) 8 + l, chunk mi / 2; l = lane % 8) at chunk position (chunk ^ l), bits 4-6 of
    // these addresses (unused, and 0, with padded tiles).
    constexpr bool kXorAddr = DecSwizzled(HD);
    const int mi_l = lane / 8, l8 = lane % 8;
    const unsigned k_lane =
        kXorAddr ? ptx::SharedAddress(ks) +
                       unsigned((((mi_l / 2) * 8 + l8) * HD + (((mi_l % 2) ^ l8) << 3)) * 2)
                 : 0u;
    const unsigned v_lane =
        kXorAddr ? ptx::SharedAddress(vs) +
                       unsigned((((mi_l % 2) * 8 + l8) * HD + (((mi_l / 2) ^ l8) << 3)) * 2)
                 : 0u;

    // Q K^T per head: head hh's k-steps (kk of hh's SH columns) into hs_sc[hh]; each row keeps
    // its own head's (one head: sc itself).
    float hs_sc[NH][NT][4];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) hs_sc[hh][n][e] = 0.0f;
      }
    }
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      const int hh = kk / KTQ;
#pragma unroll
      for (int n = 0; n < NT; n += 2) {  // two key n-tiles per ldmatrix.x4
        uint32_t kb[4];
        const int mi = lane / 8;  // matrices: (keys n, d lo) (keys n, d hi) (n+8, lo) (n+8, hi)
        if constexpr (kXorAddr) {
          ptx::LdMatrixX4At(kb, (k_lane ^ unsigned(((2 * kk) & 7) << 4)) +
                                    unsigned((n * 8 * HD + ((2 * kk) & ~7) * 8) * 2));
        } else {
          ptx::LdMatrixX4(kb, ks + DecKvAt<HD>(n * 8 + (mi / 2) * 8 + lane % 8,
                                               kk * 16 + (mi % 2) * 8));
        }
        ptx::Mma16816<T>(hs_sc[hh][n], qa[kk % KTQ], kb[0], kb[1]);
        ptx::Mma16816<T>(hs_sc[hh][n + 1], qa[kk % KTQ], kb[2], kb[3]);
      }
    }
    float sc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[n][e] = hs_sc[0][n][e];
    }
#pragma unroll
    for (int hh = 1; hh < NH; ++hh) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if ((e < 2 ? head_lo : head_hi) == hh) sc[n][e] = hs_sc[hh][n][e];
        }
      }
    }

    // Masks, softcap, bias; the online softmax of rows gq (e = 0, 1) and gq + 8 (e = 2, 3). A
    // step inside the key range of every working row of the warp needs no masks.
    const bool whole =
        raw_scores &&
        __all_sync(0xffffffffu, (idle[0] || (kr[0].lo <= k0 && k0 + KS <= kr[0].hi)) &&
                                    (idle[1] || (kr[1].lo <= k0 && k0 + KS <= kr[1].hi)));
    float tmax[2];
    MaskStepScores<T, NT>(sc, tmax, whole, upper, k0, tq, kr, s, inv_softcap, bias, bias_row);
    float alpha[2] = {1.0f, 1.0f};
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      if (hr == 1 && !upper) continue;
      tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 1));
      tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 2));
      const float m_new = fmaxf(m[hr], tmax[hr]);
      alpha[hr] = m_new == -INFINITY ? 1.0f : __expf(m[hr] - m_new);  // 0 when m was -inf
      m[hr] = m_new;
    }
    float psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e / 2;
        if (hr == 1 && !upper) continue;  // idle rows: their P only reaches their own O
        const float p = !whole && sc[n][e] == -INFINITY ? 0.0f : __expf(sc[n][e] - m[hr]);
        sc[n][e] = p;
        psum[hr] += p;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) l[hr] = l[hr] * alpha[hr] + psum[hr];  // summed over tq at the end
#pragma unroll
    for (int n = 0; n < DTO; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
    }
    if (upper) {
#pragma unroll
      for (int n = 0; n < DTO; ++n) {
        o[n][2] *= alpha[1];
        o[n][3] *= alpha[1];
      }
    }

    // O += P V: P from the score registers (the C layout of two n-tiles is the A layout of one
    // k-step), V through ldmatrix.trans: the products of V's n-tiles [n0, n0 + DTO) into acc.
    auto pv = [&](float (&acc)[DTO][4], int n0) {
#pragma unroll
      for (int kk = 0; kk < KS / 16; ++kk) {
        uint32_t a[4];
        ptx::ScoresToA<T>(a, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
        for (int j = 0; j < DTO; j += 2) {  // two dimension n-tiles per ldmatrix.x4.trans
          const int n = n0 + j;
          uint32_t vb[4];
          // matrices: (keys lo, d n) (keys hi, d n) (lo, n+8) (hi, n+8)
          const int mi = lane / 8;
          if constexpr (kXorAddr) {
            ptx::LdMatrixX4TransAt(vb, (v_lane ^ unsigned((n & 7) << 4)) +
                                           unsigned((kk * 16 * HD + (n & ~7) * 8) * 2));
          } else {
            ptx::LdMatrixX4Trans(vb, vs + DecKvAt<HD>(kk * 16 + (mi % 2) * 8 + lane % 8,
                                                      n * 8 + (mi / 2) * 8));
          }
          ptx::Mma16816<T>(acc[j], a, vb[0], vb[1]);
          ptx::Mma16816<T>(acc[j + 1], a, vb[2], vb[3]);
        }
      }
    };
    if constexpr (!kPack) {
      pv(o, 0);
    } else {
      // Head hh's columns for every row into a copy of o, which only hh's rows keep: a row never
      // adds another head's products (0 x a non-finite value would reach it), and its own are
      // added to its o as the per-head kernel adds them.
#pragma unroll
      for (int hh = 0; hh < NH; ++hh) {
        float t[DTO][4];
#pragma unroll
        for (int n = 0; n < DTO; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) t[n][e] = o[n][e];
        }
        pv(t, hh * DTO);
#pragma unroll
        for (int n = 0; n < DTO; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if ((e < 2 ? head_lo : head_hi) == hh) o[n][e] = t[n][e];
          }
        }
      }
    }
  }

  // (Every accumulator feeds the kept store: keeping o[0] alone let the compiler drop the other
  // P V products: its phase 3 read short, docs/BENCHMARKS.md, tenth session.)
  KVL_DECODE_STOP_AFTER(3, [&] {
    float t = m[0] + l[0] + m[1] + l[1];
    for (int n = 0; n < DTO; ++n) t += o[n][0] + o[n][1] + o[n][2] + o[n][3];
    return t;
  }() == 1234.5f)
  // Merge the warps (fixed order: deterministic) in the stage memory: every copy has landed
  // (only empty groups can be pending) and every warp is past its last read of it.
  ptx::CpAsyncWait<0>();
  __syncthreads();
  constexpr int RP = DecRedPitch(HD);
  float* red_o = reinterpret_cast<float*>(dec_smem);  // [warp][row][RP]
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int r = gq + hr * 8;
    if (tq == 0) {
      red_m[warp][r] = m[hr];
      red_l[warp][r] = lt;
    }
#pragma unroll
    for (int n = 0; n < DTO; ++n) {
      const int d = n * 8 + 2 * tq;
      *reinterpret_cast<float2*>(red_o + (warp * kDecodeRows + r) * RP + d) =
          make_float2(o[n][2 * hr], o[n][2 * hr + 1]);
    }
  }
  __syncthreads();
  // Each row's maximum, the warps' weights and the row's sum, once per row (not again for
  // each of its values).
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) mx = fmaxf(mx, red_m[w][r]);
    float lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float wt = PartialWeight(red_m[w][r], red_l[w][r], mx);
      red_w[w][r] = wt;
      if (wt != 0.0f) lsum += red_l[w][r] * wt;
    }
    row_m[r] = mx;
    row_l[r] = lsum;
  }
  __syncthreads();

  // With a cluster launch (sm_90: the plan makes the row's splits one cluster) and a one-level
  // merge, the live splits merge through the cluster's shared memory: each CTA leaves its
  // partial in its own, and after a cluster barrier each merges a share of the output's values
  // from every live partial. No global partial, fence, counter or lone merging CTA on the row's
  // path (docs/BENCHMARKS.md, ninth session). The arithmetic and its order are the flat merge's
  // below (split order; the sums of the l's in WarpSum's tree), so the bits do not depend on
  // whether the plan launched clusters, which it decides from the capacity. With more live
  // splits than a cluster of kMaxDecodeCluster (the plan launches those for a shape class, not a
  // capacity: MakePlan), each cluster merges its group of the tree so into a group partial in
  // global memory, and the last CTA of the row to arrive merges the groups (a tree the same for
  // every capacity: DecodeMergeTree::For).
  const DecodeMergeTree tree = DecodeMergeTree::For(live, rows, H, cluster);
  const bool cluster_merge =
      cluster > 1 && live > 1 && (tree.groups == 1 ? live <= cluster : tree.group == cluster);
  // Partial slots of this (batch, kv head): one per launched split, then one per group of its
  // merge tree (DecodeMergeTree); slot k holds rows k * kDecodeRows + r.
  const int64_t slot_base = bg * DecodeMergeTree::SlotsPerRow(splits, rows, H, cluster);
  const int64_t slot0 = (slot_base + split) * kDecodeRows;
  // Four values of row r of group slot `dst`, columns d .. d + 3, with the row's m and l (the
  // cluster merge's and the few-partial merge's group partials).
  auto store_group_partial = [&](int64_t dst, int r, int d, const float4& acc, float mx,
                                 float lsum) {
    const int64_t at = (slot_base + dst) * kDecodeRows + r;
    *reinterpret_cast<float4*>(part_o + at * H + d) = acc;
    if (d == 0) {
      part_m[at] = mx;
      part_l[at] = lsum;
    }
  };
  static_assert(kMaxDecodeCluster >= 2 && kMaxDecodeCluster <= 16 &&
                    (kMaxDecodeCluster & (kMaxDecodeCluster - 1)) == 0,
                "a cluster of at most 16 CTAs (sm_90) whose l sums follow WarpSum's butterfly");
  float* cpart =  // [row][HD]
      reinterpret_cast<float*>(dec_smem) + DecClusterPartialOffset(HD, kDecWarps);
  float* cpart_m = cpart + kDecodeRows * HD;
  float* cpart_l = cpart_m + kDecodeRows;
  // The cluster's merge of its `members` live partials (ranks 0 .. members - 1) into the output
  // (dst < 0) or into group slot dst: each CTA takes a share of the items.
  auto cluster_values = [&](int members, int64_t dst) {
    const int hs4 = static_cast<int>(H / 4);
    // Rank in the cluster: split itself in a row's only cluster (split < splits == cluster <=
    // kMaxDecodeCluster), else split modulo the group clusters' kMaxDecodeCluster (a power of
    // two: a mask, not a 64-bit division on the merge's path).
    const int rank = static_cast<int>(split) % static_cast<int>(kMaxDecodeCluster);
    for (int idx = rank * kDecThreads + threadIdx.x; idx < rows * hs4;
         idx += members * kDecThreads) {
      const int r = idx / hs4, d = (idx % hs4) * 4;
      float mx, lsum;
      const float4 acc = MergeFewPartials<kMaxDecodeCluster>(
          members,
          [&](int sp, float& pm, float& pl, float4& px) {
            pm = *ClusterPeer(cpart_m + r, sp);
            pl = *ClusterPeer(cpart_l + r, sp);
            px = *reinterpret_cast<const float4*>(ClusterPeer(cpart + r * HD + d, sp));
          },
          mx, lsum);
      if (dst < 0) {
        StoreScaled4(out_row(r) + d, acc, OutputScale(mx, lsum, extra, row_sink(r)));
      } else {
        store_group_partial(dst, r, d, acc, mx, lsum);
      }
    }
  };
  auto merge_in_cluster = [&](int members, int64_t dst) {
    ClusterSync();  // every live split's partial is in its shared memory
    trace.Mark();
    KVL_DECODE_STOP_AFTER(5, false)
    cluster_values(members, dst);
    if constexpr (KVL_DECODE_TRACE != 0) {
      trace.Mark();
      cluster_values(members, dst);
      trace.Mark();
    }
    ClusterSync();  // no CTA leaves while another still reads its shared memory
    trace.Mark();
    if (split == 0) trace.Print("cluster", splits, live, tree.groups);
  };
  const int hs = static_cast<int>(H), nrows = static_cast<int>(rows);
  // Four values per thread: row r, columns d .. d + 3 (H % 8 == 0).
  constexpr int HD4 = SH / 4;
  for (int idx = threadIdx.x; idx < nrows * HD4; idx += kDecThreads) {
    const int r = idx / HD4, d = (idx % HD4) * 4;  // compile-time divisor
    if (d >= hs) continue;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float wt = red_w[w][r];
      if (wt == 0.0f) continue;  // an empty partial adds nothing (no 0 x Inf)
      const float4 x = *reinterpret_cast<const float4*>(red_o + (w * kDecodeRows + r) * RP + d);
      Fma4(acc, x, wt);
    }
    const float mx = row_m[r], lsum = row_l[r];
    if (live == 1) {  // the merge of this one partial (its weight is exp(0) = 1): the same bits
      const float sc = OutputScale(mx, lsum, extra, row_sink(r));
      T* out = out_row(r) + d;
      StoreScaled4(out, acc, sc);
      continue;
    }
    if (cluster_merge) {
      *reinterpret_cast<float4*>(cpart + r * HD + d) = acc;
      if (d == 0) {
        cpart_m[r] = mx;
        cpart_l[r] = lsum;
      }
      continue;
    }
    *reinterpret_cast<float4*>(part_o + (slot0 + r) * H + d) = acc;
    if (d == 0) {
      part_m[slot0 + r] = mx;
      part_l[slot0 + r] = lsum;
    }
  }
  if constexpr (KVL_DECODE_TRACE == 2) {  // every CTA of row 0, after its own partial
    prologue_trace.Arrive();
    prologue_trace.PrintPrologue(split, live, appended);
  }
  if (live == 1) return;
  trace.Mark();
  KVL_DECODE_STOP_AFTER(4, false)
  if (cluster_merge && tree.groups == 1) {
    merge_in_cluster(static_cast<int>(live), -1);
    return;
  }

  // Merges partial slots [first, first + n) of this (batch, kv head) into slot `dst` (a group
  // partial) or, with dst < 0, into the output. The whole CTA calls it. In split order
  // (deterministic); partials are read past L1 (ld.global.cg): other CTAs wrote them. The merge
  // is a chain of L2 round trips (about 0.4 to 0.6 us each on the H200, measured with
  // KVL_DECODE_TRACE), so it is built to take few: every (slot, row) m and l in one trip to
  // shared memory and each row's weights from there (the weights took two trips per row of a
  // warp before: 4.7k -> 3.2k cycles at 28/4/128 B=1 L=4k), then the values.
  float* weight = reinterpret_cast<float*>(dec_smem);  // [row][slot]; red_o is no longer read
  float* slot_m = weight + kDecodeRows * kMaxDecodeSplits;  // [slot][kDecMergeRowPitch]
  float* slot_l = slot_m + kMaxDecodeSplits * kDecMergeRowPitch;
  auto merge = [&](int64_t first, int64_t n, int64_t dst) {
    const int nn = static_cast<int>(n);
    if (nn <= kDecodeFewMerge) {
      // Few partials: each item's m, l and values in one trip (MergeFewPartials), no weights
      // pass of its own (a round trip, two barriers and the rows' reductions before the first
      // value load: 0.6 to 1.5 us less at B >= 8, H200, docs/BENCHMARKS.md, twentieth session).
      // Row r of slot k is element k * kDecodeRows + r of part_m and part_l, and row
      // k * kDecodeRows + r of part_o. Where a thread has two items (28/4/128 at four warps: 7 x
      // 128 / 4 = 224 items for 128 threads) and at most 4 partials, both items' loads go out
      // together: one trip, not two, in the registers of one item of 8 partials.
      const int64_t row0 = (slot_base + first) * kDecodeRows;
      const int items = nrows * hs / 4;
      auto merge_items = [&](auto few_n, auto k_n) {
        constexpr int FN = decltype(few_n)::value, K = decltype(k_n)::value;
        for (int idx0 = threadIdx.x; idx0 < items; idx0 += K * kDecThreads) {
          int r[K], d[K];
#pragma unroll
          for (int k = 0; k < K; ++k) {
            const int idx = idx0 + k * kDecThreads;
            r[k] = idx / (hs / 4);
            d[k] = (idx % (hs / 4)) * 4;
          }
          const int k_items = min(K, (items - idx0 + kDecThreads - 1) / kDecThreads);
          float4 acc[K];
          float mx[K], lsum[K];
          MergeFewPartials<FN, K>(
              nn, k_items,
              [&](int k, int sp, float& m_sp, float& l_sp, float4& x_sp) {
                const int64_t at = row0 + int64_t(sp) * kDecodeRows + r[k];
                m_sp = __ldcg(part_m + at);
                l_sp = __ldcg(part_l + at);
                x_sp = __ldcg(reinterpret_cast<const float4*>(part_o + at * H + d[k]));
              },
              acc, mx, lsum);
#pragma unroll
          for (int k = 0; k < K; ++k) {
            if (k >= k_items) break;
            if (dst < 0) {
              StoreScaled4(out_row(r[k]) + d[k], acc[k],
                           OutputScale(mx[k], lsum[k], extra, row_sink(r[k])));
            } else {
              store_group_partial(dst, r[k], d[k], acc[k], mx[k], lsum[k]);
            }
          }
        }
      };
      using One = std::integral_constant<int, 1>;
      using Two = std::integral_constant<int, 2>;
      if (KVL_DECODE_FEW_PAIRS != 0 && items > kDecThreads && nn <= kDecodeFewMerge / 2) {
        merge_items(std::integral_constant<int, kDecodeFewMerge / 2>(), Two());
      } else {
        merge_items(std::integral_constant<int, kDecodeFewMerge>(), One());
      }
      if constexpr (KVL_DECODE_TRACE != 0) {  // the trace's two marks: weights (none), values
        trace.Mark();
        __syncthreads();
        trace.Mark();
      }
      return;
    }
    {
      // Slot sp's row r is element sp * kDecodeRows + r of part_m / part_l: thread i takes
      // element i (rows past the CTA's are skipped), four per thread in flight.
      const float* gm = part_m + (slot_base + first) * kDecodeRows;
      const float* gl = part_l + (slot_base + first) * kDecodeRows;
      const int elems = nn * kDecodeRows;
      for (int i0 = threadIdx.x; i0 < elems; i0 += 4 * kDecThreads) {
        float mv[4], lv[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = i0 + u * kDecThreads;
          if (i < elems && i % kDecodeRows < nrows) {
            mv[u] = __ldcg(gm + i);
            lv[u] = __ldcg(gl + i);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = i0 + u * kDecThreads;
          if (i < elems && i % kDecodeRows < nrows) {
            const int at = (i / kDecodeRows) * kDecMergeRowPitch + i % kDecodeRows;
            slot_m[at] = mv[u];
            slot_l[at] = lv[u];
          }
        }
      }
    }
    __syncthreads();
    for (int r = warp; r < nrows; r += kDecWarps) {
      float mx = -INFINITY;
      for (int sp = lane; sp < nn; sp += kWarp) mx = fmaxf(mx, slot_m[sp * kDecMergeRowPitch + r]);
      mx = WarpMax(mx);
      float lsum = 0.0f;
      for (int sp = lane; sp < nn; sp += kWarp) {
        const float ls = slot_l[sp * kDecMergeRowPitch + r];
        const float wt = PartialWeight(slot_m[sp * kDecMergeRowPitch + r], ls, mx);
        weight[r * kMaxDecodeSplits + sp] = wt;
        if (wt != 0.0f) lsum += ls * wt;
      }
      lsum = WarpSum(lsum);
      if (lane == 0) {
        if (dst < 0) {
          row_scale[r] = OutputScale(mx, lsum, extra, row_sink(r));
        } else {
          part_m[(slot_base + dst) * kDecodeRows + r] = mx;
          part_l[(slot_base + dst) * kDecodeRows + r] = lsum;
        }
      }
    }
    __syncthreads();
    trace.Mark();
    // Four dimensions per thread (H % 8 == 0): one 16-byte load per partial, eight issued
    // before any is used (a skip test between the loads kept one in flight: +4 to 6 us at B=1).
    // Sixteen in flight, or two items' eight, measured slower (docs/BENCHMARKS.md, eleventh
    // session), and so did a whole chunk of partials staged through cp.async (eighteenth).
    for (int idx = threadIdx.x; idx < nrows * hs / 4; idx += kDecThreads) {
      const int r = idx / (hs / 4), d = (idx % (hs / 4)) * 4;
      const float* po = part_o + ((slot_base + first) * kDecodeRows + r) * H + d;
      const int64_t pitch = kDecodeRows * H;  // from one slot's row to the next
      const float* wr = weight + r * kMaxDecodeSplits;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      auto add = [&](const float4& x, float wt) {
        if (wt == 0.0f) return;  // an empty partial adds nothing, whatever it holds (no 0 x Inf)
        Fma4(acc, x, wt);
      };
      int64_t sp = 0;
      for (; sp + 8 <= n; sp += 8) {
        float4 x[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          x[u] = __ldcg(reinterpret_cast<const float4*>(po + (sp + u) * pitch));
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) add(x[u], wr[sp + u]);
      }
      for (; sp < n; ++sp) add(__ldcg(reinterpret_cast<const float4*>(po + sp * pitch)), wr[sp]);
      if (dst < 0) {
        T* out = out_row(r) + d;
        const float sc = row_scale[r];
        StoreScaled4(out, acc, sc);
      } else {
        *reinterpret_cast<float4*>(part_o + ((slot_base + dst) * kDecodeRows + r) * H + d) = acc;
      }
    }
    if constexpr (KVL_DECODE_TRACE != 0) {
      __syncthreads();
      trace.Mark();
    }
  };
  // True in the CTA that is the last of `count` to bump `counter`. The barrier orders every
  // thread's partial stores before thread 0's count, whose release (acq_rel, device scope) then
  // publishes them: fences are cumulative. In the last CTA the count's acquire and the barrier
  // after it order the others' partials before every thread's reads (the pattern of CUTLASS's
  // generic barrier; a __threadfence() per thread on both sides was a sequentially consistent
  // fence each, MEMBAR.SC.GPU). The last arrival returns the counter to zero (every CTA of this
  // launch that counts on it has counted), so counters kept across calls start the next launch
  // at zero.
  auto last_to_finish = [&](unsigned* counter, int64_t count) {
    __syncthreads();
    if (threadIdx.x == 0) {
      cuda::atomic_ref<unsigned, cuda::thread_scope_device> c(*counter);
      merges_splits = c.fetch_add(1u, cuda::memory_order_acq_rel) == unsigned(count - 1);
      if (merges_splits) c.store(0u, cuda::memory_order_relaxed);
    }
    __syncthreads();
    return merges_splits;
  };
  // Counters of this row's merge tree (`tree`, the same in each of its CTAs): counter 0 is the
  // top merge's, 1 + k group k's.
  unsigned* row_counters =
      counters + bg * DecodeMergeTree::CountersPerRow(splits, rows, H, cluster);
  if (cluster_merge) {
    // Group clusters: this cluster's group into its group partial; then every live CTA has
    // written its share and counts on counter 0, and the row's last arrival merges the groups
    // (the group counters are not used).
    const int64_t grp = split / kMaxDecodeCluster, first = grp * kMaxDecodeCluster;  // cluster
    merge_in_cluster(static_cast<int>(min(kMaxDecodeCluster, live - first)), splits + grp);
    KVL_DECODE_STOP_AFTER(5, false)  // merge_in_cluster's own stop leaves only its lambda
    if (!last_to_finish(row_counters, live)) return;
    trace.Mark();
    merge(splits, tree.groups, -1);
    trace.Print("cluster-tree", splits, live, tree.groups);
    return;
  }
  if (tree.groups == 1) {
    if (!last_to_finish(row_counters, live)) return;
    trace.Mark();
    KVL_DECODE_STOP_AFTER(5, false)
    merge(0, live, -1);
    if constexpr (KVL_DECODE_TRACE != 0) {
      merge(0, live, -1);  // the same merge again, its code and data warm (same output)
      trace.Print("flat", splits, live, 1);
    }
    return;
  }
  const int64_t grp = split / tree.group, first = grp * tree.group;
  const int64_t members = min(tree.group, live - first);
  if (!last_to_finish(row_counters + 1 + grp, members)) return;
  trace.Mark();
  KVL_DECODE_STOP_AFTER(5, false)
  // This CTA merges its group.
  merge(first, members, splits + grp);
  if (last_to_finish(row_counters, tree.groups)) {
    trace.Mark();
    merge(splits, tree.groups, -1);
    trace.Print("tree", splits, live, tree.groups);
  }
}

using DecodeFn = void (*)(GqaShape, GqaCudaBuffers, KvStrides, int64_t, int64_t, int, float*,
                          float*, float*, unsigned*);

template <typename T, int HD>
DecodeFn DecodeKernelOfForm(DecodeForm form) {
  switch (form) {
    case DecodeForm::kPlainOneToken:
      return DecodeTcKernel<T, HD, DecodeForm::kPlainOneToken, kDecWarpsOf4>;
    case DecodeForm::kPlain:
      return DecodeTcKernel<T, HD, DecodeForm::kPlain, kDecWarpsOf4>;
    default:
      return DecodeTcKernel<T, HD, DecodeForm::kFull, kDecWarpsOf4>;
  }
}

// The packed-heads instances' tiles: Nkv x 64 columns for 2 or 3 kv heads of head size 64
// (9/3/64, SmolLM2; 14/2/64, Qwen2.5-0.5B; the tiles of the shapes measured).
constexpr bool DecPackedTile(int64_t tile) { return tile == 128 || tile == 192; }

// The instance for a shape at `threads` per CTA and its shared memory, or null where none is
// compiled: four warps for every form and head tile; eight (the wide instance) only for the
// one-token plain form at head tiles 128 and 64 (DecWideHd), the class MakePlan gives them; the
// packed-heads form (`packed`) at four warps and tiles DecPackedTile, and at eight at tile 192
// (DecodePackedRule's instance; each instance adds to decode.cu's build, the slowest of the
// library's).
template <typename T>
DecodeFn DecodeKernelFor(const GqaShape& s, int threads, bool packed, size_t* smem) {
  *smem = 0;
  const DecodeForm form = DecodeFormOf(s);
  if (packed) {
    const int64_t tile = s.kv_num_heads * s.head_size;
    if (form != DecodeForm::kPlainOneToken || s.head_size != 64 || !DecPackedTile(tile) ||
        (threads != kDecodeCtaThreads && !(threads == kDecodeWideCtaThreads && tile == 192))) {
      return nullptr;
    }
    if (tile == 192 && threads == kDecodeWideCtaThreads) {
      *smem = DecSmemBytes(192, sizeof(T), kDecWideWarps);
      return DecodeTcKernel<T, 192, DecodeForm::kPackedHeads, kDecWideWarps>;
    }
    if (tile == 192) {
      *smem = DecSmemBytes(192, sizeof(T), kDecWarpsOf4);
      return DecodeTcKernel<T, 192, DecodeForm::kPackedHeads, kDecWarpsOf4>;
    }
    *smem = DecSmemBytes(128, sizeof(T), kDecWarpsOf4);
    return DecodeTcKernel<T, 128, DecodeForm::kPackedHeads, kDecWarpsOf4>;
  }
  const int64_t tile = DecHeadDim(s.head_size);
  if (threads == kDecodeWideCtaThreads) {
    if (form != DecodeForm::kPlainOneToken || !DecWideHd(tile)) return nullptr;
    if (tile == 128) {
      *smem = DecSmemBytes(128, sizeof(T), kDecWideWarps);
      return DecodeTcKernel<T, 128, DecodeForm::kPlainOneToken, kDecWideWarps>;
    }
    *smem = DecSmemBytes(64, sizeof(T), kDecWideWarps);
    return DecodeTcKernel<T, 64, DecodeForm::kPlainOneToken, kDecWideWarps>;
  }
  if (threads != kDecodeCtaThreads) return nullptr;
  switch (tile) {
#define KVL_DECODE_HD(hd)                                \
  case hd:                                               \
    *smem = DecSmemBytes(hd, sizeof(T), kDecWarpsOf4);   \
    return DecodeKernelOfForm<T, hd>(form);
    KVL_DECODE_HD(32)
    KVL_DECODE_HD(64)
    KVL_DECODE_HD(96)
    KVL_DECODE_HD(128)
    KVL_DECODE_HD(160)
    KVL_DECODE_HD(192)
    KVL_DECODE_HD(224)
    KVL_DECODE_HD(256)
#undef KVL_DECODE_HD
    default:
      return nullptr;
  }
}

DecodeFn DecodeKernelForShape(const GqaShape& s, int threads, bool packed, size_t* smem) {
  return s.dtype == DType::kFloat16 ? DecodeKernelFor<__half>(s, threads, packed, smem)
                                    : DecodeKernelFor<__nv_bfloat16>(s, threads, packed, smem);
}

}  // namespace

bool DecodeTcFits(const GqaShape& s, size_t elem, const CudaDeviceInfo& dev) {
  return DecSmemBytes(static_cast<int>(DecHeadDim(s.head_size)), elem, kDecWarpsOf4) <=
         size_t(dev.max_smem_optin);
}

bool DecodeTcWideServes(const GqaShape& s, const CudaDeviceInfo& dev, bool packed) {
  size_t smem = 0;
  return DecodeKernelForShape(s, kDecodeWideCtaThreads, packed, &smem) != nullptr &&
         smem <= size_t(dev.max_smem_optin);
}

bool DecodePackedServes(const GqaShape& s, const CudaDeviceInfo& dev) {
  size_t smem = 0;
  return s.layout == KvLayout::kSeqMajorBsnh && !s.sliding_window_cache &&
         s.kv_num_heads * s.group_size() <= kDecodeRows &&
         DecodeKernelForShape(s, kDecodeCtaThreads, true, &smem) != nullptr &&
         smem <= size_t(dev.max_smem_optin);
}

int DecodeTcActiveClusters(const GqaShape& s, const CudaDeviceInfo& dev, int64_t cluster,
                           int ctas_per_sm, int threads, bool packed) {
  size_t smem = 0;
  const DecodeFn fn = DecodeKernelForShape(s, threads, packed, &smem);
  if (fn == nullptr || dev.cc_major < 9 || cluster < 2 || cluster > kMaxDecodeCluster) {
    return 0;
  }
  const void* f = reinterpret_cast<const void*>(fn);
  // The code that runs on this device was compiled for sm_90 or newer (its PTX target: an
  // sm_80 build JIT-compiled for this GPU reports binary version 90 but has no cluster code),
  // and clusters of these CTAs fit the device.
  if (CachedPtxVersion(f) < 90 || !EnsureSmemLimit(f, smem).ok()) return 0;
  size_t launch_smem = smem;
  if (!SmemForCtasPerSm(f, threads, smem, ctas_per_sm, &launch_smem).ok() ||
      !EnsureSmemLimit(f, launch_smem).ok()) {
    return 0;
  }
  return CachedMaxActiveClusters(f, threads, launch_smem, static_cast<int>(cluster));
}
bool DecodeTcClustersFit(const GqaShape& s, const CudaDeviceInfo& dev, int64_t cluster,
                         int threads, bool packed) {
  return DecodeTcActiveClusters(s, dev, cluster, 0, threads, packed) > 0;
}

int DecodeTcCtasPerSm(const GqaShape& s, const CudaDeviceInfo& dev, int threads, bool packed) {
  size_t smem = 0;
  const DecodeFn fn = DecodeKernelForShape(s, threads, packed, &smem);
  if (fn == nullptr) return 1;
  const void* f = reinterpret_cast<const void*>(fn);
  if (!EnsureSmemLimit(f, smem).ok()) return 1;
  return CachedCtasPerSm(f, threads, smem);
}

template <typename T>
Status LaunchDecodeTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                      const AttnPlan& plan, const Workspace& ws, cudaStream_t stream) {
  size_t smem = 0;
  const int threads = plan.decode_threads;
  const DecodeFn fn = DecodeKernelFor<T>(s, threads, plan.decode_packed, &smem);
  if (fn == nullptr) {
    return Status::Error(
        "ai.kvlayout::GroupQueryAttention (CUDA): no decode instance for head_size " +
        std::to_string(s.head_size) + " at " + std::to_string(threads) + " threads per CTA" +
        (plan.decode_packed ? " with packed heads" : ""));
  }
  // Padded where the plan allows fewer CTAs per SM than fit (plan.decode_ctas_per_sm: with many
  // rows, or group clusters of one CTA per SM, ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS=3).
  KVL_RETURN_IF_ERROR(SmemForCtasPerSm(reinterpret_cast<const void*>(fn), threads, smem,
                                       plan.decode_ctas_per_sm, &smem));
  KVL_RETURN_IF_ERROR(EnsureSmemLimit(reinterpret_cast<const void*>(fn), smem));
  if (ws.counter_count > 0 && !ws.counters_zero) {  // a memset node under graph capture
    KVL_RETURN_IF_ERROR(CudaCheck(
        cudaMemsetAsync(ws.counters, 0, sizeof(unsigned) * ws.counter_count, stream),
        "decode counters memset"));
  }
  // One more row of CTAs checks the lengths where the op keeps a record (CheckLengthsRow): at
  // most 65535 rows (CheckCudaSupport bounds B x Nkv by 65534).
  const int64_t check_rows = buf.length_record != nullptr ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(DecodeGridRows(s, plan.decode_packed) + check_rows));
  const int cluster = static_cast<int>(plan.cluster);
  if (cluster > 1) {  // one cluster per row (plan.splits == cluster) or per group of its splits
    const ClusterLaunch launch(grid, dim3(threads), smem, stream, cluster);
    return CudaCheck(cudaLaunchKernelEx(&launch.config, fn, s, buf, present_st, plan.splits,
                                        plan.split_target, cluster, ws.part_o, ws.part_m,
                                        ws.part_l, ws.counters),
                     "decode launch (clusters)");
  }
  fn<<<grid, threads, smem, stream>>>(s, buf, present_st, plan.splits, plan.split_target, 0,
                                      ws.part_o, ws.part_m, ws.part_l, ws.counters);
  return CudaCheck(cudaGetLastError(), "decode launch");
}

template Status LaunchDecodeTc<__half>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                       const AttnPlan&, const Workspace&, cudaStream_t);
template Status LaunchDecodeTc<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                              const AttnPlan&, const Workspace&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
