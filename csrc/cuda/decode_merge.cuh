// The decode CTA's merges: its warps' partials in shared memory (MergeWarps), then the row's
// live splits (MergeSplits): through a thread-block cluster's shared memory (sm_90), or through
// global partials merged by the last CTA to finish, in a tree of at most two levels
// (DecodeMergeTree). No combine kernel. Every path uses online_softmax.cuh's arithmetic in split
// order, so the bits do not depend on which path the plan chose.
#pragma once

#include <cooperative_groups.h>
#include <cuda/atomic>

#include <type_traits>

#include "cuda/decode_cta.cuh"

namespace kvl {
namespace cu {

// Thread-block clusters (sm_90): a barrier of every thread of the cluster that orders each
// CTA's shared-memory writes before it against the reads after it in the others, and the
// address of `p`'s counterpart in the shared memory of the cluster's CTA `rank`. The plan asks
// for a cluster launch only where the kernel was compiled for sm_90 or newer; code compiled for
// an older target traps rather than merge wrongly.
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

// Global merges of at most this many partials take MergeFewPartials' single trip per item
// rather than a staged weights pass and then the values (the two give the same bits for up to
// 32 partials: one l x weight per lane of the staged pass's WarpSum).
constexpr int kDecodeFewMerge = 8;

// The warps' partials (fixed order: deterministic) merged in the stage memory, then the CTA's:
// into the output (one live split), the cluster's shared memory or its global partial slot.
// False: nothing is left to merge.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::MergeWarps() {
  Shared& sh = Sh();
  // Every copy has landed (only empty groups can be pending) and every warp is past its last
  // read of the stages.
  ptx::CpAsyncWait<0>();
  __syncthreads();
  float* red_o = reinterpret_cast<float*>(dec_smem);  // [warp][row][RP]
  // A cache of codes: V's static scale of each of the lane's columns (in the key loop's order,
  // QuantVDim), read once for both of its rows; 1 under PER_TOKEN, whose scales the key loop
  // applied to the value fragments (o x 1 is o, bit for bit). The lane's columns c DTO + n are
  // 2 DTO consecutive channels from QuantVDim(0, 2 tq): one base address and immediate offsets.
  // Read per value, the scales made this phase 3.3x fp16's code (1,779 instructions against 534,
  // sm_90a, head size 128, eight warps), which every CTA fetches cold; now 700.
  float vs[kQuant ? DTO : 1][2];
  if constexpr (kQuant) {
    const bool channel = !s.per_token() && s.v_quant == KvQuant::kPerChannel;
    const float* vp = buf.v_scale + (channel ? g * H + QuantVDim(0, 2 * tq) : 0);
    const float tensor = s.per_token() ? 1.0f : channel ? 0.0f : vp[0];
#pragma unroll
    for (int n = 0; n < DTO; ++n) {
#pragma unroll
      for (int c = 0; c < 2; ++c) vs[n][c] = channel ? vp[c * DTO + n] : tensor;
    }
  }
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float lt = QuadSum(l[hr]);
    const int r = gq + hr * 8;
    if (tq == 0) {
      sh.red_m[warp][r] = m[hr];
      sh.red_l[warp][r] = lt;
    }
    if constexpr (kQuant) {
      // Columns in the key loop's order (QuantVDim), V's scales applied (a cache of codes).
#pragma unroll
      for (int n = 0; n < DTO; ++n) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          red_o[(warp * kDecodeRows + r) * RP + QuantVDim(n, 2 * tq + c)] =
              o[n][2 * hr + c] * vs[n][c];
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < DTO; ++n) {
        const int d = n * 8 + 2 * tq;
        *reinterpret_cast<float2*>(red_o + (warp * kDecodeRows + r) * RP + d) =
            make_float2(o[n][2 * hr], o[n][2 * hr + 1]);
      }
    }
  }
  __syncthreads();
  // Each row's maximum, the warps' weights and the row's sum, once per row (not again for each
  // of its values).
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) mx = fmaxf(mx, sh.red_m[w][r]);
    float lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float wt = PartialWeight(sh.red_m[w][r], sh.red_l[w][r], mx);
      sh.red_w[w][r] = wt;
      if (wt != 0.0f) lsum += sh.red_l[w][r] * wt;
    }
    sh.row_m[r] = mx;
    sh.row_l[r] = lsum;
  }
  __syncthreads();

  // With a cluster launch (sm_90: the plan makes the row's splits one cluster) and a one-level
  // merge, the live splits merge through the cluster's shared memory: each CTA leaves its
  // partial in its own, and after a cluster barrier each merges a share of the output's values
  // from every live partial. No global partial, fence, counter or lone merging CTA on the row's
  // path. With more live splits than a cluster of kMaxDecodeCluster (the plan launches those for
  // a shape class, not a capacity), each cluster merges its group of the tree into a group
  // partial in global memory, and the last CTA of the row to arrive merges the groups.
  tree = DecodeMergeTree::For(live, rows, H, cluster);
  cluster_merge =
      cluster > 1 && live > 1 && (tree.groups == 1 ? live <= cluster : tree.group == cluster);
  // Partial slots of this (batch, kv head): one per launched split, then one per group of its
  // merge tree (DecodeMergeTree); slot k holds rows k * kDecodeRows + r.
  slot_base = bg * DecodeMergeTree::SlotsPerRow(splits, rows, H, cluster);
  slot0 = (slot_base + split) * kDecodeRows;
  static_assert(kMaxDecodeCluster >= 2 && kMaxDecodeCluster <= 16 &&
                    (kMaxDecodeCluster & (kMaxDecodeCluster - 1)) == 0,
                "a cluster of at most 16 CTAs (sm_90) whose l sums follow WarpSum's butterfly");
  cpart = reinterpret_cast<float*>(dec_smem) + DecClusterPartialOffset(HD, kDecWarps);  // [row][HD]
  cpart_m = cpart + kDecodeRows * HD;
  cpart_l = cpart_m + kDecodeRows;
  hs = static_cast<int>(H);
  nrows = static_cast<int>(rows);
  // Four values per thread: row r, columns d .. d + 3 (H % 8 == 0).
  for (int idx = threadIdx.x; idx < nrows * HD4; idx += kDecThreads) {
    const int r = idx / HD4, d = (idx % HD4) * 4;  // compile-time divisor
    if (d >= hs) continue;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float wt = sh.red_w[w][r];
      if (wt == 0.0f) continue;  // an empty partial adds nothing (no 0 x Inf)
      const float4 xw = *reinterpret_cast<const float4*>(red_o + (w * kDecodeRows + r) * RP + d);
      Fma4(acc, xw, wt);
    }
    const float mx = sh.row_m[r], lsum = sh.row_l[r];
    if (live == 1) {  // the merge of this one partial (its weight is exp(0) = 1): the same bits
      const float sc = OutputScale(mx, lsum, extra, RowSink(r));
      T* out = OutRow(r) + d;
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
  if (live == 1) return false;
  trace.Mark();
  KVL_DECODE_STOP_AFTER(4, false)
  return true;
}

// Four values of row r of group slot `dst`, columns d .. d + 3, with the row's m and l (the
// cluster merge's and the few-partial merge's group partials).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::StoreGroupPartial(
    int64_t dst, int r, int d, const float4& acc, float mx, float lsum) {
  const int64_t at = (slot_base + dst) * kDecodeRows + r;
  *reinterpret_cast<float4*>(part_o + at * H + d) = acc;
  if (d == 0) {
    part_m[at] = mx;
    part_l[at] = lsum;
  }
}

// The cluster's merge of its `members` live partials (ranks 0 .. members - 1) into the output
// (dst < 0) or into group slot dst: each CTA takes a share of the items.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::ClusterValues(int members,
                                                                          int64_t dst) {
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
      StoreScaled4(OutRow(r) + d, acc, OutputScale(mx, lsum, extra, RowSink(r)));
    } else {
      StoreGroupPartial(dst, r, d, acc, mx, lsum);
    }
  }
}

template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::MergeInCluster(int members,
                                                                           int64_t dst) {
  ClusterSync();  // every live split's partial is in its shared memory
  trace.Mark();
  KVL_DECODE_STOP_AFTER(5, false)
  ClusterValues(members, dst);
  if constexpr (kDecodeTrace) {
    trace.Mark();
    ClusterValues(members, dst);
    trace.Mark();
  }
  ClusterSync();  // no CTA leaves while another still reads its shared memory
  trace.Mark();
  if (split == 0) trace.Print("cluster", splits, live, tree.groups);
  return true;
}

// Few partials: each item's m, l and values in one trip (MergeFewPartials), no weights pass of
// its own (a round trip, two barriers and the rows' reductions before the first value load).
// Row r of slot k is element k * kDecodeRows + r of part_m and part_l, and row k * kDecodeRows +
// r of part_o. K items per thread per trip: where a thread has two items (28/4/128 at four
// warps: 7 x 128 / 4 = 224 items for 128 threads) and at most FN = 4 partials, both items'
// loads go out together, in the registers of one item of 8 partials.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
template <int FN, int K>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::MergeFewItems(int nn,
                                                                             int64_t row0,
                                                                             int64_t dst) {
  const int items = nrows * hs / 4;
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
        StoreScaled4(OutRow(r[k]) + d[k], acc[k],
                     OutputScale(mx[k], lsum[k], extra, RowSink(r[k])));
      } else {
        StoreGroupPartial(dst, r[k], d[k], acc[k], mx[k], lsum[k]);
      }
    }
  }
}

// Merges partial slots [first, first + n) of this (batch, kv head) into slot `dst` (a group
// partial) or, with dst < 0, into the output. The whole CTA calls it. In split order
// (deterministic); partials are read past L1 (ld.global.cg): other CTAs wrote them. The merge is
// a chain of L2 round trips (about 0.4 to 0.6 us each on the H200), so it is built to take few:
// every (slot, row) m and l in one trip to shared memory and each row's weights from there,
// then the values.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::Merge(int64_t first, int64_t n,
                                                                  int64_t dst) {
  Shared& sh = Sh();
  float* weight = reinterpret_cast<float*>(dec_smem);  // [row][slot]; red_o is no longer read
  float* slot_m = weight + kDecodeRows * kMaxDecodeSplits;  // [slot][kDecMergeRowPitch]
  float* slot_l = slot_m + kMaxDecodeSplits * kDecMergeRowPitch;
  const int nn = static_cast<int>(n);
  if (nn <= kDecodeFewMerge) {
    const int64_t row0 = (slot_base + first) * kDecodeRows;
    if (nrows * hs / 4 > kDecThreads && nn <= kDecodeFewMerge / 2) {
      MergeFewItems<kDecodeFewMerge / 2, 2>(nn, row0, dst);
    } else {
      MergeFewItems<kDecodeFewMerge, 1>(nn, row0, dst);
    }
    if constexpr (kDecodeTrace) {  // the trace's two marks: weights (none), values
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
        sh.row_scale[r] = OutputScale(mx, lsum, extra, RowSink(r));
      } else {
        part_m[(slot_base + dst) * kDecodeRows + r] = mx;
        part_l[(slot_base + dst) * kDecodeRows + r] = lsum;
      }
    }
  }
  __syncthreads();
  trace.Mark();
  // Four dimensions per thread (H % 8 == 0): one 16-byte load per partial, eight issued before
  // any is used (a skip test between the loads kept one in flight). Sixteen in flight, two
  // items' eight, or a chunk of partials staged through cp.async measured slower.
  for (int idx = threadIdx.x; idx < nrows * hs / 4; idx += kDecThreads) {
    const int r = idx / (hs / 4), d = (idx % (hs / 4)) * 4;
    const float* po = part_o + ((slot_base + first) * kDecodeRows + r) * H + d;
    const int64_t pitch = kDecodeRows * H;  // from one slot's row to the next
    const float* wr = weight + r * kMaxDecodeSplits;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](const float4& xv, float wt) {
      if (wt == 0.0f) return;  // an empty partial adds nothing, whatever it holds (no 0 x Inf)
      Fma4(acc, xv, wt);
    };
    int64_t sp = 0;
    for (; sp + 8 <= n; sp += 8) {
      float4 xv[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        xv[u] = __ldcg(reinterpret_cast<const float4*>(po + (sp + u) * pitch));
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) add(xv[u], wr[sp + u]);
    }
    for (; sp < n; ++sp) add(__ldcg(reinterpret_cast<const float4*>(po + sp * pitch)), wr[sp]);
    if (dst < 0) {
      T* out = OutRow(r) + d;
      const float sc = sh.row_scale[r];
      StoreScaled4(out, acc, sc);
    } else {
      *reinterpret_cast<float4*>(part_o + ((slot_base + dst) * kDecodeRows + r) * H + d) = acc;
    }
  }
  if constexpr (kDecodeTrace) {
    __syncthreads();
    trace.Mark();
  }
}

// True in the CTA that is the last of `count` to bump `counter`. The barrier orders every
// thread's partial stores before thread 0's count, whose release (acq_rel, device scope) then
// publishes them: fences are cumulative. In the last CTA the count's acquire and the barrier
// after it order the others' partials before every thread's reads (the pattern of CUTLASS's
// generic barrier; a __threadfence() per thread on both sides was a sequentially consistent
// fence each, MEMBAR.SC.GPU). The last arrival returns the counter to zero (every CTA of this
// launch that counts on it has counted), so counters kept across calls start the next launch
// at zero.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::LastToFinish(unsigned* counter,
                                                                         int64_t count) {
  Shared& sh = Sh();
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<unsigned, cuda::thread_scope_device> c(*counter);
    sh.merges_splits = c.fetch_add(1u, cuda::memory_order_acq_rel) == unsigned(count - 1);
    if (sh.merges_splits) c.store(0u, cuda::memory_order_relaxed);
  }
  __syncthreads();
  return sh.merges_splits;
}

// The row's live splits merged: in the cluster, through the tree's global levels, or both.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::MergeSplits() {
  if (cluster_merge && tree.groups == 1) {
    return MergeInCluster(static_cast<int>(live), -1);
  }
  // Counters of this row's merge tree (the same in each of its CTAs): counter 0 is the top
  // merge's, 1 + k group k's.
  unsigned* row_counters =
      counters + bg * DecodeMergeTree::CountersPerRow(splits, rows, H, cluster);
  if (cluster_merge) {
    // Group clusters: this cluster's group into its group partial; then every live CTA has
    // written its share and counts on counter 0, and the row's last arrival merges the groups
    // (the group counters are not used).
    const int64_t grp = split / kMaxDecodeCluster, first = grp * kMaxDecodeCluster;  // cluster
    if (!MergeInCluster(static_cast<int>(min(kMaxDecodeCluster, live - first)), splits + grp)) {
      return false;
    }
    if (!LastToFinish(row_counters, live)) return true;
    trace.Mark();
    Merge(splits, tree.groups, -1);
    trace.Print("cluster-tree", splits, live, tree.groups);
    return true;
  }
  if (tree.groups == 1) {
    if (!LastToFinish(row_counters, live)) return true;
    trace.Mark();
    KVL_DECODE_STOP_AFTER(5, false)
    Merge(0, live, -1);
    if constexpr (kDecodeTrace) {
      Merge(0, live, -1);  // the same merge again, its code and data warm (same output)
      trace.Print("flat", splits, live, 1);
    }
    return true;
  }
  const int64_t grp = split / tree.group, first = grp * tree.group;
  const int64_t members = min(tree.group, live - first);
  if (!LastToFinish(row_counters + 1 + grp, members)) return true;
  trace.Mark();
  KVL_DECODE_STOP_AFTER(5, false)
  // This CTA merges its group.
  Merge(first, members, splits + grp);
  if (LastToFinish(row_counters, tree.groups)) {
    trace.Mark();
    Merge(splits, tree.groups, -1);
    trace.Print("tree", splits, live, tree.groups);
  }
  return true;
}

}  // namespace cu
}  // namespace kvl
