// Non-shared past -> present: the valid past rows are copied through both layouts' strides and
// the rows nobody writes this call are zeroed (PER_TOKEN: their scales likewise, 0 for the zeroed).
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {
namespace {

constexpr int kCopyWarps = 8;

// One warp per present row (b, h, r): the row's lengths once, then the whole row copied from
// past (r < past), zeroed (r at or past the rows this call writes) or left to the writers. In
// 16-byte pieces when every row starts 16-byte aligned (`vec`), else element by element. An
// element per thread with its own index arithmetic and length reads was 18 us for a first
// prompt of 8192 rows at head size 256 that copies nothing (H200; docs/DECISIONS.md).
// T: the cache's element type (a quantized cache's rows are CacheRow bytes, moved as they are;
// PER_TOKEN: each row's float32 scale, at ScaleIndex of its offset, moves with it).
template <typename T>
__global__ void __launch_bounds__(kCopyWarps* kWarp)
    CopyPastKernel(GqaShape s, GqaCudaBuffers buf, KvStrides past_st, KvStrides present_st,
                   bool vec) {
  const int64_t H = CacheRow(s), C = s.present_capacity;
  const int64_t rows = s.batch * s.kv_num_heads * C;
  const int lane = threadIdx.x % kWarp;
  for (int64_t row = blockIdx.x * int64_t(kCopyWarps) + threadIdx.x / kWarp; row < rows;
       row += int64_t(gridDim.x) * kCopyWarps) {
    const int64_t r = row % C, bh = row / C, h = bh % s.kv_num_heads, b = bh / s.kv_num_heads;
    const BatchGeometry g = Geo(s, buf, b);
    const bool copy = r < g.past;
    if (!copy && r < g.past + WrittenRows(s, g)) continue;  // this call's new rows
    const int64_t dst = present_st.Offset(b, h, r);
    const int64_t src = copy ? past_st.Offset(b, h, r) : 0;
    if (s.per_token() && lane == 0) {  // the row's scales move with it; undefined rows get 0
      buf.present_key_scale[ScaleIndex(s, dst)] =
          copy ? buf.past_key_scale[ScaleIndex(s, src)] : 0.0f;
      buf.present_value_scale[ScaleIndex(s, dst)] =
          copy ? buf.past_value_scale[ScaleIndex(s, src)] : 0.0f;
    }
    if (vec) {
      constexpr int64_t E = 16 / sizeof(T);  // elements per piece
      uint4* kd = reinterpret_cast<uint4*>(static_cast<T*>(buf.present_key) + dst);
      uint4* vd = reinterpret_cast<uint4*>(static_cast<T*>(buf.present_value) + dst);
      const uint4* ks = reinterpret_cast<const uint4*>(static_cast<const T*>(buf.past_key) + src);
      const uint4* vs = reinterpret_cast<const uint4*>(static_cast<const T*>(buf.past_value) + src);
      for (int64_t c = lane; c < H / E; c += kWarp) {
        kd[c] = copy ? ks[c] : make_uint4(0u, 0u, 0u, 0u);
        vd[c] = copy ? vs[c] : make_uint4(0u, 0u, 0u, 0u);
      }
    } else {
      T* kd = static_cast<T*>(buf.present_key) + dst;
      T* vd = static_cast<T*>(buf.present_value) + dst;
      const T* ks = static_cast<const T*>(buf.past_key) + src;
      const T* vs = static_cast<const T*>(buf.past_value) + src;
      for (int64_t d = lane; d < H; d += kWarp) {
        kd[d] = copy ? ks[d] : T{};
        vd[d] = copy ? vs[d] : T{};
      }
    }
  }
}

}  // namespace

template <typename T>
Status LaunchCopyPast(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides past_st,
                      KvStrides present_st, const CudaDeviceInfo& dev, cudaStream_t stream) {
  const int64_t rows = s.batch * s.kv_num_heads * s.present_capacity;
  const int64_t wanted = (rows + kCopyWarps - 1) / kCopyWarps;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, 64 * int64_t(dev.sm_count)));
  return DispatchCache<T>(s, [&](auto tag) {
    using C = typename decltype(tag)::type;
    // Row starts are multiples of a row's elements from the base pointers in both layouts.
    const bool vec = (CacheRow(s) * int64_t(sizeof(C))) % 16 == 0 &&
                     Aligned16({buf.past_key, buf.past_value, buf.present_key, buf.present_value});
    CopyPastKernel<C><<<std::max(blocks, 1), kCopyWarps * kWarp, 0, stream>>>(s, buf, past_st,
                                                                                present_st, vec);
    return CudaCheck(cudaGetLastError(), "copy past launch");
  });
}

template Status LaunchCopyPast<float>(const GqaShape&, const GqaCudaBuffers&, KvStrides, KvStrides,
                                      const CudaDeviceInfo&, cudaStream_t);
template Status LaunchCopyPast<__half>(const GqaShape&, const GqaCudaBuffers&, KvStrides, KvStrides,
                                       const CudaDeviceInfo&, cudaStream_t);
template Status LaunchCopyPast<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                              KvStrides, const CudaDeviceInfo&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
