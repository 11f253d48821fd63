// Sliding window cache (sliding_window_cache=1, docs/CONTRACT.md section 8) on CUDA.
//
// The present is window-sized: after T tokens its rows [0, L(T)) hold positions
// T - L .. T - 1, so a call shifts rows down by present_base - cache_base. Moving rows in place
// races across CTAs (and past and present may be the same buffer), and the attention of a
// multi-token call still needs rows the shift drops. So the call goes through a staging copy in
// the workspace (kernels.h): resident past rows in, prepare/decode append the new rows, the
// attention reads staging row (position - cache_base), then the present is written from
// staging. Every row index comes from ClampedBatchGeometry (lengths read on the device), every
// address from KvStrides; grids depend on sizes only, so the launches are valid under CUDA graph
// capture.
#include <algorithm>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {
namespace {

// Rows move in units U: 16 bytes when every buffer is 16-byte aligned and a row is a multiple of
// 16 bytes (H * sizeof(T) always, since H % 8 == 0; a quantized cache's CacheRow bytes not
// always), else one element. Offsets from KvStrides are multiples of a row's elements, so
// dividing by `per` (elements per unit) is exact.
// Unit u of row r of (batch b, kv head h): the flat index of a grid-stride loop over
// B x Nkv x rows x units, row-major, so consecutive threads move consecutive units of a row.
struct RowUnit {
  int64_t b, h, r, u;
};
__device__ __forceinline__ RowUnit RowUnitOf(int64_t idx, int64_t units, int64_t rows,
                                             int64_t kv_heads) {
  return RowUnit{idx / (units * rows * kv_heads), (idx / (units * rows)) % kv_heads,
                 (idx / units) % rows, idx % units};
}

template <typename U>
__global__ void SlidingStageKernel(GqaShape s, GqaCudaBuffers buf, KvStrides past_st,
                                   KvStrides stage_st, int per, U* stage_k, U* stage_v,
                                   float* stage_ks, float* stage_vs) {
  const int64_t units = CacheRow(s) / per, C = s.past_capacity;
  const int64_t n = s.batch * s.kv_num_heads * C * units;
  const U* pk = static_cast<const U*>(buf.past_key);
  const U* pv = static_cast<const U*>(buf.past_value);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const auto [b, h, r, u] = RowUnitOf(idx, units, C, s.kv_num_heads);
    const BatchGeometry g = Geo(s, buf, b);
    if (r >= g.past - g.cache_base) continue;  // not a resident past row
    const int64_t src = past_st.Offset(b, h, r) / per + u;
    const int64_t dst = stage_st.Offset(b, h, r) / per + u;
    stage_k[dst] = pk[src];
    stage_v[dst] = pv[src];
    if (s.per_token() && u == 0) {  // the row's scales (PER_TOKEN) move with it
      const int64_t ds = ScaleIndex(s, stage_st.Offset(b, h, r));
      const int64_t ss = ScaleIndex(s, past_st.Offset(b, h, r));
      stage_ks[ds] = buf.past_key_scale[ss];
      stage_vs[ds] = buf.past_value_scale[ss];
    }
  }
}

template <typename U>
__global__ void SlidingPresentKernel(GqaShape s, GqaCudaBuffers buf, KvStrides stage_st,
                                     KvStrides present_st, int per, bool shared,
                                     const U* stage_k, const U* stage_v,
                                     const float* stage_ks, const float* stage_vs) {
  const int64_t units = CacheRow(s) / per, C = s.present_capacity;
  const int64_t n = s.batch * s.kv_num_heads * C * units;
  U* pk = static_cast<U*>(buf.present_key);
  U* pv = static_cast<U*>(buf.present_value);
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const auto [b, h, r, u] = RowUnitOf(idx, units, C, s.kv_num_heads);
    const BatchGeometry g = Geo(s, buf, b);
    const int64_t dst = present_st.Offset(b, h, r) / per + u;
    const bool scales = s.per_token() && u == 0;  // PER_TOKEN: the row's scales move with it
    const int64_t ds = scales ? ScaleIndex(s, present_st.Offset(b, h, r)) : 0;
    if (r < g.total - g.present_base) {
      const int64_t row = stage_st.Offset(b, h, g.present_base - g.cache_base + r);
      const int64_t src = row / per + u;
      pk[dst] = stage_k[src];
      pv[dst] = stage_v[src];
      if (scales) {
        buf.present_key_scale[ds] = stage_ks[ScaleIndex(s, row)];
        buf.present_value_scale[ds] = stage_vs[ScaleIndex(s, row)];
      }
    } else if (!shared) {  // a shared buffer's rows past L keep their content, as in ORT
      pk[dst] = U{};
      pv[dst] = U{};
      if (scales) {
        buf.present_key_scale[ds] = 0.0f;
        buf.present_value_scale[ds] = 0.0f;
      }
    }
  }
}

template <typename T>
using ElementBits =
    std::conditional_t<sizeof(T) == 4, uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>;

int CopyBlocks(int64_t n, const CudaDeviceInfo& dev) {
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 8 * dev.sm_count);
  return static_cast<int>(std::max<int64_t>(1, blocks));
}

}  // namespace

int64_t SlidingStageRows(const GqaShape& s) { return s.past_capacity + s.seq_len; }

KvStrides SlidingStageStrides(const GqaShape& s) {
  return MakeKvStrides(s.layout, s.kv_num_heads, SlidingStageRows(s), CacheRow(s));
}

size_t SlidingStageRowBytes(const GqaShape& s) {
  if (!s.sliding_window_cache) return 0;
  const size_t elem = s.quantized() ? 1 : s.dtype == DType::kFloat32 ? 4 : 2;
  const size_t bytes =
      elem * size_t(s.batch * s.kv_num_heads * SlidingStageRows(s) * CacheRow(s));
  return (bytes + 255) / 256 * 256;
}

size_t SlidingStageBytes(const GqaShape& s) {
  if (!s.sliding_window_cache || !s.per_token()) return SlidingStageRowBytes(s);
  const size_t scales = sizeof(float) * size_t(s.batch * s.kv_num_heads * SlidingStageRows(s));
  return SlidingStageRowBytes(s) + (scales + 255) / 256 * 256;
}

// Launches `launch(word, per, words)` for rows of `rows` x CacheRow elements of type T (the
// cache's): in 16-byte words (uint4, `per` elements each) when every pointer is 16-byte aligned
// and a row is whole words, else element by element.
template <typename T, typename Launch>
void LaunchRowCopy(const GqaShape& s, int64_t rows, std::initializer_list<const void*> ptrs,
                   Launch launch) {
  const int64_t row = CacheRow(s);
  if (Aligned16(ptrs) && (row * int64_t(sizeof(T))) % 16 == 0) {
    const int per = 16 / sizeof(T);
    launch(uint4{}, per, rows * (row / per));
  } else {
    launch(ElementBits<T>{}, 1, rows * row);
  }
}

// Resident past rows -> staging rows (`to_present` false: cache_st is the past's strides), or
// staging rows -> present rows [0, L(total)) (true: the present's).
template <typename T>
Status LaunchSlidingCopy(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides cache_st,
                         const Workspace& ws, const CudaDeviceInfo& dev, cudaStream_t stream,
                         bool to_present) {
  const KvStrides stage_st = SlidingStageStrides(s);
  const int64_t rows =
      s.batch * s.kv_num_heads * (to_present ? s.present_capacity : s.past_capacity);
  const void* cache_k = to_present ? buf.present_key : buf.past_key;
  const void* cache_v = to_present ? buf.present_value : buf.past_value;
  auto copy = [&](auto word, int per, int64_t n) {
    using U = decltype(word);
    U* stage_k = static_cast<U*>(ws.stage_k);
    U* stage_v = static_cast<U*>(ws.stage_v);
    if (to_present) {
      SlidingPresentKernel<U><<<CopyBlocks(n, dev), 256, 0, stream>>>(
          s, buf, stage_st, cache_st, per, buf.shared(), stage_k, stage_v, ws.stage_k_scale,
          ws.stage_v_scale);
    } else {
      SlidingStageKernel<U><<<CopyBlocks(n, dev), 256, 0, stream>>>(
          s, buf, cache_st, stage_st, per, stage_k, stage_v, ws.stage_k_scale, ws.stage_v_scale);
    }
  };
  const std::initializer_list<const void*> ptrs = {cache_k, cache_v, ws.stage_k, ws.stage_v};
  DispatchCache<T>(s, [&](auto tag) {
    LaunchRowCopy<typename decltype(tag)::type>(s, rows, ptrs, copy);
  });
  return CudaCheck(cudaGetLastError(), to_present ? "sliding window present launch"
                                                  : "sliding window stage launch");
}

template <typename T>
Status LaunchSlidingStage(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides past_st,
                          const Workspace& ws, const CudaDeviceInfo& dev, cudaStream_t stream) {
  return LaunchSlidingCopy<T>(s, buf, past_st, ws, dev, stream, false);
}

template <typename T>
Status LaunchSlidingPresent(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                            const Workspace& ws, const CudaDeviceInfo& dev, cudaStream_t stream) {
  return LaunchSlidingCopy<T>(s, buf, present_st, ws, dev, stream, true);
}

#define KVL_SLIDING_INSTANTIATE(T)                                                              \
  template Status LaunchSlidingStage<T>(const GqaShape&, const GqaCudaBuffers&, KvStrides,     \
                                        const Workspace&, const CudaDeviceInfo&, cudaStream_t); \
  template Status LaunchSlidingPresent<T>(const GqaShape&, const GqaCudaBuffers&, KvStrides,   \
                                          const Workspace&, const CudaDeviceInfo&, cudaStream_t);
KVL_SLIDING_INSTANTIATE(float)
KVL_SLIDING_INSTANTIATE(__half)
KVL_SLIDING_INSTANTIATE(__nv_bfloat16)
#undef KVL_SLIDING_INSTANTIATE

}  // namespace cu
}  // namespace kvl
