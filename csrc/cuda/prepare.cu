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

// A warp's (token, head) row: h in [0, N + Nkv), the token's batch entry b and index i.
struct PrepareRow {
  int64_t h, token, b, i;
};
__device__ __forceinline__ PrepareRow LocateRow(const GqaShape& s, int64_t row) {
  const int64_t heads = s.num_heads + s.kv_num_heads;
  const int64_t h = row % heads, token = row / heads;
  return {h, token, token / s.seq_len, token % s.seq_len};
}

// The entry's lengths, and what one warp per token or entry does with them: the token's length
// checks (its head 0 warp), cuDNN's per-entry lengths (its padding mask and bottom-right causal
// mask follow them; the entry's token 0).
__device__ __forceinline__ BatchGeometry EntryLengthsOnce(const GqaShape& s,
                                                          const GqaCudaBuffers& buf,
                                                          const Workspace& ws, const PrepareRow& r,
                                                          int lane) {
  if (r.h == 0 && lane == 0 && buf.length_record != nullptr) CheckLengths(s, buf, r.b, r.i);
  const BatchGeometry g = Geo(s, buf, r.b);
  if (ws.seq_len_q != nullptr && r.i == 0 && r.h == 0 && lane == 0) {
    ws.seq_len_q[r.b] = static_cast<int32_t>(g.new_rows);
    ws.seq_len_kv[r.b] = static_cast<int32_t>(g.total);
  }
  return g;
}

// One warp per (token, head) row: query heads 0..N-1, then kv heads (K normed and rotated, V
// copied). A CTA per token whose warps looped over the heads left warps idle (3 of 8 at 4/1/256)
// or ran five rows one after another in each (32/8/128), each row a chain of dependent loads:
// 50 us for 8192 tokens at 4/1/256 against ORT's 31 (H200; docs/DECISIONS.md). C: the cache's
// element type (quantized caches: the rows are written as codes, AppendKvRow).
template <typename T, typename C = T>
__global__ void __launch_bounds__(kPrepareWarps* kWarp)
    PrepareKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, Workspace ws) {
  __shared__ float xs[kPrepareWarps][kMaxHeadSize];
  const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t row = blockIdx.x * int64_t(kPrepareWarps) + warp;
  if (row >= s.batch * s.seq_len * (N + Nkv)) return;
  const PrepareRow r = LocateRow(s, row);
  const int64_t h = r.h, token = r.token, b = r.b, i = r.i;
  const BatchGeometry g = EntryLengthsOnce(s, buf, ws, r, lane);
  if (!s.is_first_prompt() && i >= g.new_rows) return;  // beyond query_seqlens: unused
  const int64_t pos = ClampedRotaryPosition(s, buf, g, b, i);
  float* x = xs[warp];
  if (h >= N) {
    if (i < WrittenRows(s, g)) {
      NewKvRow<T, kMaxHeadSize / kWarp> kv;
      kv.Load(s, buf, b, i, h - N, lane);
      AppendKvRow<T, C>(s, buf, present_st, g, b, i, h - N, pos, kv, x, lane);
    }
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

// The fast path, at head sizes 64, 128 and 256 with 2-byte types (PrepareRegsFit): a warp's row
// lives in registers, E = H / 32 contiguous values per lane, loaded and stored as one vector
// each, the rotary partner (half a rotary width away) fetched by a shuffle. The row's loads (and
// V's, and the norm weights') go out before the lengths are read, so a row costs two dependent
// trips (the lengths with the row, then the rotary tables) instead of three, and no shared
// memory. At 4/1/256 B=1 S=8192 it takes 18.1 us where PrepareKernel took 40.1 (ORT's
// UnpackRoPEAppend: 30.9; H200; docs/DECISIONS.md). PrepareKernel serves
// the rest (4-byte types, other head sizes, rows not aligned to the vector, quantized caches).

// E two-byte values from src to dst, both 2E-byte aligned, as one load and one store (the
// caller's row arrays are declared alignas(2 E)).
template <int E>
using RowWord = std::conditional_t<E == 8, uint4, std::conditional_t<E == 4, uint2, uint32_t>>;
template <int E, typename T>
__device__ __forceinline__ void MoveRow(T* dst, const T* src) {
  static_assert(sizeof(T) == 2 && (E == 2 || E == 4 || E == 8), "2, 4 or 8 two-byte values");
  *reinterpret_cast<RowWord<E>*>(dst) = *reinterpret_cast<const RowWord<E>*>(src);
}

// PrepareKernel's work for one (token, head) row per warp, the row in registers (lane l holds
// elements [l E, l E + E)). The host takes it only where PrepareRegsFit holds.
template <typename T, int E>
__global__ void __launch_bounds__(kPrepareWarps* kWarp)
    PrepareRegsKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, Workspace ws) {
  constexpr int H = E * kWarp;
  const int64_t N = s.num_heads, Nkv = s.kv_num_heads;
  const int lane = threadIdx.x % kWarp;
  const int64_t row = blockIdx.x * int64_t(kPrepareWarps) + threadIdx.x / kWarp;
  if (row >= s.batch * s.seq_len * (N + Nkv)) return;
  const PrepareRow r = LocateRow(s, row);
  const int64_t h = r.h, token = r.token, b = r.b, i = r.i;
  const bool is_q = h < N;
  const TokenInputs<T> in(s, buf, b, i);
  // Vector-aligned: MoveRow moves them as one 2E-byte word (in registers at -O3, but a -G
  // build keeps them in local memory).
  alignas(2 * E) T raw[E], val[E], wt[E];
  MoveRow<E>(raw, (is_q ? in.q + h * H : in.k + (h - N) * H) + lane * E);
  if (!is_q) MoveRow<E>(val, in.v + (h - N) * H + lane * E);
  const bool norm = is_q ? s.has_q_norm : s.has_k_norm;
  if (norm) {
    MoveRow<E>(wt, static_cast<const T*>(is_q ? buf.q_norm_weight : buf.k_norm_weight) + lane * E);
  }
  const BatchGeometry g = EntryLengthsOnce(s, buf, ws, r, lane);
  if (!s.is_first_prompt() && i >= g.new_rows) return;  // beyond query_seqlens: unused
  if (!is_q && i >= WrittenRows(s, g)) return;
  float x[E];
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = ToF(raw[k]);
  if (norm) {
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < E; ++k) ss += x[k] * x[k];
    ss = WarpSum(ss);
    const float inv = rsqrtf(ss / H + (is_q ? s.q_norm_epsilon : s.k_norm_epsilon));
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = x[k] * inv * ToF(wt[k]);
  }
  if (s.rotary_dim > 0) {
    const int64_t pos = ClampedRotaryPosition(s, buf, g, b, i);
    const int64_t half = s.rotary_dim / 2, d0 = int64_t(lane) * E;
    const T* cs = static_cast<const T*>(buf.cos_cache) + pos * half;
    const T* sn = static_cast<const T*>(buf.sin_cache) + pos * half;
    if (s.interleaved) {  // pairs (2p, 2p + 1) inside the lane's values
#pragma unroll
      for (int k = 0; k < E; k += 2) {
        if (d0 + k < s.rotary_dim) {
          const int64_t p = (d0 + k) / 2;
          const float c = ToF(cs[p]), sv = ToF(sn[p]), x1 = x[k], x2 = x[k + 1];
          x[k] = x1 * c - x2 * sv;
          x[k + 1] = x2 * c + x1 * sv;
        }
      }
    } else {  // pairs (p, p + half): the partner's values half / E lanes away (half % E == 0)
      const int off = static_cast<int>(half / E);
      const int partner = d0 < half ? lane + off : (d0 < s.rotary_dim ? lane - off : lane);
      float px[E];
#pragma unroll
      for (int k = 0; k < E; ++k) px[k] = __shfl_sync(0xffffffffu, x[k], partner);
      if (d0 < s.rotary_dim) {
        const bool first = d0 < half;
        const int64_t p0 = first ? d0 : d0 - half;
#pragma unroll
        for (int k = 0; k < E; ++k) {
          const float c = ToF(cs[p0 + k]), sv = ToF(sn[p0 + k]);
          x[k] = first ? x[k] * c - px[k] * sv : x[k] * c + px[k] * sv;
        }
      }
    }
  }
  if (!is_q) {
    const int64_t off = present_st.Offset(b, h - N, g.past - g.cache_base + i) + lane * E;
    alignas(2 * E) T out[E];
#pragma unroll
    for (int k = 0; k < E; ++k) out[k] = FromF<T>(x[k]);
    MoveRow<E>(static_cast<T*>(buf.present_key) + off, out);
    MoveRow<E>(static_cast<T*>(buf.present_value) + off, val);
  } else if (ws.q_storage != nullptr) {  // cuDNN: (B, S, N, H) in T, unscaled (cuDNN scales)
    alignas(2 * E) T out[E];
#pragma unroll
    for (int k = 0; k < E; ++k) out[k] = FromF<T>(x[k]);
    MoveRow<E>(static_cast<T*>(ws.q_storage) + (token * N + h) * H + lane * E, out);
  } else {
    float* dst = ws.q + ((b * N + h) * s.seq_len + i) * H + lane * E;
#pragma unroll
    for (int k = 0; k < E; k += 2) {
      *reinterpret_cast<float2*>(dst + k) = make_float2(x[k] * s.scale, x[k + 1] * s.scale);
    }
  }
}

// Where PrepareRegsKernel serves: 2-byte types, head size 64, 128 or 256, a rotary width whose
// half is whole lanes' values, and every row it loads or stores aligned to its vector (rows
// start at multiples of H elements from these pointers; 16 bytes covers every E).
template <typename T>
bool PrepareRegsFit(const GqaShape& s, const GqaCudaBuffers& buf, const Workspace& ws) {
  const int64_t H = s.head_size, E = H / kWarp;
  if (sizeof(T) != 2 || (H != 64 && H != 128 && H != 256)) return false;
  if (s.rotary_dim > 0 && s.rotary_dim % (2 * E) != 0) return false;
  return Aligned16({buf.query, buf.key, buf.value, buf.present_key, buf.present_value, ws.q,
                    ws.q_storage, buf.q_norm_weight, buf.k_norm_weight});
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
  if (s.quantized()) {  // the codes of the new rows, written by AppendKvRow
    return DispatchCache<T>(s, [&](auto tag) {
      using C = typename decltype(tag)::type;
      PrepareKernel<T, C><<<static_cast<unsigned>(blocks), kPrepareWarps * kWarp, 0, stream>>>(
          s, buf, present_st, ws);
      return CudaCheck(cudaGetLastError(), "prepare launch");
    });
  }
  if constexpr (sizeof(T) == 2) {
    if (PrepareRegsFit<T>(s, buf, ws)) {
      auto kernel = s.head_size == 64    ? PrepareRegsKernel<T, 2>
                    : s.head_size == 128 ? PrepareRegsKernel<T, 4>
                                         : PrepareRegsKernel<T, 8>;
      kernel<<<static_cast<unsigned>(blocks), kPrepareWarps * kWarp, 0, stream>>>(s, buf,
                                                                                present_st, ws);
      return CudaCheck(cudaGetLastError(), "prepare launch");
    }
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
