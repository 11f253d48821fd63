// Merges the key splits of the portable kernel in a fixed order (deterministic): CTA = one query
// row of one (b, kv head). The split weights are computed once per row into shared memory; then
// each thread sums its dimensions over the splits with independent loads.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/online_softmax.cuh"

namespace kvl {
namespace cu {
namespace {

constexpr int kCombineThreads = 128;

__device__ __forceinline__ float BlockMax(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = WarpMax(v);
  __syncthreads();  // scratch free (a previous reduction may still be reading it)
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = -INFINITY;
  for (int w = 0; w < kCombineThreads / kWarp; ++w) r = fmaxf(r, scratch[w]);
  return r;
}
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.0f;
  for (int w = 0; w < kCombineThreads / kWarp; ++w) r += scratch[w];
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(GqaShape s, GqaCudaBuffers buf, AttnPlan plan, const float* part_o,
                  const float* part_m, const float* part_l) {
  __shared__ __align__(16) float weight[kMaxSplits];
  __shared__ float scratch[kCombineThreads / kWarp];
  const int64_t H = s.head_size, G = s.group_size();
  const int64_t rb = blockIdx.x / kRowsPerCta, k = blockIdx.x % kRowsPerCta, bg = blockIdx.y;
  const int64_t r = rb * kRowsPerCta + k;
  if (r >= s.seq_len * G) return;  // uniform over the CTA
  const int64_t b = bg / s.kv_num_heads, g = bg % s.kv_num_heads;
  const int64_t tok = r / G, head = g * G + r % G;
  const int64_t first = ((bg * plan.row_blocks + rb) * plan.splits) * kRowsPerCta + k;
  float mx = -INFINITY;
  for (int64_t sp = threadIdx.x; sp < plan.splits; sp += kCombineThreads) {
    mx = fmaxf(mx, part_m[first + sp * kRowsPerCta]);
  }
  mx = BlockMax(mx, scratch);
  float l = 0.0f;
  for (int64_t sp = threadIdx.x; sp < plan.splits; sp += kCombineThreads) {
    const int64_t slot = first + sp * kRowsPerCta;
    const float w = PartialWeight(part_m[slot], part_l[slot], mx);
    weight[sp] = w;
    l += part_l[slot] * w;
  }
  l = BlockSum(l, scratch);  // its barriers also publish `weight`
  const bool extra = s.has_head_sink || s.smooth_softmax;
  const float sink = s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[head]) : 0.0f;
  const float scale = OutputScale(mx, l, extra, sink);
  T* out = static_cast<T*>(buf.output) + ((b * s.seq_len + tok) * s.num_heads + head) * H;
  const float* po = part_o + first * H;
  const int64_t pitch = kRowsPerCta * H;  // from one split's row to the next
  for (int64_t d = threadIdx.x; d < H; d += kCombineThreads) {
    // Four splits per step, written out: the loads are independent, and no load of `weight`
    // reaches past plan.splits (compute-sanitizer caught a vectorized tail that did).
    float acc = 0.0f;
    int64_t sp = 0;
    for (; sp + 4 <= plan.splits; sp += 4) {
      const float4 w = *reinterpret_cast<const float4*>(weight + sp);
      const float* p = po + sp * pitch + d;
      acc += p[0] * w.x + p[pitch] * w.y + p[2 * pitch] * w.z + p[3 * pitch] * w.w;
    }
    for (; sp < plan.splits; ++sp) acc += po[sp * pitch + d] * weight[sp];
    out[d] = FromF<T>(acc * scale);
  }
}


}  // namespace

template <typename T>
Status LaunchCombine(const GqaShape& s, const GqaCudaBuffers& buf, const AttnPlan& plan,
                     const Workspace& ws, cudaStream_t stream) {
  if (plan.splits == 1) return Status::Ok();
  const dim3 grid(static_cast<unsigned>(plan.row_blocks * kRowsPerCta),
                  static_cast<unsigned>(s.batch * s.kv_num_heads));
  CombineKernel<T><<<grid, kCombineThreads, 0, stream>>>(s, buf, plan, ws.part_o, ws.part_m,
                                                         ws.part_l);
  return CudaCheck(cudaGetLastError(), "combine launch");
}

template Status LaunchCombine<float>(const GqaShape&, const GqaCudaBuffers&, const AttnPlan&,
                                     const Workspace&, cudaStream_t);
template Status LaunchCombine<__half>(const GqaShape&, const GqaCudaBuffers&, const AttnPlan&,
                                      const Workspace&, cudaStream_t);
template Status LaunchCombine<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&,
                                             const AttnPlan&, const Workspace&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
