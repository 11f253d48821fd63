// Plan and dispatch: which kernel serves a call, its splits and workspace (the rules:
// plan_rules.h, fed the device's answers here), and the launch sequence (copy past, prepare,
// attention; the decode kernel prepares its own rows). Host code only; the kernels live one
// family per file.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/knobs.h"
#include "cuda/common.cuh"
#include "cuda/decode_dispatch.h"
#include "cuda/kernels.h"
#include "cuda/plan_rules.h"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {
namespace {

// The occupancy of the decode instances on the current device, for the plan rules: the
// occupancy calculator on the kernel of the call's element type, cached per device and kernel.
class DeviceDecodeOccupancy : public DecodeOccupancy {
 public:
  explicit DeviceDecodeOccupancy(DType dtype) : dtype_(dtype) {}
  int CtasPerSm(const DecodeInstance& inst) const override {
    const void* f = Fn(inst);
    if (f == nullptr || !EnsureSmemLimit(f, inst.SmemBytes()).ok()) return 1;
    return CachedCtasPerSm(f, inst.warps * kWarp, inst.SmemBytes());
  }
  int ActiveClusters(const DecodeInstance& inst, int cluster, int ctas_per_sm) const override {
    const void* f = Fn(inst);
    const size_t smem = inst.SmemBytes();
    const int threads = inst.warps * kWarp;
    // The code that runs on this device was compiled for sm_90 or newer (its PTX target: an
    // sm_80 build JIT-compiled for this GPU reports binary version 90 but has no cluster code),
    // and clusters of these CTAs fit the device.
    if (f == nullptr || CachedPtxVersion(f) < 90 || !EnsureSmemLimit(f, smem).ok()) return 0;
    size_t launch_smem = smem;
    if (!SmemForCtasPerSm(f, threads, smem, ctas_per_sm, &launch_smem).ok() ||
        !EnsureSmemLimit(f, launch_smem).ok()) {
      return 0;
    }
    return CachedMaxActiveClusters(f, threads, launch_smem, cluster);
  }

 private:
  const void* Fn(const DecodeInstance& inst) const {
    return reinterpret_cast<const void*>(DecodeKernelOf(dtype_, inst));
  }
  DType dtype_;
};

// The plan: cuDNN's prefill where it serves (TriesCudnn; its graph is found or built here),
// else the rules of plan_rules.h on this device, with the knobs read once (core/knobs.h).
AttnPlan MakePlan(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev) {
  PlanBuffers pb;
  pb.caches_aligned16 = Aligned16({buf.present_key, buf.present_value});
  pb.output_aligned4 = reinterpret_cast<uintptr_t>(buf.output) % 4 == 0;
  pb.output_aligned16 = reinterpret_cast<uintptr_t>(buf.output) % 16 == 0;
  const KnobValues& kv = Knobs();
  PlanKnobs knobs;
  knobs.decode_splits = kv.decode_splits;
  knobs.decode_clusters = kv.decode_clusters;
  knobs.decode_group_clusters = kv.decode_group_clusters;
  knobs.decode_wide = kv.decode_wide;
  knobs.decode_packed = kv.decode_packed;
  knobs.decode_quant_bytes = kv.decode_quant_bytes;
  knobs.cudnn_min_rows = kv.cudnn_min_rows;
  if (TriesCudnn(s, ChooseKernel(s, pb, dev), pb, knobs)) {
    const KvStrides present_st =
        MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, CacheRow(s));
    AttnPlan p;
    p.cudnn = FindCudnnPrefill(s, dev, present_st);
    if (p.cudnn != nullptr) {
      auto align = [](size_t x) { return (x + 255) / 256 * 256; };
      p.kernel = AttnKernel::kPrefillCudnn;
      p.q_storage_bytes =  // fp16 / bf16
          align(sizeof(uint16_t) * s.batch * s.seq_len * s.num_heads * s.head_size);
      p.seq_len_bytes = align(sizeof(int32_t) * s.batch);
      p.cudnn_bytes = align(CudnnPrefillWorkspaceBytes(*p.cudnn));
      return p;
    }
  }
  return PlanRules(s, pb, dev, DeviceDecodeOccupancy(s.dtype), knobs);
}

Workspace CarveWorkspace(const GqaShape& s, const AttnPlan& p, void* workspace) {
  char* base = static_cast<char*>(workspace);
  Workspace ws;
  ws.q = p.q_bytes > 0 ? reinterpret_cast<float*>(base) : nullptr;
  base += p.q_bytes;
  ws.part_o = reinterpret_cast<float*>(base);
  base += p.part_o_bytes;
  ws.part_m = reinterpret_cast<float*>(base);
  base += p.part_ml_bytes;
  ws.part_l = reinterpret_cast<float*>(base);
  base += p.part_ml_bytes;
  ws.counters = reinterpret_cast<unsigned*>(base);
  ws.counter_count = p.counter_bytes > 0
                         ? DecodeGridRows(s, p.decode_packed) *
                               DecodeMergeTree::CountersPerRow(
                                   p.splits, DecodeCtaRows(s, p.decode_packed), s.head_size,
                                   p.cluster)
                         : 0;
  base += p.counter_bytes;
  if (p.stage_bytes > 0) {
    ws.stage_k = base;
    ws.stage_v = base + p.stage_bytes;
    if (s.per_token()) {  // each area's scales after its rows (SlidingStageBytes)
      ws.stage_k_scale = reinterpret_cast<float*>(base + SlidingStageRowBytes(s));
      ws.stage_v_scale = reinterpret_cast<float*>(base + p.stage_bytes + SlidingStageRowBytes(s));
    }
  }
  base += 2 * p.stage_bytes;
  if (p.q_storage_bytes > 0) {
    ws.q = nullptr;  // the cuDNN path keeps its queries in the storage type
    ws.q_storage = base;
    base += p.q_storage_bytes;
    ws.seq_len_q = reinterpret_cast<int32_t*>(base);
    base += p.seq_len_bytes;
    ws.seq_len_kv = reinterpret_cast<int32_t*>(base);
    base += p.seq_len_bytes;
    ws.cudnn = p.cudnn_bytes > 0 ? base : nullptr;
  }
  return ws;
}

// New rows into `kv_st` rows of buf.present_* (prepare, or the decode kernel itself), and the
// attention reading them.
template <typename T>
Status Attend(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
              KvStrides kv_st, const AttnPlan& plan, const Workspace& ws, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    // The decode kernel prepares its own rows (one launch per step).
    if (plan.kernel == AttnKernel::kDecodeTc) {
      return LaunchDecodeTc<T>(s, buf, kv_st, plan, ws, stream);
    }
  }
  KVL_RETURN_IF_ERROR(LaunchPrepare<T>(s, buf, kv_st, ws, stream));
  if (plan.kernel == AttnKernel::kPrefillCudnn) {
    return LaunchCudnnPrefill(*plan.cudnn, dev, buf, ws, stream);
  }
  if constexpr (sizeof(T) == 2) {
    if (plan.kernel == AttnKernel::kPrefillTc) return LaunchPrefillTc<T>(s, buf, kv_st, ws, stream);
  }
  return LaunchPortable<T>(s, buf, kv_st, plan, ws, stream);
}

template <typename T>
Status Launch(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
              const AttnPlan& plan, void* workspace, unsigned* decode_counters,
              cudaStream_t stream) {
  Workspace ws = CarveWorkspace(s, plan, workspace);
  if (decode_counters != nullptr && ws.counter_count > 0) {
    ws.counters = decode_counters;
    ws.counters_zero = true;
  }
  // Strides in stored elements: T, int8 codes or packed int4 bytes (CacheRow per row).
  const KvStrides past_st = MakeKvStrides(s.layout, s.kv_num_heads, s.past_capacity, CacheRow(s));
  const KvStrides present_st =
      MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, CacheRow(s));
  if (s.sliding_window_cache) {
    // Prepare and the attention work on the staging rows (sliding.cu); present is written last.
    KVL_RETURN_IF_ERROR(LaunchSlidingStage<T>(s, buf, past_st, ws, dev, stream));
    GqaCudaBuffers staged = buf;
    staged.present_key = ws.stage_k;
    staged.present_value = ws.stage_v;
    staged.present_key_scale = ws.stage_k_scale;  // PER_TOKEN (null otherwise)
    staged.present_value_scale = ws.stage_v_scale;
    KVL_RETURN_IF_ERROR(Attend<T>(s, staged, dev, SlidingStageStrides(s), plan, ws, stream));
    return LaunchSlidingPresent<T>(s, buf, present_st, ws, dev, stream);
  }
  // A first prompt has no past rows and writes its S rows, so with a present of S rows there is
  // nothing to copy or zero: the launch is skipped (it cost 1.4 to 40 us at the benchmark's
  // prefill points).
  const bool nothing_to_copy = s.is_first_prompt() && s.present_capacity <= s.seq_len;
  if (!buf.shared() && !nothing_to_copy) {
    KVL_RETURN_IF_ERROR(LaunchCopyPast<T>(s, buf, past_st, present_st, dev, stream));
  }
  return Attend<T>(s, buf, dev, present_st, plan, ws, stream);
}

// Host-side facts that do not change for a (device, kernel): computed once per process.
std::mutex g_cache_mutex;
std::map<std::tuple<int, const void*>, size_t> g_smem_limits;            // raised limit
std::map<std::tuple<int, const void*, int, size_t>, int> g_ctas_per_sm;  // occupancy
std::map<std::tuple<int, const void*>, int> g_ptx_versions;
std::map<std::tuple<int, const void*, size_t, int>, size_t> g_smem_for_ctas;  // padded smem
std::map<std::tuple<int, const void*, int, size_t, int>, int> g_active_clusters;

// A hint cached per (current device, key...): `query(&value)` on the key's first call. Hints
// only size or enable a path, so a failed query gives `fallback` and clears its own error,
// never an earlier one (a failed device lookup gives `fallback` uncached).
template <typename Cache, typename Query, typename... Key>
int CachedHint(Cache& cache, int fallback, Query query, Key... key) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  const auto k = std::make_tuple(device, key...);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  int value = fallback;
  if (query(&value) != cudaSuccess) {
    if (clean) (void)cudaGetLastError();
    value = fallback;
  }
  cache.emplace(k, value);
  return value;
}

}  // namespace

Status EnsureSmemLimit(const void* fn, size_t smem) {
  if (smem <= 48 * 1024) return Status::Ok();  // within the default limit
  int device = 0;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  size_t& limit = g_smem_limits[{device, fn}];
  if (limit >= smem) return Status::Ok();
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
      "shared memory attribute"));
  limit = smem;
  return Status::Ok();
}

Status SmemForCtasPerSm(const void* fn, int threads, size_t smem, int ctas, size_t* launch_smem) {
  *launch_smem = smem;
  if (ctas <= 0 || CachedCtasPerSm(fn, threads, smem) <= ctas) return Status::Ok();
  int device = 0;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  const auto key = std::make_tuple(device, fn, smem, ctas);
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    const auto it = g_smem_for_ctas.find(key);
    if (it != g_smem_for_ctas.end()) {
      *launch_smem = it->second;
      return Status::Ok();
    }
  }
  // A hint, as CachedHint's: where a query fails, the launch takes `smem` unpadded (more CTAs
  // per SM, the same results) and only this search's own error is cleared. Not through
  // CachedHint: it holds g_cache_mutex while it queries, and EnsureSmemLimit takes it.
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  size_t found = smem;
  // The most a CTA may opt in to, less the kernel's static shared memory: the limit raised to it
  // makes every size below launchable (and counted by the occupancy calculator).
  cudaFuncAttributes attr = {};
  int optin = 0, n = 0;
  auto fits = [&](size_t bytes) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, bytes) == cudaSuccess;
  };
  bool ok = cudaFuncGetAttributes(&attr, fn) == cudaSuccess &&
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
                cudaSuccess;
  if (ok && size_t(optin) > attr.sharedSizeBytes + smem) {
    const size_t most = size_t(optin) - attr.sharedSizeBytes;
    ok = EnsureSmemLimit(fn, most).ok() && fits(most);
    if (ok && n <= ctas) {
      // The smallest size in 1 KB steps with at most `ctas` per SM: the occupancy falls as the
      // size grows, so a bisection over [smem, most].
      size_t lo = smem, hi = most;  // fits(lo) > ctas >= fits(hi)
      while (ok && hi - lo > 1024) {
        const size_t mid = lo + std::max<size_t>(1, (hi - lo) / 2048) * 1024;  // in (lo, hi)
        ok = fits(mid);
        (n <= ctas ? hi : lo) = mid;
      }
      if (ok) found = hi;
    }
  }
  if (!ok) {
    if (clean) (void)cudaGetLastError();
    found = smem;
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_smem_for_ctas.emplace(key, found);
  *launch_smem = found;
  return Status::Ok();
}

int CachedCtasPerSm(const void* fn, int threads, size_t smem) {
  const int n = CachedHint(g_ctas_per_sm, 1, [&](int* v) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, fn, threads, smem);
  }, fn, threads, smem);
  return std::max(n, 1);
}

ClusterLaunch::ClusterLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             int cluster) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
}

int CachedPtxVersion(const void* fn) {
  return CachedHint(g_ptx_versions, 0, [&](int* v) {
    cudaFuncAttributes attr = {};
    const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
    if (err == cudaSuccess) *v = attr.ptxVersion;
    return err;
  }, fn);
}

int CachedMaxActiveClusters(const void* fn, int threads, size_t smem, int cluster) {
  return CachedHint(g_active_clusters, 0, [&](int* v) {
    // Above 8 CTAs (sm_90 allows 16), once per kernel: the launches that follow rely on it.
    if (cluster > 8) {
      const cudaError_t err =
          cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    const ClusterLaunch launch(dim3(static_cast<unsigned>(cluster)),
                               dim3(static_cast<unsigned>(threads)), smem, nullptr, cluster);
    return cudaOccupancyMaxActiveClusters(v, fn, &launch.config);
  }, fn, threads, smem, cluster);
}

}  // namespace cu

Status QueryCudaDevice(CudaDeviceInfo* info) {
  using cu::CudaCheck;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&info->device), "cudaGetDevice"));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, info->device),
      "cudaDeviceGetAttribute(multiprocessor count)"));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaDeviceGetAttribute(&info->cc_major, cudaDevAttrComputeCapabilityMajor, info->device),
      "cudaDeviceGetAttribute(compute capability)"));
  return CudaCheck(cudaDeviceGetAttribute(&info->max_smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, info->device),
                   "cudaDeviceGetAttribute(shared memory per block)");
}

Status CheckCudaSupport(const GqaShape& s) {
  const char* op = "ai.kvlayout::GroupQueryAttention (CUDA): ";
  // A knob set to a value outside its range fails the call rather than run on a guess.
  if (!Knobs().error.empty()) return Status::Error(std::string(op) + Knobs().error);
  // The kernels put batch x kv head (and batch, num_heads) on a grid axis limited to 65535;
  // the decode kernel adds one row to it (the length checks): batch x kv head at most 65534.
  constexpr int64_t kMaxGridYZ = 65535, kMaxBatchKvHeads = kMaxGridYZ - 1;
  if (s.batch * s.kv_num_heads > kMaxBatchKvHeads) {
    return Status::Error(std::string(op) + "batch x kv_num_heads = " +
                         std::to_string(s.batch * s.kv_num_heads) + " exceeds " +
                         std::to_string(kMaxBatchKvHeads) +
                         " on CUDA in v1 (a grid axis): split the batch");
  }
  if (s.num_heads > kMaxGridYZ) {
    return Status::Error(std::string(op) + "num_heads = " + std::to_string(s.num_heads) +
                         " exceeds " + std::to_string(kMaxGridYZ) + " on CUDA in v1 (a grid axis)");
  }
  if (s.head_size % 8 != 0 || s.head_size > cu::kMaxHeadSize) {
    return Status::Error(std::string(op) + "head_size " + std::to_string(s.head_size) +
                         " is not supported on CUDA: it must be a multiple of 8 and <= " +
                         std::to_string(cu::kMaxHeadSize));
  }
  return Status::Ok();
}

GqaCudaPlan PlanGqaCuda(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev) {
  GqaCudaPlan plan = cu::MakePlan(s, buf, dev);
  plan.stage_bytes = cu::SlidingStageBytes(s);
  return plan;
}

Status LaunchGqaCuda(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
                     const GqaCudaPlan& plan, void* workspace, void* stream,
                     unsigned* decode_counters) {
  KVL_RETURN_IF_ERROR(CheckCudaSupport(s));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (s.dtype) {
    case DType::kFloat32:
      return cu::Launch<float>(s, buf, dev, plan, workspace, decode_counters, st);
    case DType::kFloat16:
      return cu::Launch<__half>(s, buf, dev, plan, workspace, decode_counters, st);
    case DType::kBFloat16:
      return cu::Launch<__nv_bfloat16>(s, buf, dev, plan, workspace, decode_counters, st);
    default:
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): unsupported type ") +
                           DTypeName(s.dtype));
  }
}

}  // namespace kvl
