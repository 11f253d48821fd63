// CUDA GroupQueryAttention (portable path): copy past -> present, fused norm + RoPE + append,
// split-K online-softmax attention over the cache, and a deterministic combine.
#include "cuda/gqa_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "core/kv_strides.h"
#include "cuda/ptx.cuh"

namespace kvl {
namespace {

Status CudaCheck(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): ") + what + ": " +
                       cudaGetErrorString(err));
}

// ---- element conversions ---------------------------------------------------------------------
__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The two (or one, for float) elements of a 32-bit word of a row.
__device__ __forceinline__ float2 Unpack(uint32_t w, const __half*) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 Unpack(uint32_t w, const __nv_bfloat16*) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}

constexpr int kWarp = 32;
constexpr int kRowsPerWarp = 4;
constexpr int kWarps = 4;
constexpr int kRowsPerCta = kRowsPerWarp * kWarps;  // query rows (token x head) per CTA
// Row k of a CTA belongs to warp k % kWarps (slot k / kWarps): a decode step's few rows (one
// per query head of the group) land on different warps instead of all on warp 0.
__device__ __forceinline__ int CtaRow(int warp, int slot) { return slot * kWarps + warp; }
constexpr int kTileKeys = 32;                       // one key per lane
constexpr int kMaxHeadSize = 256;
constexpr int kPrepareWarps = 8;

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ BatchGeometry Geo(const GqaShape& s, const GqaCudaBuffers& buf,
                                             int64_t b) {
  return ClampedBatchGeometry(s, buf.seqlens_k[b],
                              s.has_query_seqlens ? buf.query_seqlens[b] : 0);
}

__device__ __forceinline__ int64_t WrittenRows(const GqaShape& s, const BatchGeometry& g) {
  return s.is_first_prompt() ? s.seq_len : g.new_rows;  // a first prompt writes padding rows
}

// ---- 1. past -> separate present; rows nobody writes this call are zeroed --------------------
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

// ---- 2. per token: queries normed + rotated + scaled -> float workspace; K normed + rotated
//         and V appended to present at row past + i. One warp per head. ----------------------
template <typename T>
__global__ void PrepareKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st,
                              float* q_ws) {
  __shared__ float xs[kPrepareWarps][kMaxHeadSize];
  const int64_t b = blockIdx.x / s.seq_len, i = blockIdx.x % s.seq_len;
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
  const BatchGeometry g = Geo(s, buf, b);
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
    if (is_q) {
      float* dst = q_ws + ((b * N + h) * s.seq_len + i) * H;
      for (int64_t d = lane; d < H; d += kWarp) dst[d] = x[d] * s.scale;
    } else {
      const int64_t off = present_st.Offset(b, hk, g.past + i);
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

// ---- 3. attention: CTA = (16 query rows of one KV group, batch x kv head, key split) ---------
constexpr int64_t kMaxSplits = 1024;  // the combine kernel keeps one weight per split

struct AttnPlan {
  int64_t row_blocks = 1;  // per (b, kv head): ceil(S * G / kRowsPerCta)
  int64_t splits = 1;      // key splits; from sizes and SM count only (capture-safe)
  size_t q_bytes = 0, part_o_bytes = 0, part_ml_bytes = 0;
};

// Keys per split when `keys` keys are spread over `splits` splits, in whole multiples of `unit`.
__host__ __device__ __forceinline__ int64_t SplitChunk(int64_t keys, int64_t splits, int64_t unit) {
  const int64_t per = (keys + splits - 1) / splits;
  return (per + unit - 1) / unit * unit;
}

// The decode kernel (3c) serves one new token per entry in fp16/bf16 for groups of up to 8 query
// heads per KV head; the portable kernel (3) everything else.
constexpr int kDecMaxGroup = 8;
bool UseDecodeKernel(const GqaShape& s) {
  return (s.dtype == DType::kFloat16 || s.dtype == DType::kBFloat16) && s.seq_len == 1 &&
         s.group_size() <= kDecMaxGroup;
}

int DecodeCtasPerSm(const GqaShape& s);  // occupancy of the decode kernel serving `s`

AttnPlan MakePlan(const GqaShape& s, const CudaDeviceInfo& dev) {
  AttnPlan p;
  p.row_blocks = (s.seq_len * s.group_size() + kRowsPerCta - 1) / kRowsPerCta;
  const int64_t base = s.batch * s.kv_num_heads * p.row_blocks;
  // A split below ~64 keys is not worth its combine.
  const int64_t max_splits = std::max<int64_t>(1, s.present_capacity / 64);
  const int64_t sms = std::max(1, dev.sm_count);
  if (UseDecodeKernel(s)) {
    // One full wave: as many splits as fit beside the other CTAs (the splits share the keys
    // evenly, so a partial second wave would only add a tail).
    const int64_t slots = sms * DecodeCtasPerSm(s);
    p.splits = std::min(max_splits, std::max<int64_t>(1, slots / base));
  } else {
    // The portable kernel waits on each of its tiles: eight CTAs per SM keep loads in flight.
    const int64_t target = 8 * sms;
    p.splits = base >= target ? 1 : std::min(max_splits, (target + base - 1) / base);
  }
  p.splits = std::min(p.splits, kMaxSplits);
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  p.q_bytes = align(sizeof(float) * s.batch * s.num_heads * s.seq_len * s.head_size);
  if (p.splits > 1) {
    const size_t rows = size_t(base) * p.splits * kRowsPerCta;
    p.part_o_bytes = align(sizeof(float) * rows * s.head_size);
    p.part_ml_bytes = align(sizeof(float) * rows);
  }
  return p;
}

size_t SmemBytes(const GqaShape& s, size_t elem) {
  const size_t words = s.head_size * elem / 4 + 1;  // +1 word: lanes hit distinct banks
  return sizeof(float) * kRowsPerCta * s.head_size + sizeof(uint32_t) * kTileKeys * words +
         elem * kTileKeys * s.head_size + sizeof(float) * kWarps * kTileKeys;
}

template <typename T>
__device__ __forceinline__ float DotRow(const float* q, const uint32_t* k, int64_t words) {
  float acc = 0.0f;
  if constexpr (sizeof(T) == 4) {
    for (int64_t w = 0; w < words; ++w) acc += q[w] * __uint_as_float(k[w]);
  } else {
    for (int64_t w = 0; w < words; ++w) {
      const float2 kv = Unpack(k[w], static_cast<const T*>(nullptr));
      acc += q[2 * w] * kv.x + q[2 * w + 1] * kv.y;
    }
  }
  return acc;
}

template <typename T>
__global__ void __launch_bounds__(kWarp* kWarps)
    AttentionKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, const float* q_ws,
                    AttnPlan plan, float* part_o, float* part_m, float* part_l) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t H = s.head_size, G = s.group_size();
  const int64_t words = H * int64_t(sizeof(T)) / 4;
  const int64_t pitch = words + 1;
  float* qs = reinterpret_cast<float*>(smem);
  uint32_t* ks = reinterpret_cast<uint32_t*>(qs + kRowsPerCta * H);
  T* vs = reinterpret_cast<T*>(ks + kTileKeys * pitch);
  float* ps = reinterpret_cast<float*>(vs + kTileKeys * H);

  const int64_t b = blockIdx.y / s.kv_num_heads, g = blockIdx.y % s.kv_num_heads;
  const int64_t rb = blockIdx.x, split = blockIdx.z;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const BatchGeometry geo = Geo(s, buf, b);

  // Rows of this CTA: flattened (token, head of the group), token-major.
  int64_t row_lo[kRowsPerWarp], row_hi[kRowsPerWarp], row_tok[kRowsPerWarp], row_head[kRowsPerWarp];
  int64_t key_lo = INT64_MAX, key_hi = 0;
  for (int k = 0; k < kRowsPerCta; ++k) {
    const int64_t r = rb * kRowsPerCta + k;
    const int64_t tok = r / G, head = g * G + r % G;
    int64_t lo = 0, hi = 0;
    if (r < s.seq_len * G) {
      const KeyRange keys = QueryKeyRange(s, geo, tok);
      lo = keys.lo;
      hi = keys.hi;
    }
    if (lo < hi) {
      key_lo = min(key_lo, lo);
      key_hi = max(key_hi, hi);
    }
    if (k % kWarps == warp) {
      row_lo[k / kWarps] = lo;
      row_hi[k / kWarps] = hi;
      row_tok[k / kWarps] = tok;
      row_head[k / kWarps] = head;
    }
    // Stage this row's query (zeros for rows without keys).
    const float* qsrc = q_ws + ((b * s.num_heads + head) * s.seq_len + tok) * H;
    for (int64_t d = threadIdx.x; d < H; d += blockDim.x) {
      qs[k * H + d] = lo < hi ? qsrc[d] : 0.0f;
    }
  }
  // This split's share of the CTA's keys: partitioned here, from the lengths on the device, so
  // a grid sized by the capacity spreads whatever length is live over all of its splits.
  if (key_lo < key_hi) {
    const int64_t chunk = SplitChunk(key_hi - key_lo, plan.splits, kTileKeys);
    key_lo += split * chunk;
    key_hi = min(key_hi, key_lo + chunk);
  }

  constexpr int kDims = kMaxHeadSize / kWarp;
  float o[kRowsPerWarp][kDims];
  float m[kRowsPerWarp], l[kRowsPerWarp];
  for (int k = 0; k < kRowsPerWarp; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
    for (int e = 0; e < kDims; ++e) o[k][e] = 0.0f;
  }
  const T* pk = static_cast<const T*>(buf.present_key);
  const T* pv = static_cast<const T*>(buf.present_value);
  const T* bias = static_cast<const T*>(buf.attention_bias);
  const bool aligned16 =
      (reinterpret_cast<uintptr_t>(pk) | reinterpret_cast<uintptr_t>(pv)) % 16 == 0;
  for (int64_t k0 = key_lo; k0 < key_hi; k0 += kTileKeys) {
    __syncthreads();  // previous tile fully consumed (and qs staged, on the first tile)
    // 16-byte loads when the caches are 16-byte aligned (a row is H * sizeof(T) bytes, a
    // multiple of 16 since H % 8 == 0); a cache bound at an odd offset takes element loads.
    const int64_t quads = words / 4;
    for (int64_t idx = threadIdx.x; aligned16 && idx < kTileKeys * quads; idx += blockDim.x) {
      const int64_t j = idx / quads, w = (idx % quads) * 4;
      uint4 kq = make_uint4(0, 0, 0, 0), vq = make_uint4(0, 0, 0, 0);
      if (k0 + j < key_hi) {
        const int64_t off = present_st.Offset(b, g, k0 + j);
        kq = reinterpret_cast<const uint4*>(pk + off)[w / 4];
        vq = reinterpret_cast<const uint4*>(pv + off)[w / 4];
      }
      uint32_t* kd = ks + j * pitch + w;  // odd pitch: word stores
      kd[0] = kq.x;
      kd[1] = kq.y;
      kd[2] = kq.z;
      kd[3] = kq.w;
      reinterpret_cast<uint4*>(vs + j * H)[w / 4] = vq;
    }
    for (int64_t idx = threadIdx.x; !aligned16 && idx < kTileKeys * H; idx += blockDim.x) {
      const int64_t j = idx / H, d = idx % H;
      T kv = FromF<T>(0.0f), vv = FromF<T>(0.0f);
      if (k0 + j < key_hi) {
        const int64_t off = present_st.Offset(b, g, k0 + j) + d;
        kv = pk[off];
        vv = pv[off];
      }
      reinterpret_cast<T*>(ks + j * pitch)[d] = kv;
      vs[j * H + d] = vv;
    }
    __syncthreads();
    for (int k = 0; k < kRowsPerWarp; ++k) {
      if (row_lo[k] >= k0 + kTileKeys || row_hi[k] <= k0 || row_lo[k] >= row_hi[k]) continue;
      const int64_t key = k0 + lane;
      float sc = DotRow<T>(qs + CtaRow(warp, k) * H, ks + lane * pitch, words);
      if (s.softcap > 0.0f) sc = s.softcap * tanhf(sc / s.softcap);
      // Keys of the tile past this split's end are zero-filled rows: never live.
      const bool live = key >= row_lo[k] && key < row_hi[k] && key < key_hi;
      if (bias != nullptr && live) {
        const int64_t bb = s.bias_batch == 1 ? 0 : b, bh = s.bias_heads == 1 ? 0 : row_head[k];
        sc += ToF(bias[((bb * s.bias_heads + bh) * s.seq_len + row_tok[k]) * s.bias_total + key]);
      }
      if (!live) sc = -INFINITY;
      const float tile_max = WarpMax(sc);
      if (tile_max == -INFINITY) continue;  // every live score is -inf (a -inf bias)
      const float m_new = fmaxf(m[k], tile_max);
      const float p = live ? __expf(sc - m_new) : 0.0f;
      const float alpha = m[k] == -INFINITY ? 0.0f : __expf(m[k] - m_new);
      l[k] = l[k] * alpha + WarpSum(p);
      m[k] = m_new;
      ps[warp * kTileKeys + lane] = p;
      __syncwarp();
      for (int e = 0; e < kDims; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d >= H) break;
        float acc = o[k][e] * alpha;
        for (int j = 0; j < kTileKeys; ++j) acc += ps[warp * kTileKeys + j] * ToF(vs[j * H + d]);
        o[k][e] = acc;
      }
      __syncwarp();
    }
  }

  for (int k = 0; k < kRowsPerWarp; ++k) {
    const int64_t r = rb * kRowsPerCta + CtaRow(warp, k);
    if (r >= s.seq_len * G) continue;
    if (plan.splits > 1) {
      const int64_t slot = ((blockIdx.y * plan.row_blocks + rb) * plan.splits + split) *
                               kRowsPerCta + CtaRow(warp, k);
      if (lane == 0) {
        part_m[slot] = m[k];
        part_l[slot] = l[k];
      }
      for (int e = 0; e < kDims; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < H) part_o[slot * H + d] = o[k][e];
      }
      continue;
    }
    const bool extra = s.has_head_sink || s.smooth_softmax;
    const float sink = s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[row_head[k]]) : 0.0f;
    const float scale = OutputScale(m[k], l[k], extra, sink);
    T* out = static_cast<T*>(buf.output) +
             ((b * s.seq_len + row_tok[k]) * s.num_heads + row_head[k]) * H;
    for (int e = 0; e < kDims; ++e) {
      const int64_t d = lane + e * kWarp;
      if (d < H) out[d] = FromF<T>(o[k][e] * scale);
    }
  }
}

// ---- 3c. decode (fp16/bf16, one new token): CTA = (key split, batch x kv head), 4 warps. ------
// A group of LPK lanes owns one key at a time, 16 bytes of its K and V rows per lane, and keeps
// its own online softmax for the G <= GM query heads of the KV group in registers; the groups
// merge once, at the end. Rows reach shared memory through cp.async, kDecStages - 1 steps ahead
// of use, which is what keeps HBM busy. Each lane reads back only the 16-byte slots it copied
// itself, so the key loop has no barrier.
constexpr int kDecThreads = 128;
constexpr int kDecStages = 4;

// Keys per lane group per step for groups of up to `gm` heads (registers: 16 per key).
__host__ __device__ constexpr int DecKeysPerLaneStep(int64_t gm) { return gm >= 8 ? 2 : 4; }

int DecodeLanesPerKey(int64_t head_size) {  // 16-byte chunks of a row, a power of two >= 4
  return head_size <= 32 ? 4 : head_size <= 64 ? 8 : head_size <= 128 ? 16 : 32;
}

// Dynamic shared memory of the decode kernel: the cp.async stages, reused for the final merge.
size_t DecodeSmemBytes(int64_t group_max, int64_t lanes_per_key) {
  const size_t stages = size_t(kDecStages) * 2 * DecKeysPerLaneStep(group_max) * kDecThreads * 16;
  const size_t merge = sizeof(float) * (kDecThreads / lanes_per_key) * group_max * lanes_per_key * 8;
  return std::max(stages, merge);
}

template <typename T>
__device__ __forceinline__ void Unpack8(const uint4& w, float (&x)[8]) {
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Unpack(u[i], static_cast<const T*>(nullptr));
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

template <typename T, int LPK, int GM>
__global__ void __launch_bounds__(kDecThreads)
    DecodeKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, const float* q_ws,
                 AttnPlan plan, float* part_o, float* part_m, float* part_l) {
  constexpr int NL = DecKeysPerLaneStep(GM);
  constexpr int kGroups = kDecThreads / LPK;      // lane groups per CTA
  extern __shared__ __align__(16) unsigned char dec_smem[];
  uint4* stage = reinterpret_cast<uint4*>(dec_smem);  // [kDecStages][K, V][NL][thread]
  __shared__ float red_m[kGroups][GM], red_l[kGroups][GM];

  const int64_t H = s.head_size, G = s.group_size();
  const int t = threadIdx.x, dl = t % LPK, grp = t / LPK;
  const int64_t bg = blockIdx.y, b = bg / s.kv_num_heads, g = bg % s.kv_num_heads;
  const int64_t split = blockIdx.x;
  const bool lane_dims = dl * 8 < H;  // this lane's 8 dimensions exist
  const BatchGeometry geo = Geo(s, buf, b);
  const KeyRange keys = QueryKeyRange(s, geo, 0);
  int64_t k_begin = keys.lo, k_end = keys.lo;
  if (keys.lo < keys.hi) {
    const int64_t chunk = SplitChunk(keys.hi - keys.lo, plan.splits, 64);
    k_begin = keys.lo + split * chunk;
    k_end = min(keys.hi, k_begin + chunk);
  }
  const T* pk = static_cast<const T*>(buf.present_key);
  const T* pv = static_cast<const T*>(buf.present_value);
  const T* bias = static_cast<const T*>(buf.attention_bias);
  const int64_t bias_b = s.bias_batch == 1 ? 0 : b;

  // Every lane runs the same steps (the shuffles below span the warp's groups); keys past the
  // split's end are zero-filled and masked.
  constexpr int64_t kStep = int64_t(kGroups) * NL;
  const int64_t steps = k_begin < k_end ? (k_end - k_begin + kStep - 1) / kStep : 0;
  auto issue = [&](int64_t step) {
    uint4* slot = stage + (step % kDecStages) * 2 * NL * kDecThreads + t;
#pragma unroll
    for (int i = 0; i < NL; ++i) {  // key base + grp + i * kGroups: the groups interleave
      const int64_t key = k_begin + step * kStep + grp + int64_t(i) * kGroups;
      const bool valid = key < k_end && lane_dims;
      const int64_t off = valid ? present_st.Offset(b, g, key) + dl * 8 : 0;
      ptx::CpAsync16(slot + i * kDecThreads, pk + off, valid);
      ptx::CpAsync16(slot + (NL + i) * kDecThreads, pv + off, valid);
    }
  };
#pragma unroll
  for (int j = 0; j < kDecStages - 1; ++j) {
    if (j < steps) issue(j);
    ptx::CpAsyncCommit();  // empty groups too: the wait below counts groups
  }

  float q[GM][8], acc[GM][8], m[GM], l[GM];
#pragma unroll
  for (int gi = 0; gi < GM; ++gi) {
    m[gi] = -INFINITY;
    l[gi] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[gi][e] = 0.0f;
    const float* qsrc = q_ws + (b * s.num_heads + g * G + gi) * H + dl * 8;
    const bool in = gi < G && lane_dims;
    const float4 lo4 = in ? reinterpret_cast<const float4*>(qsrc)[0] : make_float4(0, 0, 0, 0);
    const float4 hi4 = in ? reinterpret_cast<const float4*>(qsrc)[1] : make_float4(0, 0, 0, 0);
    q[gi][0] = lo4.x, q[gi][1] = lo4.y, q[gi][2] = lo4.z, q[gi][3] = lo4.w;
    q[gi][4] = hi4.x, q[gi][5] = hi4.y, q[gi][6] = hi4.z, q[gi][7] = hi4.w;
  }

  for (int64_t step = 0; step < steps; ++step) {
    ptx::CpAsyncWait<kDecStages - 2>();  // this step's group has landed (for this lane's slots)
    const uint4* slot = stage + (step % kDecStages) * 2 * NL * kDecThreads + t;
    uint4 kr[NL], vr[NL];
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      kr[i] = slot[i * kDecThreads];
      vr[i] = slot[(NL + i) * kDecThreads];
    }
    // Refill the slot consumed one step ago.
    if (step + kDecStages - 1 < steps) issue(step + kDecStages - 1);
    ptx::CpAsyncCommit();
    const int64_t k0 = k_begin + step * kStep + grp;
    float sc[NL][GM];
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      float k8[8];
      Unpack8<T>(kr[i], k8);
#pragma unroll
      for (int gi = 0; gi < GM; ++gi) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d += q[gi][e] * k8[e];
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        sc[i][gi] = d;
      }
    }
#pragma unroll
    for (int gi = 0; gi < GM; ++gi) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < NL; ++i) {
        const int64_t key = k0 + int64_t(i) * kGroups;
        float x = sc[i][gi];
        if (s.softcap > 0.0f) x = s.softcap * tanhf(x / s.softcap);
        if (bias != nullptr && key < k_end && gi < G) {
          const int64_t bh = s.bias_heads == 1 ? 0 : g * G + gi;
          x += ToF(bias[(bias_b * s.bias_heads + bh) * s.seq_len * s.bias_total + key]);
        }
        sc[i][gi] = key < k_end ? x : -INFINITY;
        mx = fmaxf(mx, sc[i][gi]);
      }
      const float m_new = fmaxf(m[gi], mx);
      if (m_new == -INFINITY) continue;  // nothing live for this head yet
      const float alpha = __expf(m[gi] - m_new);  // 0 when m was -inf
      l[gi] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[gi][e] *= alpha;
      m[gi] = m_new;
#pragma unroll
      for (int i = 0; i < NL; ++i) sc[i][gi] = __expf(sc[i][gi] - m_new);  // -inf -> 0
    }
#pragma unroll
    for (int i = 0; i < NL; ++i) {
      float v8[8];
      Unpack8<T>(vr[i], v8);
#pragma unroll
      for (int gi = 0; gi < GM; ++gi) {
        if (m[gi] == -INFINITY) continue;
        l[gi] += sc[i][gi];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[gi][e] += sc[i][gi] * v8[e];
      }
    }
  }

  // Merge the lane groups (fixed order: deterministic), in the stage buffer: every copy has
  // landed (only empty groups can be pending) and every lane is past its last read of it.
  ptx::CpAsyncWait<0>();
  __syncthreads();
  auto red_o = reinterpret_cast<float(*)[GM][LPK * 8]>(dec_smem);  // [kGroups][GM][LPK * 8]
#pragma unroll
  for (int gi = 0; gi < GM; ++gi) {
    if (lane_dims) {
#pragma unroll
      for (int e = 0; e < 8; ++e) red_o[grp][gi][dl * 8 + e] = acc[gi][e];
    }
    if (dl == 0) {
      red_m[grp][gi] = m[gi];
      red_l[grp][gi] = l[gi];
    }
  }
  __syncthreads();
  const bool extra = s.has_head_sink || s.smooth_softmax;
  for (int64_t idx = t; idx < G * H; idx += kDecThreads) {
    const int gi = static_cast<int>(idx / H);
    const int64_t d = idx % H;
    float mx = -INFINITY;
    for (int k = 0; k < kGroups; ++k) mx = fmaxf(mx, red_m[k][gi]);
    float lsum = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
      for (int k = 0; k < kGroups; ++k) {
        if (red_m[k][gi] == -INFINITY) continue;
        const float w = __expf(red_m[k][gi] - mx);
        lsum += red_l[k][gi] * w;
        o += red_o[k][gi][d] * w;
      }
    }
    const int64_t head = g * G + gi;
    if (plan.splits > 1) {  // the combine kernel's slots: row gi of row block 0
      const int64_t slot = (bg * plan.row_blocks * plan.splits + split) * kRowsPerCta + gi;
      part_o[slot * H + d] = o;
      if (d == 0) {
        part_m[slot] = mx;
        part_l[slot] = lsum;
      }
      continue;
    }
    const float sink = s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[head]) : 0.0f;
    T* out = static_cast<T*>(buf.output) + (b * s.num_heads + head) * H;
    out[d] = FromF<T>(o * OutputScale(mx, lsum, extra, sink));
  }
}

using DecodeFn = void (*)(GqaShape, GqaCudaBuffers, KvStrides, const float*, AttnPlan, float*,
                          float*, float*);

// The register capacity GM (query heads per lane group) serving a KV group of `group` heads.
int64_t DecodeGroupMax(int64_t group) {
  return group == 1 ? 1 : group == 2 ? 2 : group <= 4 ? 4 : kDecMaxGroup;
}

template <typename T, int LPK>
DecodeFn DecodeKernelForGroup(int64_t group) {
  switch (DecodeGroupMax(group)) {
    case 1: return DecodeKernel<T, LPK, 1>;
    case 2: return DecodeKernel<T, LPK, 2>;
    case 4: return DecodeKernel<T, LPK, 4>;
    default: return DecodeKernel<T, LPK, kDecMaxGroup>;
  }
}

template <typename T>
DecodeFn DecodeKernelFor(const GqaShape& s) {
  switch (DecodeLanesPerKey(s.head_size)) {
    case 4: return DecodeKernelForGroup<T, 4>(s.group_size());
    case 8: return DecodeKernelForGroup<T, 8>(s.group_size());
    case 16: return DecodeKernelForGroup<T, 16>(s.group_size());
    default: return DecodeKernelForGroup<T, 32>(s.group_size());
  }
}

size_t DecodeSmemBytesFor(const GqaShape& s) {
  return DecodeSmemBytes(DecodeGroupMax(s.group_size()), DecodeLanesPerKey(s.head_size));
}

// The decode kernel serving `s`, with its shared memory limit raised to what it takes.
template <typename T>
Status ReadyDecodeKernel(const GqaShape& s, DecodeFn* fn, size_t* smem) {
  *fn = DecodeKernelFor<T>(s);
  *smem = DecodeSmemBytesFor(s);
  return CudaCheck(cudaFuncSetAttribute(*fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(*smem)),
                   "decode shared memory attribute");
}

int DecodeCtasPerSm(const GqaShape& s) {
  DecodeFn fn = nullptr;
  size_t smem = 0;
  const Status st = s.dtype == DType::kFloat16 ? ReadyDecodeKernel<__half>(s, &fn, &smem)
                                                : ReadyDecodeKernel<__nv_bfloat16>(s, &fn, &smem);
  int n = 0;
  if (!st.ok() || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kDecThreads, smem) !=
                      cudaSuccess) {
    (void)cudaGetLastError();  // only a sizing hint: take a default, leave no error behind
    n = 2;
  }
  return std::max(n, 1);
}

// ---- 4. combine the key splits in a fixed order: CTA = one query row of one (b, kv head). ----
// The split weights are computed once per row into shared memory; then each thread sums its
// dimensions over the splits with independent loads.
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
    const float w = part_m[slot] == -INFINITY ? 0.0f : __expf(part_m[slot] - mx);
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



// ---- 3b. prefill on tensor cores (fp16/bf16): CTA = 64 query tokens of one query head, 4 warps
//          of 16 rows. Per key tile: S = Q K^T and O += P V with mma.sync m16n8k16; scores, the
//          online softmax and O stay in registers (a thread holds two rows of each); K and V
//          tiles arrive by cp.async one tile ahead. HD is the head size rounded up to a multiple
//          of 32: columns past the head size are zero in Q, K and V and never written out.
constexpr int kTcRows = 64;  // query tokens per CTA: 4 warps x 16 rows

// The tensor-core tile width of a head size: rounded up to a multiple of 32.
constexpr int64_t TcHeadDim(int64_t head_size) { return (head_size + 31) / 32 * 32; }
// Keys per tile: 64, or 32 for heads above 128 (their O accumulators take the registers).
__host__ __device__ constexpr int TcKeys(int64_t hd) { return hd > 128 ? 32 : 64; }
// Row pitch of the shared tiles, in elements: 16 bytes of padding put the 8 rows an ldmatrix
// reads on distinct banks.
__host__ __device__ constexpr int64_t TcPitch(int64_t hd) { return hd + 8; }

size_t TcSmemBytes(int64_t hd, size_t elem) {
  return elem * TcPitch(hd) * (kTcRows + 2 * 2 * TcKeys(hd));  // Q, and K + V in two stages
}

template <typename T, int HD>
__global__ void __launch_bounds__(kWarp* kWarps)
    PrefillTcKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, const float* q_ws) {
  constexpr int BC = TcKeys(HD), P = TcPitch(HD);
  constexpr int NT = BC / 8;   // score n-tiles (8 keys each)
  constexpr int DT = HD / 8;   // output n-tiles (8 dimensions each)
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);  // [kTcRows][P]
  T* kvs = qs + kTcRows * P;           // [stage][K, V][BC][P]

  const int64_t H = s.head_size;  // <= HD
  const int64_t b = blockIdx.z, h = blockIdx.y, g = h / s.group_size();
  const int64_t tok0 = int64_t(blockIdx.x) * kTcRows;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int gq = lane / 4, tq = lane % 4;  // fragment row group, thread in group
  const BatchGeometry geo = Geo(s, buf, b);
  auto range = [&](int64_t r) {
    return tok0 + r < s.seq_len ? QueryKeyRange(s, geo, tok0 + r) : KeyRange{0, 0};
  };

  // Keys any row of the CTA needs.
  int64_t key_lo = INT64_MAX, key_hi = 0;
  for (int r = 0; r < kTcRows; ++r) {
    const KeyRange kr = range(r);
    if (kr.lo < kr.hi) {
      key_lo = min(key_lo, kr.lo);
      key_hi = max(key_hi, kr.hi);
    }
  }
  const int64_t tiles = key_lo < key_hi ? (key_hi - key_lo + BC - 1) / BC : 0;

  const T* pk = static_cast<const T*>(buf.present_key);
  const T* pv = static_cast<const T*>(buf.present_value);
  const int64_t chunks = H / 8;  // 16-byte chunks of a row (H % 8 == 0)
  auto issue = [&](int64_t tile) {
    T* ks = kvs + (tile % 2) * 2 * BC * P;
    T* vs = ks + BC * P;
    const int64_t k0 = key_lo + tile * BC;
    for (int64_t idx = threadIdx.x; idx < BC * chunks; idx += blockDim.x) {
      const int64_t j = idx / chunks, c = idx % chunks;
      const bool valid = k0 + j < key_hi;  // past the end: zero rows
      const int64_t off = valid ? present_st.Offset(b, g, k0 + j) + c * 8 : 0;
      ptx::CpAsync16(ks + j * P + c * 8, pk + off, valid);
      ptx::CpAsync16(vs + j * P + c * 8, pv + off, valid);
    }
  };
  if (tiles > 0) issue(0);
  ptx::CpAsyncCommit();

  // Q (rounded to T once) and the zero padding columns of every tile; the loads above write
  // columns [0, H) only.
  for (int64_t idx = threadIdx.x; idx < kTcRows * HD; idx += blockDim.x) {
    const int64_t r = idx / HD, d = idx % HD, tok = tok0 + r;
    const bool in = tok < s.seq_len && d < H;
    qs[r * P + d] = FromF<T>(in ? q_ws[((b * s.num_heads + h) * s.seq_len + tok) * H + d] : 0.0f);
  }
  for (int64_t idx = threadIdx.x; HD > H && idx < 2 * 2 * BC * (HD - H); idx += blockDim.x) {
    kvs[(idx / (HD - H)) * P + H + idx % (HD - H)] = FromF<T>(0.0f);
  }

  // This thread's two rows: warp * 16 + gq and + 8.
  const int row0 = warp * 16 + gq;
  const KeyRange kr0 = range(row0), kr1 = range(row0 + 8);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const T* bias = static_cast<const T*>(buf.attention_bias);
  const int64_t bias_row0 =
      ((s.bias_batch == 1 ? 0 : b) * s.bias_heads + (s.bias_heads == 1 ? 0 : h)) * s.seq_len +
      tok0 + row0;

  for (int64_t tile = 0; tile < tiles; ++tile) {
    if (tile + 1 < tiles) issue(tile + 1);  // the other stage: consumed before the last barrier
    ptx::CpAsyncCommit();
    ptx::CpAsyncWait<1>();
    __syncthreads();  // every thread's copies of this tile (and Q, on the first) are visible
    const T* ks = kvs + (tile % 2) * 2 * BC * P;
    const T* vs = ks + BC * P;
    const int64_t k0 = key_lo + tile * BC;

    // S = Q K^T: 16 rows x BC keys per warp.
    float sc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      ptx::LdMatrixX4(a, qs + (warp * 16 + lane % 16) * P + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int n = 0; n < NT; n += 2) {  // two key n-tiles per ldmatrix.x4
        uint32_t kb[4];
        const int mi = lane / 8;  // matrices: (keys n, d lo) (keys n, d hi) (n+8, lo) (n+8, hi)
        ptx::LdMatrixX4(kb, ks + (n * 8 + (mi / 2) * 8 + lane % 8) * P + kk * 16 + (mi % 2) * 8);
        ptx::Mma16816<T>(sc[n], a, kb[0], kb[1]);
        ptx::Mma16816<T>(sc[n + 1], a, kb[2], kb[3]);
      }
    }

    // Masks, softcap, bias; the online softmax of rows row0 (e = 0, 1) and row0 + 8 (e = 2, 3).
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e / 2;
        const int64_t key = k0 + n * 8 + 2 * tq + (e % 2);
        const KeyRange& kr = hr ? kr1 : kr0;
        const bool live = key >= kr.lo && key < kr.hi;
        float x = sc[n][e];
        if (s.softcap > 0.0f) x = s.softcap * tanhf(x / s.softcap);
        if (bias != nullptr && live) x += ToF(bias[(bias_row0 + hr * 8) * s.bias_total + key]);
        sc[n][e] = live ? x : -INFINITY;
        tmax[hr] = fmaxf(tmax[hr], sc[n][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 1));
      tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 2));
      const float m_new = fmaxf(m[hr], tmax[hr]);
      alpha[hr] = m_new == -INFINITY ? 1.0f : __expf(m[hr] - m_new);  // 0 when m was -inf
      m[hr] = m_new;
    }
    float psum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int hr = e / 2;
        const float p = sc[n][e] == -INFINITY ? 0.0f : __expf(sc[n][e] - m[hr]);
        sc[n][e] = p;
        psum[hr] += p;
      }
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) l[hr] = l[hr] * alpha[hr] + psum[hr];  // per thread; summed at the end
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V: P from the score registers (the C layout of two n-tiles is the A layout of one
    // k-step), V through ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      uint32_t a[4];
      a[0] = ptx::PackPair<T>(sc[2 * kk][0], sc[2 * kk][1]);
      a[1] = ptx::PackPair<T>(sc[2 * kk][2], sc[2 * kk][3]);
      a[2] = ptx::PackPair<T>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      a[3] = ptx::PackPair<T>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
      for (int n = 0; n < DT; n += 2) {  // two dimension n-tiles per ldmatrix.x4.trans
        uint32_t vb[4];
        const int mi = lane / 8;  // matrices: (keys lo, d n) (keys hi, d n) (lo, n+8) (hi, n+8)
        ptx::LdMatrixX4Trans(vb, vs + (kk * 16 + (mi % 2) * 8 + lane % 8) * P + n * 8 + (mi / 2) * 8);
        ptx::Mma16816<T>(o[n], a, vb[0], vb[1]);
        ptx::Mma16816<T>(o[n + 1], a, vb[2], vb[3]);
      }
    }
    __syncthreads();  // this stage is read: the next iteration's copies may overwrite it
  }
  ptx::CpAsyncWait<0>();

  const bool extra = s.has_head_sink || s.smooth_softmax;
  const float sink = s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[h]) : 0.0f;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    float lt = l[hr];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int64_t tok = tok0 + row0 + hr * 8;
    if (tok >= s.seq_len) continue;
    const float scale = OutputScale(m[hr], lt, extra, sink);
    T* out = static_cast<T*>(buf.output) + ((b * s.seq_len + tok) * s.num_heads + h) * H;
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      const int64_t d = n * 8 + 2 * tq;
      if (d < H) {
        *reinterpret_cast<uint32_t*>(out + d) =
            ptx::PackPair<T>(o[n][2 * hr] * scale, o[n][2 * hr + 1] * scale);
      }
    }
  }
}

// Tensor-core prefill serves fp16/bf16 at least 16 new tokens when the caches are 16-byte
// aligned (cp.async), the output 4-byte aligned (it stores pairs) and its tiles fit the device's
// shared memory; the portable kernel serves everything else (float32, token generation, buffers
// bound at odd offsets).
// 16-byte row loads (cp.async) need 16-byte aligned caches (rows are, since H % 8 == 0); a
// cache bound at an odd offset takes the portable kernel, which has an element-load path.
bool CachesAligned16(const GqaCudaBuffers& buf) {
  return (reinterpret_cast<uintptr_t>(buf.present_key) |
          reinterpret_cast<uintptr_t>(buf.present_value)) % 16 == 0;
}

template <typename T>
bool UseTensorCorePrefill(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev) {
  const bool out_aligned4 = reinterpret_cast<uintptr_t>(buf.output) % 4 == 0;  // pair stores
  return sizeof(T) == 2 && s.seq_len >= 16 && CachesAligned16(buf) && out_aligned4 &&
         TcSmemBytes(TcHeadDim(s.head_size), sizeof(T)) <= size_t(dev.max_smem_optin);
}

template <typename T, int HD>
Status LaunchPrefillTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                       const float* q_ws, cudaStream_t stream) {
  const size_t smem = TcSmemBytes(HD, sizeof(T));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaFuncSetAttribute(PrefillTcKernel<T, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem)),
      "shared memory attribute"));
  const dim3 grid(static_cast<unsigned>((s.seq_len + kTcRows - 1) / kTcRows),
                  static_cast<unsigned>(s.num_heads), static_cast<unsigned>(s.batch));
  PrefillTcKernel<T, HD><<<grid, kWarp * kWarps, smem, stream>>>(s, buf, present_st, q_ws);
  return CudaCheck(cudaGetLastError(), "tensor-core prefill launch");
}

template <typename T>
Status DispatchPrefillTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                         const float* q_ws, cudaStream_t stream) {
  switch (TcHeadDim(s.head_size)) {
    case 32: return LaunchPrefillTc<T, 32>(s, buf, present_st, q_ws, stream);
    case 64: return LaunchPrefillTc<T, 64>(s, buf, present_st, q_ws, stream);
    case 96: return LaunchPrefillTc<T, 96>(s, buf, present_st, q_ws, stream);
    case 128: return LaunchPrefillTc<T, 128>(s, buf, present_st, q_ws, stream);
    case 160: return LaunchPrefillTc<T, 160>(s, buf, present_st, q_ws, stream);
    case 192: return LaunchPrefillTc<T, 192>(s, buf, present_st, q_ws, stream);
    case 224: return LaunchPrefillTc<T, 224>(s, buf, present_st, q_ws, stream);
    case 256: return LaunchPrefillTc<T, 256>(s, buf, present_st, q_ws, stream);
    default:
      return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): no tensor-core tile for "
                           "head_size " + std::to_string(s.head_size));
  }
}

// Head blocks of the prepare kernel: enough CTAs to fill the GPU's first wave when the batch
// of tokens is small; one CTA per token (all heads) when it is large.
int64_t PrepareHeadBlocks(const GqaShape& s) {
  const int64_t heads = s.num_heads + s.kv_num_heads;
  const int64_t blocks = (heads + kPrepareWarps - 1) / kPrepareWarps;
  return s.batch * s.seq_len >= 256 ? 1 : blocks;
}

template <typename T>
Status LaunchCombine(const GqaShape& s, const GqaCudaBuffers& buf, const AttnPlan& plan,
                     const float* part_o, const float* part_m, const float* part_l,
                     cudaStream_t stream) {
  if (plan.splits == 1) return Status::Ok();
  const dim3 grid(static_cast<unsigned>(plan.row_blocks * kRowsPerCta),
                  static_cast<unsigned>(s.batch * s.kv_num_heads));
  CombineKernel<T><<<grid, kCombineThreads, 0, stream>>>(s, buf, plan, part_o, part_m, part_l);
  return CudaCheck(cudaGetLastError(), "combine launch");
}

template <typename T>
Status LaunchDecode(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                    const float* q_ws, const AttnPlan& plan, float* part_o, float* part_m,
                    float* part_l, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(s.batch * s.kv_num_heads));
  DecodeFn fn = nullptr;
  size_t smem = 0;
  KVL_RETURN_IF_ERROR(ReadyDecodeKernel<T>(s, &fn, &smem));
  fn<<<grid, kDecThreads, smem, stream>>>(s, buf, present_st, q_ws, plan, part_o, part_m, part_l);
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetLastError(), "decode launch"));
  return LaunchCombine<T>(s, buf, plan, part_o, part_m, part_l, stream);
}

template <typename T>
Status Launch(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
              void* workspace, cudaStream_t stream) {
  const AttnPlan plan = MakePlan(s, dev);
  char* ws = static_cast<char*>(workspace);
  float* q_ws = reinterpret_cast<float*>(ws);
  float* part_o = reinterpret_cast<float*>(ws + plan.q_bytes);
  float* part_m = reinterpret_cast<float*>(ws + plan.q_bytes + plan.part_o_bytes);
  float* part_l = reinterpret_cast<float*>(ws + plan.q_bytes + plan.part_o_bytes + plan.part_ml_bytes);
  const KvStrides past_st = MakeKvStrides(s.layout, s.kv_num_heads, s.past_capacity, s.head_size);
  const KvStrides present_st =
      MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, s.head_size);

  if (!buf.shared()) {
    const int64_t n = s.batch * s.kv_num_heads * s.present_capacity * s.head_size;
    const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 8 * dev.sm_count));
    CopyPastKernel<T><<<std::max(blocks, 1), 256, 0, stream>>>(s, buf, past_st, present_st);
    KVL_RETURN_IF_ERROR(CudaCheck(cudaGetLastError(), "copy past launch"));
  }
  const dim3 prep_grid(static_cast<unsigned>(s.batch * s.seq_len),
                       static_cast<unsigned>(PrepareHeadBlocks(s)));
  PrepareKernel<T><<<prep_grid, dim3(kWarp, kPrepareWarps), 0,
                     stream>>>(s, buf, present_st, q_ws);
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetLastError(), "prepare launch"));

  if constexpr (sizeof(T) == 2) {
    if (UseTensorCorePrefill<T>(s, buf, dev)) {
      return DispatchPrefillTc<T>(s, buf, present_st, q_ws, stream);
    }
    if (UseDecodeKernel(s) && CachesAligned16(buf)) {
      return LaunchDecode<T>(s, buf, present_st, q_ws, plan, part_o, part_m, part_l, stream);
    }
  }
  const size_t smem = SmemBytes(s, sizeof(T));
  if (smem > 48 * 1024) {  // large heads in float32: lift the 48 KB default (a host call)
    KVL_RETURN_IF_ERROR(CudaCheck(
        cudaFuncSetAttribute(AttentionKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)),
        "shared memory attribute"));
  }
  const dim3 grid(static_cast<unsigned>(plan.row_blocks),
                  static_cast<unsigned>(s.batch * s.kv_num_heads),
                  static_cast<unsigned>(plan.splits));
  AttentionKernel<T><<<grid, kWarp * kWarps, smem, stream>>>(s, buf, present_st, q_ws, plan,
                                                             part_o, part_m, part_l);
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetLastError(), "attention launch"));
  return LaunchCombine<T>(s, buf, plan, part_o, part_m, part_l, stream);
}

}  // namespace

Status QueryCudaDevice(CudaDeviceInfo* info) {
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&info->device), "cudaGetDevice"));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, info->device),
      "cudaDeviceGetAttribute(multiprocessor count)"));
  return CudaCheck(cudaDeviceGetAttribute(&info->max_smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, info->device),
                   "cudaDeviceGetAttribute(shared memory per block)");
}

Status CheckCudaSupport(const GqaShape& s) {
  const char* op = "ai.kvlayout::GroupQueryAttention (CUDA): ";
  if (s.sliding_window_cache) {
    return Status::Error(std::string(op) +
                         "attribute 'sliding_window_cache'=1 is not supported on the CUDA "
                         "execution provider in v1 (it is on CPU)");
  }
  // The kernels put batch x kv head (and batch, num_heads) on a grid axis limited to 65535.
  constexpr int64_t kMaxGridYZ = 65535;
  if (s.batch * s.kv_num_heads > kMaxGridYZ || s.num_heads > kMaxGridYZ) {
    return Status::Error(std::string(op) + "batch x kv_num_heads = " +
                         std::to_string(s.batch * s.kv_num_heads) + " (num_heads " +
                         std::to_string(s.num_heads) + ") exceeds " +
                         std::to_string(kMaxGridYZ) + " on CUDA in v1: split the batch");
  }
  if (s.head_size % 8 != 0 || s.head_size > kMaxHeadSize) {
    return Status::Error(std::string(op) + "head_size " + std::to_string(s.head_size) +
                         " is not supported on CUDA: it must be a multiple of 8 and <= " +
                         std::to_string(kMaxHeadSize));
  }
  return Status::Ok();
}

size_t GqaCudaWorkspaceBytes(const GqaShape& s, const CudaDeviceInfo& dev) {
  const AttnPlan p = MakePlan(s, dev);
  return p.q_bytes + p.part_o_bytes + 2 * p.part_ml_bytes;
}

Status LaunchGqaCuda(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
                     void* workspace, void* stream) {
  KVL_RETURN_IF_ERROR(CheckCudaSupport(s));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (s.dtype) {
    case DType::kFloat32: return Launch<float>(s, buf, dev, workspace, st);
    case DType::kFloat16: return Launch<__half>(s, buf, dev, workspace, st);
    case DType::kBFloat16: return Launch<__nv_bfloat16>(s, buf, dev, workspace, st);
    default:
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): unsupported type ") +
                           DTypeName(s.dtype));
  }
}

}  // namespace kvl
