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

// One warp per (token, head) row: query heads 0..N-1, then kv heads (K normed and rotated, V
// copied). A CTA per token whose warps looped over the heads left warps idle (5 of 8 at 4/1/256)
// or ran five rows one after another in each (32/8/128), each row a chain of dependent loads:
// 50 us for 8192 tokens at 4/1/256 against ORT's 31 (H200, docs/BENCHMARKS.md, sixteenth
// session).
template <typename T>
__global__ void __launch_bounds__(kPrepareWarps* kWarp)
    PrepareKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, Workspace ws) {
  __shared__ float xs[kPrepareWarps][kMaxHeadSize];
  const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t row = blockIdx.x * int64_t(kPrepareWarps) + warp;
  if (row >= s.batch * s.seq_len * (N + Nkv)) return;
  const int64_t h = row % (N + Nkv), token = row / (N + Nkv);
  const int64_t b = token / s.seq_len, i = token % s.seq_len;
  if (h == 0 && lane == 0 && buf.length_record != nullptr) CheckLengths(s, buf, b, i);
  const BatchGeometry g = Geo(s, buf, b);
  if (ws.seq_len_q != nullptr && i == 0 && h == 0 && lane == 0) {
    // cuDNN's per-entry lengths: its padding mask and bottom-right causal mask follow them.
    ws.seq_len_q[b] = static_cast<int32_t>(g.new_rows);
    ws.seq_len_kv[b] = static_cast<int32_t>(g.total);
  }
  if (!s.is_first_prompt() && i >= g.new_rows) return;  // beyond query_seqlens: unused
  const int64_t pos = ClampedRotaryPosition(s, buf, g, b, i);
  float* x = xs[warp];
  if (h >= N) {
    if (i < WrittenRows(s, g)) AppendKvRow<T>(s, buf, present_st, g, b, i, h - N, pos, x, lane);
    return;
  }
  const TokenInputs<T> in(s, buf, b, i);
  NormRotateRow<T>(s, buf, in.q + h * H, true, pos, x, lane);
  if (ws.q_storage != nullptr) {  // cuDNN: (B, S, N, H) in T, unscaled (cuDNN scales)
    T* dst = static_cast<T*>(ws.q_storage) + (token * N + h) * H;
    for (int64_t d = lane; d < H; d += kWarp) dst[d] = FromF<T>(x[d]);
  } else {
    float* dst = ws.q + ((b * N + h) * s.seq_len + i) * H;
    for (int64_t d = lane; d < H; d += kWarp) dst[d] = x[d] * s.scale;
  }
}

}  // namespace

template <typename T>
Status LaunchPrepare(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                     const Workspace& ws, cudaStream_t stream) {
  const int64_t rows = s.batch * s.seq_len * (s.num_heads + s.kv_num_heads);
  const int64_t blocks = (rows + kPrepareWarps - 1) / kPrepareWarps;
  if (blocks > INT32_MAX) {
    return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): " + std::to_string(rows) +
                         " query and key rows exceed one prepare launch");
  }
  PrepareKernel<T><<<static_cast<unsigned>(blocks), kPrepareWarps * kWarp, 0, stream>>>(
      s, buf, present_st, ws);
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
