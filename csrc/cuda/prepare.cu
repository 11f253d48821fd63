// Per new token: queries normed + rotated + scaled into the float workspace (or, for cuDNN,
// rotated into a storage-type copy with the per-entry lengths beside it); K normed + rotated
// and V appended to present at row past + i; the token's lengths checked against the op's
// rules, the first violation recorded. Serves prefill and the portable kernel: the tensor-core
// decode kernel does the same work itself (prepare_rows.cuh holds it for both).
#include "cuda/kernels.h"
#include "cuda/prepare_rows.cuh"

namespace kvl {
namespace cu {
namespace {

constexpr int kPrepareWarps = 8;

template <typename T>
__global__ void PrepareKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, Workspace ws) {
  __shared__ float xs[kPrepareWarps][kMaxHeadSize];
  const int64_t b = blockIdx.x / s.seq_len, i = blockIdx.x % s.seq_len;
  const int lane = threadIdx.x, warp = threadIdx.y;
  if (buf.length_record != nullptr && blockIdx.y == 0 && lane == 0 && warp == 0) {
    CheckLengths(s, buf, b, i);
  }
  const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
  const BatchGeometry g = Geo(s, buf, b);
  if (ws.seq_len_q != nullptr && i == 0 && blockIdx.y == 0 && lane == 0 && warp == 0) {
    // cuDNN's per-entry lengths: its padding mask and bottom-right causal mask follow them.
    ws.seq_len_q[b] = static_cast<int32_t>(g.new_rows);
    ws.seq_len_kv[b] = static_cast<int32_t>(g.total);
  }
  if (!s.is_first_prompt() && i >= g.new_rows) return;  // beyond query_seqlens: unused
  const bool writes_kv = i < WrittenRows(s, g);
  const int64_t pos = ClampedRotaryPosition(s, buf, g, b, i);
  const TokenInputs<T> in(s, buf, b, i);
  float* x = xs[warp];
  // blockIdx.y picks a block of kPrepareWarps heads: a decode step of a small batch spreads
  // over N + Nkv warps instead of queueing them on one CTA.
  for (int64_t h = blockIdx.y * kPrepareWarps + warp; h < N + Nkv;
       h += int64_t(kPrepareWarps) * gridDim.y) {
    if (h >= N) {
      if (!writes_kv) break;
      AppendKvRow<T>(s, buf, present_st, g, b, i, h - N, pos, x, lane);
      continue;
    }
    NormRotateRow<T>(s, buf, in.q + h * H, true, pos, x, lane);
    if (ws.q_storage != nullptr) {  // cuDNN: (B, S, N, H) in T, unscaled (cuDNN scales)
      T* dst = static_cast<T*>(ws.q_storage) + ((b * s.seq_len + i) * N + h) * H;
      for (int64_t d = lane; d < H; d += kWarp) dst[d] = FromF<T>(x[d]);
    } else {
      float* dst = ws.q + ((b * N + h) * s.seq_len + i) * H;
      for (int64_t d = lane; d < H; d += kWarp) dst[d] = x[d] * s.scale;
    }
    __syncwarp();
  }
}

// Head blocks: enough CTAs to fill the GPU's first wave when the batch of tokens is small; one
// CTA per token (all heads) when it is large.
int64_t PrepareHeadBlocks(const GqaShape& s) {
  const int64_t heads = s.num_heads + s.kv_num_heads;
  const int64_t blocks = (heads + kPrepareWarps - 1) / kPrepareWarps;
  return s.batch * s.seq_len >= 256 ? 1 : blocks;
}

}  // namespace

template <typename T>
Status LaunchPrepare(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                     const Workspace& ws, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(s.batch * s.seq_len),
                  static_cast<unsigned>(PrepareHeadBlocks(s)));
  PrepareKernel<T><<<grid, dim3(kWarp, kPrepareWarps), 0, stream>>>(s, buf, present_st, ws);
  return CudaCheck(cudaGetLastError(), "prepare launch");
}

template Status LaunchPrepare<float>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                     const Workspace&, cudaStream_t);
template Status LaunchPrepare<__half>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                      const Workspace&, cudaStream_t);
template Status LaunchPrepare<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                             const Workspace&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
