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
#include "cuda/plan_rules.h"

namespace kvl {
namespace cu {

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
  float* stage_k_scale = nullptr;   // PER_TOKEN: the staging rows' K scales (SlidingStageStrides
  float* stage_v_scale = nullptr;   // / CacheRow, ScaleIndex), after each staging area's rows
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
// PER_TOKEN: each staging area (K, V) is followed by its rows' float32 scales, (B, Nkv, C + S)
// at the rows' strides with head_dim 1 (ScaleIndex); SlidingStageBytes counts both.
int64_t SlidingStageRows(const GqaShape& s);  // resident past + new rows: past capacity + S
size_t SlidingStageRowBytes(const GqaShape& s);  // the rows only
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
// per CTA, key splits merged by the last CTA of each (batch, kv head) (decode_kernel.cuh; its
// sizes: decode_geometry.h; which calls it serves: plan_rules.h).
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
