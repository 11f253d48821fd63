// The CUDA kernel families of csrc/cuda/, one file each, as host launchers; plan.cu decides
// which of them serve a call (the dispatch table of docs/ARCHITECTURE.md). Internal to
// csrc/cuda/. Every launcher enqueues on `stream` only and reads lengths on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/kv_strides.h"
#include "cuda/gqa_cuda.h"

namespace kvl {
namespace cu {

// Rows (token x head of one KV group) per CTA of the portable kernel and of the combine slots.
constexpr int kRowsPerCta = 16;
constexpr int64_t kMaxSplits = 1024;  // the combine kernel keeps one weight per split
constexpr int64_t kMinSplitKeys = 64;  // a split below ~64 keys is not worth its combine

using AttnKernel = GqaCudaAttention;
using AttnPlan = GqaCudaPlan;

// Pointers into the call's workspace (laid out by the plan).
struct Workspace {
  float* q = nullptr;               // (B, N, S, H) float: normed, rotated, scaled queries
                                    // (null for the decode kernel, which prepares its own)
  float* part_o = nullptr;          // split partials: (slot, H)
  float* part_m = nullptr;          // (slot)
  float* part_l = nullptr;          // (slot)
  // Decode split merge tree: grid rows (DecodeGridRows: B x Nkv, or B with packed heads) x
  // DecodeMergeTree::CountersPerRow, zeroed by a memset before the decode kernel
  // (LaunchDecodeTc), or CudaDecodeCounters' (counters_zero).
  unsigned* counters = nullptr;
  int64_t counter_count = 0;
  bool counters_zero = false;  // kept across calls (CudaDecodeCounters): zero, no memset needed
  void* q_storage = nullptr;         // cuDNN prefill: (B, S, N, H) rotated queries, storage type
  int32_t* seq_len_q = nullptr;     // cuDNN prefill: (B) new rows per entry (prepare writes them)
  int32_t* seq_len_kv = nullptr;    // cuDNN prefill: (B) valid keys per entry
  void* cudnn = nullptr;            // cuDNN's own workspace
  void* stage_k = nullptr;          // sliding window cache: SlidingStageStrides rows of K
  void* stage_v = nullptr;          // ... and of V (null without a sliding window cache)
};

template <typename T>
Status LaunchCopyPast(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides past_st,
                      KvStrides present_st, const CudaDeviceInfo& dev, cudaStream_t stream);

template <typename T>
Status LaunchPrepare(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                     const Workspace& ws, cudaStream_t stream);

// Sliding window cache (sliding.cu). The attention cannot read a window-sized present that this
// call shifts (a CTA would read rows another CTA already moved; past and present may be one
// buffer), so it reads a staging copy in the workspace instead: row j of (b, kv head) holds
// position cache_base + j, the resident past rows then this call's new rows (written by
// prepare or the decode kernel). After the attention, present rows [0, L(total)) are taken from the staging rows.
// Staging: (B, Nkv, C + S, H) in the call's layout, T elements; 256-byte multiple, 0 when off.
int64_t SlidingStageRows(const GqaShape& s);  // resident past + new rows: past capacity + S
size_t SlidingStageBytes(const GqaShape& s);
KvStrides SlidingStageStrides(const GqaShape& s);
// Resident past rows [0, L(past)) -> staging rows.
template <typename T>
Status LaunchSlidingStage(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides past_st,
                          const Workspace& ws, const CudaDeviceInfo& dev, cudaStream_t stream);
// Staging -> present rows [0, L(total)); rows beyond are zeroed unless past and present share.
template <typename T>
Status LaunchSlidingPresent(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                            const Workspace& ws, const CudaDeviceInfo& dev, cudaStream_t stream);

// Portable CUDA-core attention (+ the combine when split).
template <typename T>
Status LaunchPortable(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                      const AttnPlan& plan, const Workspace& ws, cudaStream_t stream);

template <typename T>
Status LaunchCombine(const GqaShape& s, const GqaCudaBuffers& buf, const AttnPlan& plan,
                     const Workspace& ws, cudaStream_t stream);

// Tensor-core prefill (mma.sync, sm_80+), fp16/bf16.
bool PrefillTcFits(const GqaShape& s, size_t elem, const CudaDeviceInfo& dev);
template <typename T>
Status LaunchPrefillTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                       const Workspace& ws, cudaStream_t stream);

// cuDNN's fused flash attention for prefill (prefill_cudnn.cc), fp16/bf16 on sm_90+: the graph
// for this call's shape (built once per shape and device, cached), or null where it cannot
// serve: built without cuDNN, libcudnn not loadable or disabled (ORT_KVLAYOUT_CUDNN=0), a
// feature outside its graph (fp16/bf16, sm_90+, causal; no bias, softcap, window, sink), or a
// shape cuDNN refused.
std::shared_ptr<const CudnnPrefill> FindCudnnPrefill(const GqaShape& s, const CudaDeviceInfo& dev,
                                                     KvStrides present_st);
size_t CudnnPrefillWorkspaceBytes(const CudnnPrefill& prefill);
// After prepare (which wrote ws.q_storage and the lengths); reads present_* in place.
Status LaunchCudnnPrefill(const CudnnPrefill& prefill, const CudaDeviceInfo& dev,
                          const GqaCudaBuffers& buf, const Workspace& ws, cudaStream_t stream);
std::string CudnnStatus();

// Tensor-core decode (mma.sync, sm_80+), fp16/bf16: up to 16 rows (token x head) of one KV group
// per CTA, key splits merged by the last CTA of each (batch, kv head).
constexpr int kDecodeRows = 16;
constexpr int64_t kMaxDecodeSplits = 256;  // the merging CTA keeps 16 x splits weights
// The largest thread-block cluster of decode CTAs (one row's splits, or a group of them).
// 8 is the portable cluster size; KVL_DECODE_MAX_CLUSTER=16 (a build knob for benchmarking)
// allows the non-portable 16 of sm_90 (cudaFuncAttributeNonPortableClusterSizeAllowed).
#ifndef KVL_DECODE_MAX_CLUSTER
#define KVL_DECODE_MAX_CLUSTER 8
#endif
constexpr int64_t kMaxDecodeCluster = KVL_DECODE_MAX_CLUSTER;
// The splits of a (batch, kv head) merge in a tree of at most two levels: the last CTA of each
// group of `group` splits merges the group into a group partial (with group clusters, the CTAs
// of each cluster of kMaxDecodeCluster together, through its shared memory: decode.cu), and the
// last group merger (the row's last arrival) merges the groups. One merging CTA reads all of its
// partials alone (one SM, an L2 round trip per eight loads of each thread), so a flat merge of
// 128 splits x 4 rows x 256 floats took longer than the reads it followed. When the live splits'
// partials exceed kDecodeFlatMergeFloats floats (eight rounds of the CTA's loads), groups of
// ceil(sqrt(live)) splits; else one level (group == live).
// 32K: a level of the tree costs an arrival, a weights pass and a values pass (about 2 us on the
// H200), more than the four rounds of values that 16K more floats add (28/4/128 B=1 L=16k: 24.1 ->
// 21.7 us, L=32k 35.8 -> 31.4, 4/1/256 B=1 L=4k 20.0 -> 18.4; docs/BENCHMARKS.md, twelfth session).
// The tree follows the live splits (those holding keys, a prefix of the grid set by the lengths and
// the split target), never the capacity, which only bounds how many splits are launched: caches of
// different capacities merge the same partials in the same groups and order, so decode output stays
// bit-identical across capacities. (A tree sized by the split target put the 8 live splits of a
// 1k-token row at 28/4/128, target 33, through two levels: 21 us against 17 flat on the H200.) The
// kernel builds the tree of its row's live splits; the plan sizes slots and counters for the
// largest tree any live count <= the launched splits gives (SlotsPerRow, CountersPerRow). One place
// owns the arithmetic.
#ifndef KVL_DECODE_FLAT_MERGE_FLOATS  // a build knob for benchmarking the bound
#define KVL_DECODE_FLAT_MERGE_FLOATS 32768
#endif
constexpr int64_t kDecodeFlatMergeFloats = KVL_DECODE_FLAT_MERGE_FLOATS;
// A second merge level adds a group merge, a fence and a counter to the row's path, and a split
// fewer keys: at 28/4/128 B=1 L=4k (33 splits targeted) one level of 18 splits took 18.0 to
// 18.7 us on the H200 against 22.2 for two levels of 32, at L=8k 22.2 against 24.8; at head size
// 256 (4/1/256 L=8k, 16 splits of 512 keys) one level lost 10 us. So the live keys take at most
// the splits of one level while each of those reads at most kDecodeFlatSplitBytes of K and V
// (docs/BENCHMARKS.md, ninth session: the sweep of this bound).
constexpr int64_t kDecodeFlatSplitBytes = 256 * 1024;
struct DecodeMergeTree {
  int64_t group = 1, groups = 1;  // splits per group (the last may hold fewer), groups
  // `cluster`: the launch's thread-block cluster size (0 without clusters; 2 to 8 for a row's one
  // cluster, which holds every live split: one group). At kMaxDecodeCluster, more live splits
  // than one cluster merge in groups of one cluster each (the cluster's shared memory,
  // decode.cu), then the groups in global memory. The plan launches such clusters
  // for a shape class (MakePlan: few rows, clusters that all fit at once), never for a capacity,
  // so the tree still follows the live splits only.
  __host__ __device__ static DecodeMergeTree For(int64_t live, int64_t rows, int64_t head_size,
                                                 int64_t cluster) {
    DecodeMergeTree t;
    t.group = live;
    if (cluster == kMaxDecodeCluster && live > cluster) {
      t.group = kMaxDecodeCluster;
      t.groups = (live + kMaxDecodeCluster - 1) / kMaxDecodeCluster;  // a shift
      return t;
    }
    if (live * rows * head_size > kDecodeFlatMergeFloats) {
      t.group = CeilSqrt(live);
    }
    t.groups = (live + t.group - 1) / t.group;
    return t;
  }
  // Partial slots of one (batch, kv head) for `splits` launched splits: one per split, then one
  // per group of the largest tree (ceil(live / ceil(sqrt(live))) <= ceil(sqrt(live)); with
  // cluster groups ceil(live / cluster)).
  __host__ __device__ static int64_t SlotsPerRow(int64_t splits, int64_t rows, int64_t head_size,
                                                 int64_t cluster) {
    return splits + MaxGroups(splits, rows, head_size, cluster);
  }
  // Counters of one (batch, kv head): the top merge's (index 0), then one per group.
  __host__ __device__ static int64_t CountersPerRow(int64_t splits, int64_t rows,
                                                    int64_t head_size, int64_t cluster) {
    return 1 + MaxGroups(splits, rows, head_size, cluster);
  }
  // The split target for `keys` live keys of `rows` rows (the kernel's partition; the plan's
  // target sized the grid): at most the splits of a one-level merge while each of those reads at
  // most kDecodeFlatSplitBytes (fp16/bf16 K and V rows), else the plan's target. In the integer
  // type I of the caller (SplitChunk says why).
  template <typename I>
  __host__ __device__ static I SplitTarget(I target, I keys, I rows, I head_size) {
    const I flat_max = static_cast<I>(kDecodeFlatMergeFloats) / (rows * head_size);
    const I flat = flat_max > 1 ? flat_max : 1;
    if (target <= flat) return target;
    // ceil(keys / flat) splits' K and V rows within the byte bound, without a division by the
    // live keys (it is on the decode kernel's path to its first load; this one is not):
    // ceil(k / f) <= m exactly when k <= f m.
    const I max_keys = static_cast<I>(kDecodeFlatSplitBytes / 4) / head_size;
    return keys <= flat * max_keys ? flat : target;
  }
  __host__ __device__ static int64_t CeilSqrt(int64_t n) {  // n <= kMaxDecodeSplits
    int64_t g = 1;
    while (g * g < n) ++g;
    return g;
  }

 private:
  __host__ __device__ static int64_t MaxGroups(int64_t splits, int64_t rows, int64_t head_size,
                                               int64_t cluster) {
    const int64_t by_size =
        splits * rows * head_size > kDecodeFlatMergeFloats ? CeilSqrt(splits) : 0;
    const int64_t by_cluster =
        cluster == kMaxDecodeCluster && splits > cluster
            ? (splits + kMaxDecodeCluster - 1) / kMaxDecodeCluster  // a shift, not a division
            : 0;
    return by_size > by_cluster ? by_size : by_cluster;
  }
};
// At least two KS steps per warp at four warps (one at eight), so the merge stays small against
// the reads.
constexpr int64_t kMinDecodeSplitKeys = 128;
// Below this many (batch, kv head) rows the plan puts one decode CTA per SM, else it fills
// every CTA slot in one wave, or past one wave takes one split per row, with fewer CTAs per SM
// (padded shared memory) where the rows fill those waves better; fewer splits where the merge
// takes two rounds (DecodeMergeTwoRounds). MakePlan says why.
constexpr int64_t kFewDecodeRows = 16;
// Threads of a decode CTA: four warps. A row's split merge writes its rows x head size values
// four per thread: past one item per thread (28/4/128: 7 rows x 128 / 4 = 224; 4/1/256: 256) each
// 8 splits add two rounds of loads to the merge, not one, and the plan targets fewer splits
// (MakePlan).
constexpr int kDecodeCtaThreads = 128;
// The wide instance's threads: eight warps, for calls of one token at head tile 128 or 64 with
// at most one row per SM, where the merge takes two rounds at four warps or the rows are more
// than 16, and for packed heads at the 192-column tile (MakePlan says why; DecodeTcWideServes
// where it exists).
constexpr int kDecodeWideCtaThreads = 256;
__host__ __device__ constexpr bool DecodeMergeTwoRounds(int64_t rows, int64_t head_size) {
  return rows * head_size / 4 > kDecodeCtaThreads;
}
bool DecodeTcFits(const GqaShape& s, size_t elem, const CudaDeviceInfo& dev);
// Packed heads (GqaCudaPlan::decode_packed): one decode CTA per (split, batch entry) serving
// all its kv heads, whose rows it reads as whole seq-major token rows. Whether it serves the
// shape on this device: kv_layout=1, the one-token plain form, head size 64, 2 or 3 kv heads
// (the tiles compiled), Nkv x G <= kDecodeRows query rows, and its shared memory fits.
bool DecodePackedServes(const GqaShape& s, const CudaDeviceInfo& dev);
// The decode grid's rows (batch entry x kv head; packed: batch entry), which own the split
// merge's partial slots and counters, and the query rows of each (S x G; packed: Nkv x G).
inline int64_t DecodeGridRows(const GqaShape& s, bool packed) {
  return packed ? s.batch : s.batch * s.kv_num_heads;
}
inline int64_t DecodeCtaRows(const GqaShape& s, bool packed) {
  return packed ? s.kv_num_heads * s.group_size() : s.seq_len * s.group_size();
}
// Whether the wide (eight-warp) instance serves this shape on this device: it is compiled for
// the shape's form and head size (the one-token plain form, a head tile of 128 or 64; `packed`:
// packed heads at the 192-column tile) and its shared memory fits.
bool DecodeTcWideServes(const GqaShape& s, const CudaDeviceInfo& dev, bool packed = false);
// CTAs of `threads` threads (kDecodeCtaThreads or kDecodeWideCtaThreads) per SM; cached per
// device and kernel.
int DecodeTcCtasPerSm(const GqaShape& s, const CudaDeviceInfo& dev,
                      int threads = kDecodeCtaThreads, bool packed = false);
// Whether a row's key splits can be one thread-block cluster of `cluster` CTAs (an sm_90+ device
// running code compiled for sm_90+, at most kMaxDecodeCluster, resident together on it).
bool DecodeTcClustersFit(const GqaShape& s, const CudaDeviceInfo& dev, int64_t cluster,
                         int threads = kDecodeCtaThreads, bool packed = false);
// How many clusters of `cluster` decode CTAs for this shape the device holds at once (0 where
// they do not fit or the code has no cluster support; cached per device and kernel), with
// `ctas_per_sm` > 0 for a launch padded to at most that many CTAs per SM (SmemForCtasPerSm).
int DecodeTcActiveClusters(const GqaShape& s, const CudaDeviceInfo& dev, int64_t cluster,
                           int ctas_per_sm = 0, int threads = kDecodeCtaThreads,
                           bool packed = false);
template <typename T>
Status LaunchDecodeTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                      const AttnPlan& plan, const Workspace& ws, cudaStream_t stream);

// Once per (current device, kernel, value): raises a kernel's dynamic shared memory limit (a host
// call that need not repeat on every Run) and caches occupancy queries. Both act on the device
// that is current, as the CUDA calls they wrap do.
Status EnsureSmemLimit(const void* fn, size_t smem);
int CachedCtasPerSm(const void* fn, int threads, size_t smem);
// The dynamic shared memory of a launch of `fn` (needing `smem`) with which at most `ctas` CTAs
// share an SM: `smem` where no more fit anyway (or ctas <= 0), else the smallest size above it,
// in 1 KB steps, that leaves room for no more (`smem` where none does). Searched once per
// (current device, kernel, smem, ctas) with the occupancy calculator; raises the kernel's limit.
Status SmemForCtasPerSm(const void* fn, int threads, size_t smem, int ctas, size_t* launch_smem);
int CachedPtxVersion(const void* fn);  // cudaFuncAttributes::ptxVersion (0 on error)
// A launch of `grid` x `block` threads with `smem` bytes of dynamic shared memory in clusters of
// `cluster` CTAs along x (cudaLaunchKernelEx, cudaOccupancyMaxActiveClusters). Not copyable:
// config points at attr.
struct ClusterLaunch {
  ClusterLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster);
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
  cudaLaunchAttribute attr = {};
  cudaLaunchConfig_t config = {};
};
// Clusters of `cluster` CTAs that can be resident at once (0 on error).
int CachedMaxActiveClusters(const void* fn, int threads, size_t smem, int cluster);

}  // namespace cu
}  // namespace kvl
