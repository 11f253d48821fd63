// Per new token: queries normed + rotated + scaled into the float workspace (or, for cuDNN,
// rotated into a storage-type copy with the per-entry lengths beside it); K normed + rotated
// and V appended to present at row past + i. Also zeroes the decode kernel's split counters, so
// the attention launch that follows on the stream finds them reset (capture-safe, no memset),
// and checks the token's lengths against the op's rules, recording the first violation.
#include "core/length_rules.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace kvl {
namespace cu {
namespace {

constexpr int kPrepareWarps = 8;

// Writes `v` into the host-mapped record unless an earlier violation is still unread there. The
// writer is elected in device memory (`claim` holds the generation last claimed): the first
// thread to move it from the host's `taken` generation to the next one writes the record, then
// publishes it by setting `written`. Rare path: runs only for a violation.
__device__ void RecordViolation(LengthRecord* rec, uint32_t* claim, const LengthViolation& v) {
  const uint32_t taken = rec->taken;
  if (atomicCAS(claim, taken, taken + 1u) != taken) return;  // a record is pending (or racing)
  volatile int64_t* dst = reinterpret_cast<volatile int64_t*>(&rec->violation);
  const int64_t* src = reinterpret_cast<const int64_t*>(&v);
  static_assert(sizeof(LengthViolation) % sizeof(int64_t) == 0, "record copied in 8-byte words");
  for (size_t w = 0; w < sizeof(LengthViolation) / sizeof(int64_t); ++w) dst[w] = src[w];
  __threadfence_system();  // the record before its generation, as the host sees them
  rec->written = taken + 1u;
}

// One thread per (batch entry, token): the rules of core/length_rules.h on the raw values, as the
// CPU op checks them. The batch entry's rules are recorded by its token 0, a position by its own
// token; a position is checked only when the entry's lengths pass (as on the CPU).
__device__ void CheckLengths(const GqaShape& s, const GqaCudaBuffers& buf, int64_t b, int64_t i) {
  const int32_t seqlens = buf.seqlens_k[b];
  const int32_t query_len = s.has_query_seqlens ? buf.query_seqlens[b] : 0;
  LengthViolation v = CheckBatchLengths(s, b, seqlens, query_len);
  if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
    if (i == 0) RecordViolation(buf.length_record, buf.length_claim, v);
    return;
  }
  if (s.rotary_dim == 0) return;
  const BatchGeometry g = GetBatchGeometry(s, seqlens, query_len);
  if (i >= RotaryRowsUsed(s, g)) return;
  v = CheckRotaryPosition(s, b, i, RotaryPosition(s, g, buf.position_ids, b, i));
  if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
    RecordViolation(buf.length_record, buf.length_claim, v);
  }
}

template <typename T>
__global__ void PrepareKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, Workspace ws) {
  unsigned* counters = ws.counters;
  const int64_t counter_count = ws.counter_count;
  __shared__ float xs[kPrepareWarps][kMaxHeadSize];
  {  // every CTA zeroes a slice of the counters before any early return
    const int64_t threads = int64_t(gridDim.x) * gridDim.y * blockDim.x * blockDim.y;
    const int64_t first = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x * blockDim.y +
                          threadIdx.y * blockDim.x + threadIdx.x;
    for (int64_t c = first; c < counter_count; c += threads) counters[c] = 0u;
  }
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
  int64_t pos = 0;
  if (s.rotary_dim > 0) {
    pos = RotaryPosition(s, g, buf.position_ids, b, i);
    pos = pos < 0 ? 0 : (pos >= s.rotary_max_positions ? s.rotary_max_positions - 1 : pos);
  }
  const int64_t q_pitch = s.packed_qkv ? (N + 2 * Nkv) * H : N * H;
  const int64_t q_row = (b * s.seq_len + i) * q_pitch;
  const int64_t kv_row = s.packed_qkv ? q_row + N * H : (b * s.seq_len + i) * Nkv * H;
  const T* k_src = static_cast<const T*>(s.packed_qkv ? buf.query : buf.key);
  const T* v_src = static_cast<const T*>(s.packed_qkv ? buf.query : buf.value);
  const int64_t v_offset = s.packed_qkv ? Nkv * H : 0;
  float* x = xs[warp];
  // blockIdx.y picks a block of kPrepareWarps heads: a decode step of a small batch spreads
  // over N + Nkv warps instead of queueing them on one CTA.
  for (int64_t h = blockIdx.y * kPrepareWarps + warp; h < N + Nkv;
       h += int64_t(kPrepareWarps) * gridDim.y) {
    const bool is_q = h < N;
    if (!is_q && !writes_kv) break;
    const int64_t hk = h - N;
    const T* src = is_q ? static_cast<const T*>(buf.query) + q_row + h * H : k_src + kv_row + hk * H;
    for (int64_t d = lane; d < H; d += kWarp) x[d] = ToF(src[d]);
    __syncwarp();
    const void* w = is_q ? buf.q_norm_weight : buf.k_norm_weight;
    if (w != nullptr) {
      float ss = 0.0f;
      for (int64_t d = lane; d < H; d += kWarp) ss += x[d] * x[d];
      ss = WarpSum(ss);
      const float inv = rsqrtf(ss / H + (is_q ? s.q_norm_epsilon : s.k_norm_epsilon));
      for (int64_t d = lane; d < H; d += kWarp) x[d] = x[d] * inv * ToF(static_cast<const T*>(w)[d]);
      __syncwarp();
    }
    if (s.rotary_dim > 0) {
      const int64_t half = s.rotary_dim / 2;
      const T* cs = static_cast<const T*>(buf.cos_cache) + pos * half;
      const T* sn = static_cast<const T*>(buf.sin_cache) + pos * half;
      for (int64_t p = lane; p < half; p += kWarp) {
        const int64_t i1 = s.interleaved ? 2 * p : p, i2 = s.interleaved ? 2 * p + 1 : p + half;
        const float c = ToF(cs[p]), sv = ToF(sn[p]);
        const float x1 = x[i1], x2 = x[i2];
        x[i1] = x1 * c - x2 * sv;
        x[i2] = x2 * c + x1 * sv;
      }
      __syncwarp();
    }
    if (is_q && ws.q_storage != nullptr) {  // cuDNN: (B, S, N, H) in T, unscaled (cuDNN scales)
      T* dst = static_cast<T*>(ws.q_storage) + ((b * s.seq_len + i) * N + h) * H;
      for (int64_t d = lane; d < H; d += kWarp) dst[d] = FromF<T>(x[d]);
    } else if (is_q) {
      float* dst = ws.q + ((b * N + h) * s.seq_len + i) * H;
      for (int64_t d = lane; d < H; d += kWarp) dst[d] = x[d] * s.scale;
    } else {
      // Row of position past + i: cache_base is row 0 (0 unless a sliding window stages rows).
      const int64_t off = present_st.Offset(b, hk, g.past - g.cache_base + i);
      T* kd = static_cast<T*>(buf.present_key) + off;
      T* vd = static_cast<T*>(buf.present_value) + off;
      const T* vs = v_src + kv_row + v_offset + hk * H;
      for (int64_t d = lane; d < H; d += kWarp) {
        kd[d] = FromF<T>(x[d]);
        vd[d] = vs[d];
      }
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
