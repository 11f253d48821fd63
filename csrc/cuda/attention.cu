// The portable attention kernel (CUDA cores, every dtype and shape the op accepts): CTA = (16
// query rows of one KV group, batch x kv head, key split); online softmax over 32-key tiles in
// shared memory, one key per lane. The combine kernel merges its splits. A quantized cache's
// tiles are dequantized as they are loaded (float32(code) x scale, rounded to T): no copy of
// the cache in T.
#include <algorithm>

#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {
namespace {

constexpr int kRowsPerWarp = 4;
constexpr int kWarps = 4;
static_assert(kRowsPerWarp * kWarps == kRowsPerCta, "rows per CTA");
// Row k of a CTA belongs to warp k % kWarps (slot k / kWarps): a decode step's few rows (one
// per query head of the group) land on different warps instead of all on warp 0.
__device__ __forceinline__ int CtaRow(int warp, int slot) { return slot * kWarps + warp; }
constexpr int kTileKeys = 32;  // one key per lane

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

// A CTA's rows (flattened (token, head of the group), token-major; row k of warp k % kWarps):
// this warp's rows' key ranges, tokens and heads, every row's query staged in qs (zeros for rows
// without keys), and the keys any row needs in [key_lo, key_hi) (key_lo = INT64_MAX: none).
__device__ __forceinline__ void PortableRows(const GqaShape& s, const BatchGeometry& geo,
                                             const float* q_ws, int64_t H, int64_t G, int64_t b,
                                             int64_t g, int64_t rb, int warp, float* qs,
                                             int64_t (&row_lo)[kRowsPerWarp],
                                             int64_t (&row_hi)[kRowsPerWarp],
                                             int64_t (&row_tok)[kRowsPerWarp],
                                             int64_t (&row_head)[kRowsPerWarp], int64_t& key_lo,
                                             int64_t& key_hi) {
  key_lo = INT64_MAX;
  key_hi = 0;
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
}

// The tile of keys [k0, k0 + kTileKeys) of (b, g) into shared memory: K rows at `pitch` words
// in ks, V rows in vs, zero rows past key_hi. A quantized cache's codes are dequantized as they
// load; 16-byte loads where the caches are 16-byte aligned (a row is H * sizeof(T) bytes, a
// multiple of 16 since H % 8 == 0); a cache bound at an odd offset takes element loads.
template <typename T, typename C>
__device__ __forceinline__ void PortableLoadTile(const GqaShape& s, const GqaCudaBuffers& buf,
                                                 const KvStrides& present_st,
                                                 const BatchGeometry& geo, int64_t H,
                                                 int64_t words, int64_t b, int64_t g, int64_t k0,
                                                 int64_t key_hi, uint32_t* ks, T* vs,
                                                 int64_t pitch, bool aligned16) {
  const T* pk = static_cast<const T*>(buf.present_key);
  const T* pv = static_cast<const T*>(buf.present_value);
  if constexpr (kQuantCache<C>) {
    const C* ck = static_cast<const C*>(buf.present_key);
    const C* cv = static_cast<const C*>(buf.present_value);
    for (int64_t idx = threadIdx.x; idx < kTileKeys * H; idx += blockDim.x) {
      const int64_t j = idx / H, d = idx % H;
      T kv = FromF<T>(0.0f), vv = FromF<T>(0.0f);
      if (k0 + j < key_hi) {
        const int64_t off = present_st.Offset(b, g, k0 + j - geo.cache_base);
        kv = FromF<T>(ValueAt(ck + off, d) *
                      ReadScale(s, buf.k_scale, buf.present_key_scale, s.k_quant, g, d, off));
        vv = FromF<T>(ValueAt(cv + off, d) *
                      ReadScale(s, buf.v_scale, buf.present_value_scale, s.v_quant, g, d, off));
      }
      reinterpret_cast<T*>(ks + j * pitch)[d] = kv;
      vs[j * H + d] = vv;
    }
  }
  const int64_t quads = words / 4;
  for (int64_t idx = threadIdx.x; !kQuantCache<C> && aligned16 && idx < kTileKeys * quads; idx += blockDim.x) {
    const int64_t j = idx / quads, w = (idx % quads) * 4;
    uint4 kq = make_uint4(0, 0, 0, 0), vq = make_uint4(0, 0, 0, 0);
    if (k0 + j < key_hi) {
      const int64_t off = present_st.Offset(b, g, k0 + j - geo.cache_base);
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
  for (int64_t idx = threadIdx.x; !kQuantCache<C> && !aligned16 && idx < kTileKeys * H;
       idx += blockDim.x) {
    const int64_t j = idx / H, d = idx % H;
    T kv = FromF<T>(0.0f), vv = FromF<T>(0.0f);
    if (k0 + j < key_hi) {
      const int64_t off = present_st.Offset(b, g, k0 + j - geo.cache_base) + d;
      kv = pk[off];
      vv = pv[off];
    }
    reinterpret_cast<T*>(ks + j * pitch)[d] = kv;
    vs[j * H + d] = vv;
  }
}

// This warp's rows over the tile at k0 (one key per lane): scores, softcap, bias, masks and the
// online softmax of each row whose key range meets the tile, P through ps into O.
template <typename T>
__device__ __forceinline__ void PortableTileRows(
    const GqaShape& s, const GqaCudaBuffers& buf, int64_t H, int64_t words, int64_t b,
    int64_t k0, int64_t key_hi, int warp, int lane, const float* qs, const uint32_t* ks,
    const T* vs, float* ps, int64_t pitch, const int64_t (&row_lo)[kRowsPerWarp],
    const int64_t (&row_hi)[kRowsPerWarp],
    const int64_t (&row_tok)[kRowsPerWarp], const int64_t (&row_head)[kRowsPerWarp],
    float (&m)[kRowsPerWarp], float (&l)[kRowsPerWarp],
    float (&o)[kRowsPerWarp][kMaxHeadSize / kWarp]) {
  constexpr int kDims = kMaxHeadSize / kWarp;
  const T* bias = static_cast<const T*>(buf.attention_bias);
  for (int k = 0; k < kRowsPerWarp; ++k) {
    if (row_lo[k] >= k0 + kTileKeys || row_hi[k] <= k0 || row_lo[k] >= row_hi[k]) continue;
    const int64_t key = k0 + lane;
    float sc = DotRow<T>(qs + CtaRow(warp, k) * H, ks + lane * pitch, words);
    if (s.softcap > 0.0f) sc = Softcap(sc, s.softcap, SoftcapInverse(s.softcap));
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

// This warp's rows at the end: with splits, the split's partial (o, m, l) into its slot for the
// combine kernel; else the output, scaled by the row's sum.
template <typename T>
__device__ __forceinline__ void PortableStoreRows(
    const GqaShape& s, const GqaCudaBuffers& buf, const AttnPlan& plan, int64_t H, int64_t G,
    int64_t b, int64_t rb, int64_t split, int warp, int lane,
    const int64_t (&row_tok)[kRowsPerWarp],
    const int64_t (&row_head)[kRowsPerWarp], const float (&m)[kRowsPerWarp],
    const float (&l)[kRowsPerWarp], const float (&o)[kRowsPerWarp][kMaxHeadSize / kWarp],
    float* part_o, float* part_m, float* part_l) {
  constexpr int kDims = kMaxHeadSize / kWarp;
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

// C: the cache's element type (T, or int8_t / PackedInt4 codes / Fp8E4M3 bytes).
template <typename T, typename C = T>
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

  int64_t row_lo[kRowsPerWarp], row_hi[kRowsPerWarp], row_tok[kRowsPerWarp], row_head[kRowsPerWarp];
  int64_t key_lo, key_hi;
  PortableRows(s, geo, q_ws, H, G, b, g, rb, warp, qs, row_lo, row_hi, row_tok, row_head, key_lo,
               key_hi);
  // This split's share of the CTA's keys: partitioned here, from the lengths on the device, so
  // a grid sized by the capacity spreads whatever length is live over all of its splits.
  if (key_lo < key_hi) {
    const int64_t chunk = SplitChunk<int64_t>(key_hi - key_lo, plan.split_target, kTileKeys, kMinSplitKeys);
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
  const bool aligned16 = (reinterpret_cast<uintptr_t>(buf.present_key) |
                          reinterpret_cast<uintptr_t>(buf.present_value)) % 16 == 0;
  for (int64_t k0 = key_lo; k0 < key_hi; k0 += kTileKeys) {
    __syncthreads();  // previous tile fully consumed (and qs staged, on the first tile)
    PortableLoadTile<T, C>(s, buf, present_st, geo, H, words, b, g, k0, key_hi, ks, vs, pitch,
                           aligned16);
    __syncthreads();
    PortableTileRows<T>(s, buf, H, words, b, k0, key_hi, warp, lane, qs, ks, vs, ps, pitch, row_lo,
                        row_hi, row_tok, row_head, m, l, o);
  }
  PortableStoreRows<T>(s, buf, plan, H, G, b, rb, split, warp, lane, row_tok, row_head, m, l, o,
                       part_o, part_m, part_l);
}

}  // namespace

template <typename T>
Status LaunchPortable(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                      const AttnPlan& plan, const Workspace& ws, cudaStream_t stream) {
  const size_t smem = SmemBytes(s, sizeof(T));
  const dim3 grid(static_cast<unsigned>(plan.row_blocks),
                  static_cast<unsigned>(s.batch * s.kv_num_heads),
                  static_cast<unsigned>(plan.splits));
  KVL_RETURN_IF_ERROR(DispatchCache<T>(s, [&](auto tag) {
    const auto kernel = AttentionKernel<T, typename decltype(tag)::type>;
    if (smem > 48 * 1024) {  // large heads in float32: lift the 48 KB default (once per device)
      KVL_RETURN_IF_ERROR(EnsureSmemLimit(reinterpret_cast<const void*>(kernel), smem));
    }
    kernel<<<grid, kWarp * kWarps, smem, stream>>>(s, buf, present_st, ws.q, plan, ws.part_o,
                                                   ws.part_m, ws.part_l);
    return CudaCheck(cudaGetLastError(), "attention launch");
  }));
  return LaunchCombine<T>(s, buf, plan, ws, stream);
}

template Status LaunchPortable<float>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                      const AttnPlan&, const Workspace&, cudaStream_t);
template Status LaunchPortable<__half>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                       const AttnPlan&, const Workspace&, cudaStream_t);
template Status LaunchPortable<__nv_bfloat16>(const GqaShape&, const GqaCudaBuffers&, KvStrides,
                                              const AttnPlan&, const Workspace&, cudaStream_t);

}  // namespace cu
}  // namespace kvl
