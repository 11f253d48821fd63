// Non-shared past -> present: the valid past rows are copied through both layouts' strides and
// the rows nobody writes this call are zeroed.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace kvl {
namespace cu {
namespace {

template <typename T>
__global__ void CopyPastKernel(GqaShape s, GqaCudaBuffers buf, KvStrides past_st,
                               KvStrides present_st) {
  const int64_t H = s.head_size, C = s.present_capacity;
  const int64_t n = s.batch * s.kv_num_heads * C * H;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = idx % H, r = (idx / H) % C, h = (idx / (H * C)) % s.kv_num_heads;
    const int64_t b = idx / (H * C * s.kv_num_heads);
    const BatchGeometry g = Geo(s, buf, b);
    const int64_t dst = present_st.Offset(b, h, r) + d;
    if (r < g.past) {
      const int64_t src = past_st.Offset(b, h, r) + d;
      static_cast<T*>(buf.present_key)[dst] = static_cast<const T*>(buf.past_key)[src];
      static_cast<T*>(buf.present_value)[dst] = static_cast<const T*>(buf.past_value)[src];
    } else if (r >= g.past + WrittenRows(s, g)) {
      static_cast<T*>(buf.present_key)[dst] = FromF<T>(0.0f);
      static_cast<T*>(buf.present_value)[dst] = FromF<T>(0.0f);
    }
  }
}

}  // namespace

template <typename T>
Status LaunchCopyPast(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides past_st,
                      KvStrides present_st, const CudaDeviceInfo& dev, cudaStream_t stream) {
  const int64_t n = s.batch * s.kv_num_heads * s.present_capacity * s.head_size;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 8 * dev.sm_count));
  CopyPastKernel<T><<<std::max(blocks, 1), 256, 0, stream>>>(s, buf, past_st, present_st);
  return CudaCheck(cudaGetLastError(), "copy past launch");
}

template Status LaunchCopyPast<float>(const GqaShape&, const GqaCudaBuffers&, KvStrides, KvStrides,
                                      const CudaDeviceInfo&, cudaStream_t);
template Status LaunchCopyPast<__half>(const GqaShape&, const GqaCudaBuffers&, KvStrides, KvStrides,
                                       const CudaDeviceInfo&, cudaStream_t);
template Status LaunchCopyPast<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                              KvStrides, const CudaDeviceInfo&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
