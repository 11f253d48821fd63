// Prefill and chunked prefill on tensor cores for sm_80 and newer (fp16/bf16): mma.sync m16n8k16,
// FlashAttention-2 style. CTA = 64 rows of one KV group: 64 / G query tokens x the G query heads
// of the group (token-major), so each K/V tile is read once for the whole group; 4 warps of 16
// rows. Per key tile: S = Q K^T and O += P V; scores, the online softmax and O stay in registers
// (a thread holds two rows of each); K and V tiles arrive by cp.async one tile ahead. Tiles that
// every row of a warp sees whole skip the per-element masks. HD is the head size rounded
// up to a multiple of 32: columns past the head size are zero in Q, K and V and never written out.
// A quantized cache (C: int8_t, PackedInt4; head sizes 64 and 128) is dequantized as each tile is
// loaded (float32(code) x scale, rounded to T, into the same tiles): plain loads, not cp.async.
#include "cuda/common.cuh"
#include "cuda/kernels.h"
#include "cuda/online_softmax.cuh"
#include "cuda/prefill_geometry.h"
#include "cuda/ptx.cuh"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {
namespace {

constexpr int kWarps = kTcWarps;

// Values 8 c .. 8 c + 7 of a row of codes, dequantized with the scales of kv head h and rounded
// to T, as one 16-byte piece of a tile (`row`: 8-byte aligned for int8, 4 for int4).
template <typename T, typename C>
__device__ __forceinline__ uint4 DequantPiece(const C* row, int c, const float* scale,
                                              KvQuant quant, int64_t H, int64_t h) {
  int codes[8];
  if constexpr (kCacheBits<C> == 8) {
    const uint2 w = *reinterpret_cast<const uint2*>(reinterpret_cast<const int8_t*>(row) + c * 8);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      codes[e] = static_cast<int8_t>(w.x >> (8 * e));
      codes[4 + e] = static_cast<int8_t>(w.y >> (8 * e));
    }
  } else {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(row + c * 4);
#pragma unroll
    for (int e = 0; e < 8; ++e) codes[e] = static_cast<int>((w >> (4 * e)) & 15u) - 8;
  }
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int e = 0; e < 8; e += 2) {
    o[e / 2] = ptx::PackPair<T>(float(codes[e]) * ChannelScale(scale, quant, H, h, 8 * c + e),
                                float(codes[e + 1]) * ChannelScale(scale, quant, H, h, 8 * c + e + 1));
  }
  return out;
}

// The keys any row of a CTA of query tokens [tok0, tok0 + tpc) needs (lo = INT64_MAX: none).
__device__ __forceinline__ KeyRange CtaKeys(const GqaShape& s, const BatchGeometry& geo,
                                            int64_t tok0, int64_t tpc) {
  int64_t key_lo = INT64_MAX, key_hi = 0;
  for (int64_t tok = tok0; tok < min(tok0 + tpc, s.seq_len); ++tok) {
    const KeyRange kr = QueryKeyRange(s, geo, tok);
    if (kr.lo < kr.hi) {
      key_lo = min(key_lo, kr.lo);
      key_hi = max(key_hi, kr.hi);
    }
  }
  return {key_lo, key_hi};
}

// The K and V tiles of a CTA's keys [key_lo, key_hi): tile t into stage t % 2 of `kvs`
// ([stage][K, V][BC][P]), by cp.async, or dequantized as it is loaded (C: codes). Columns
// [0, H) only; zero rows past key_hi.
template <typename T, int HD, typename C>
struct TcTileCopy {
  static constexpr int BC = TcKeys(HD), P = TcPitch(HD);
  static constexpr int CPR = HD / 8;  // chunk slots per row; those >= chunks are padding
  static constexpr int kThreads = kWarp * kWarps;
  const GqaShape& s;
  const GqaCudaBuffers& buf;
  const KvStrides& present_st;
  int64_t H, b, g, key_lo, key_hi, cache_base;
  T* kvs;
  // Rows of this (batch, kv head): key j at base + (j - cache_base) * seq stride, in either
  // layout (cache_base: 0 unless a sliding window cache stages the rows, sliding.cu).
  const T* pk = static_cast<const T*>(buf.present_key) + present_st.Offset(b, g, 0);
  const T* pv = static_cast<const T*>(buf.present_value) + present_st.Offset(b, g, 0);
  int64_t seq_stride = present_st.seq;
  int chunks = static_cast<int>(H / 8);  // 16-byte chunks of a row (H % 8 == 0)

  __device__ __forceinline__ void Issue(int64_t tile) const {
    T* ks = kvs + (tile % 2) * 2 * BC * P;
    T* vs = ks + BC * P;
    const int64_t k0 = key_lo + tile * BC;
    if constexpr (kQuantCache<C>) {  // codes -> T tiles (H == HD: no padding columns)
      const C* ck = static_cast<const C*>(buf.present_key) + present_st.Offset(b, g, 0);
      const C* cv = static_cast<const C*>(buf.present_value) + present_st.Offset(b, g, 0);
#pragma unroll
      for (int it = 0; it < (BC * CPR + kThreads - 1) / kThreads; ++it) {
        const int idx = threadIdx.x + it * kThreads, j = idx / CPR, c = idx % CPR;
        if (idx >= BC * CPR || c >= chunks) continue;
        uint4 kq = make_uint4(0, 0, 0, 0), vq = kq;
        if (k0 + j < key_hi) {  // past the end: zero rows
          const int64_t off = (k0 + j - cache_base) * seq_stride;
          kq = DequantPiece<T>(ck + off, c, buf.k_scale, s.k_quant, H, g);
          vq = DequantPiece<T>(cv + off, c, buf.v_scale, s.v_quant, H, g);
        }
        *reinterpret_cast<uint4*>(ks + j * P + c * 8) = kq;
        *reinterpret_cast<uint4*>(vs + j * P + c * 8) = vq;
      }
    } else {
#pragma unroll
      for (int it = 0; it < (BC * CPR + kThreads - 1) / kThreads; ++it) {
        const int idx = threadIdx.x + it * kThreads, j = idx / CPR, c = idx % CPR;
        if (idx >= BC * CPR || c >= chunks) continue;
        const bool valid = k0 + j < key_hi;  // past the end: zero rows
        const int64_t off = valid ? (k0 + j - cache_base) * seq_stride + c * 8 : 0;
        ptx::CpAsync16(ks + j * P + c * 8, pk + off, valid);
        ptx::CpAsync16(vs + j * P + c * 8, pv + off, valid);
      }
    }
  }
};

// S = Q K^T of a key tile: warp `warp`'s 16 rows of the query tile qs x the BC keys of ks.
template <typename T, int HD>
__device__ __forceinline__ void TcTileScores(float (&sc)[TcKeys(HD) / 8][4], const T* qs,
                                             const T* ks, int warp, int lane) {
  constexpr int NT = TcKeys(HD) / 8, P = TcPitch(HD);
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
}

// The output of this thread's rows row0 and row0 + 8 (m, l, o as the key loop left them),
// scaled by their sums; rows past the last token are not written.
template <typename T, int DT, typename RowTok, typename RowHead>
__device__ __forceinline__ void TcStoreRows(const GqaShape& s, const GqaCudaBuffers& buf,
                                            int64_t b, int64_t N, int row0, int tq,
                                            const float (&m)[2], const float (&l)[2],
                                            const float (&o)[DT][4], RowTok row_tok,
                                            RowHead row_head) {
  const int64_t H = s.head_size;
  const bool extra = s.has_head_sink || s.smooth_softmax;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float lt = QuadSum(l[hr]);
    const int64_t r = row0 + hr * 8, tok = row_tok(r), h = row_head(r);
    if (tok >= s.seq_len) continue;
    const float sink = s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[h]) : 0.0f;
    const float scale = OutputScale(m[hr], lt, extra, sink);
    T* out = static_cast<T*>(buf.output) + ((b * s.seq_len + tok) * N + h) * H;
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

// C: the cache's element type (T, or int8_t / PackedInt4 codes).
template <typename T, int HD, typename C = T>
__global__ void __launch_bounds__(kWarp* kWarps)
    PrefillTcKernel(GqaShape s, GqaCudaBuffers buf, KvStrides present_st, const float* q_ws) {
  constexpr int BC = TcKeys(HD), P = TcPitch(HD);
  constexpr int NT = BC / 8;   // score n-tiles (8 keys each)
  constexpr int DT = HD / 8;   // output n-tiles (8 dimensions each)
  extern __shared__ __align__(128) unsigned char tc_smem[];
  T* qs = reinterpret_cast<T*>(tc_smem);  // [kTcRows][P]
  T* kvs = qs + kTcRows * P;           // [stage][K, V][BC][P]

  const int64_t H = s.head_size;  // <= HD
  const int64_t G = s.group_size(), N = s.num_heads;
  const int64_t b = blockIdx.z, g = blockIdx.y;
  const int64_t tpc = TcTokens(G), tok0 = int64_t(blockIdx.x) * tpc;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int gq = lane / 4, tq = lane % 4;  // fragment row group, thread in group
  const BatchGeometry geo = Geo(s, buf, b);
  // Row r: token tok0 + r / G, query head g * G + r % G; rows past tpc * G or the last token
  // are idle (no keys, never written).
  auto row_tok = [&](int64_t r) { return r < tpc * G ? tok0 + r / G : s.seq_len; };
  auto row_head = [&](int64_t r) { return g * G + r % G; };
  auto range = [&](int64_t r) {
    const int64_t tok = row_tok(r);
    return tok < s.seq_len ? QueryKeyRange(s, geo, tok) : KeyRange{0, 0};
  };

  const KeyRange keys = CtaKeys(s, geo, tok0, tpc);
  const int64_t key_lo = keys.lo, key_hi = keys.hi;
  const int64_t tiles = key_lo < key_hi ? (key_hi - key_lo + BC - 1) / BC : 0;
  const TcTileCopy<T, HD, C> copy{s, buf, present_st, H, b, g, key_lo, key_hi, geo.cache_base,
                                  kvs};
  if (tiles > 0) copy.Issue(0);
  ptx::CpAsyncCommit();

  // Q (rounded to T once) and the zero padding columns of every tile; the loads above write
  // columns [0, H) only.
  for (int idx = threadIdx.x; idx < kTcRows * HD; idx += blockDim.x) {
    const int r = idx / HD, d = idx % HD;
    const int64_t tok = row_tok(r);
    // Tokens past query_seqlens (not a first prompt) have no prepared query: zeros.
    const bool in = tok < s.seq_len && (s.is_first_prompt() || tok < geo.new_rows) && d < H;
    qs[r * P + d] = FromF<T>(in ? q_ws[((b * N + row_head(r)) * s.seq_len + tok) * H + d] : 0.0f);
  }
  for (int64_t idx = threadIdx.x; HD > H && idx < 2 * 2 * BC * (HD - H); idx += blockDim.x) {
    kvs[(idx / (HD - H)) * P + H + idx % (HD - H)] = FromF<T>(0.0f);
  }

  // This thread's two rows: warp * 16 + gq and + 8.
  const int row0 = warp * 16 + gq;
  const KeyRange kr[2] = {range(row0), range(row0 + 8)};
  // Rows past the CTA's tokens (G not dividing 64, or past the last token) are never written:
  // they need no masks.
  const bool idle0 = row_tok(row0) >= s.seq_len, idle1 = row_tok(row0 + 8) >= s.seq_len;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[DT][4];
#pragma unroll
  for (int n = 0; n < DT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  const T* bias = static_cast<const T*>(buf.attention_bias);
  int64_t bias_row[2] = {0, 0};  // element offset of each of this thread's rows in the bias
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const int64_t r = row0 + hr * 8, tok = row_tok(r);
    if (bias != nullptr && tok < s.seq_len) {
      const int64_t bb = s.bias_batch == 1 ? 0 : b, bh = s.bias_heads == 1 ? 0 : row_head(r);
      bias_row[hr] = ((bb * s.bias_heads + bh) * s.seq_len + tok) * s.bias_total;
    }
  }
  // Without softcap and bias, a tile inside every row's key range needs no per-element work.
  const bool plain = !(s.softcap > 0.0f) && bias == nullptr;
  const float inv_softcap = s.softcap > 0.0f ? SoftcapInverse(s.softcap) : 0.0f;

  for (int64_t tile = 0; tile < tiles; ++tile) {
    if (tile + 1 < tiles) copy.Issue(tile + 1);  // the other stage, read before the last barrier
    ptx::CpAsyncCommit();
    ptx::CpAsyncWait<1>();
    __syncthreads();  // every thread's copies of this tile (and Q, on the first) are visible
    const T* ks = kvs + (tile % 2) * 2 * BC * P;
    const T* vs = ks + BC * P;
    const int64_t k0 = key_lo + tile * BC;
    float sc[NT][4];
    TcTileScores<T, HD>(sc, qs, ks, warp, lane);

    // Masks, softcap, bias; the online softmax of rows row0 (e = 0, 1) and row0 + 8 (e = 2, 3).
    const bool whole =
        plain && __all_sync(0xffffffffu, (idle0 || (kr[0].lo <= k0 && k0 + BC <= kr[0].hi)) &&
                                             (idle1 || (kr[1].lo <= k0 && k0 + BC <= kr[1].hi)));
    float tmax[2];
    MaskStepScores<T, NT>(sc, tmax, whole, true, k0, tq, kr, s, inv_softcap, bias, bias_row);
    OnlineSoftmaxStep<NT, DT>(sc, tmax, whole, true, m, l, o);

    // O += P V, V through ldmatrix.trans.
    AccumulatePV<T, BC, DT>(o, sc, [&](int kk, int n, uint32_t (&vb)[4]) {
      const int mi = lane / 8;  // matrices: (keys lo, d n) (keys hi, d n) (lo, n+8) (hi, n+8)
      ptx::LdMatrixX4Trans(vb, vs + (kk * 16 + (mi % 2) * 8 + lane % 8) * P + n * 8 + (mi / 2) * 8);
    });
    __syncthreads();  // this stage is read: the next iteration's copies may overwrite it
  }
  ptx::CpAsyncWait<0>();

  TcStoreRows<T, DT>(s, buf, b, N, row0, tq, m, l, o, row_tok, row_head);
}

template <typename T, int HD, typename C = T>
Status LaunchHd(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                const float* q_ws, cudaStream_t stream) {
  const auto kernel = PrefillTcKernel<T, HD, C>;
  const size_t smem = TcSmemBytes(HD, sizeof(T));
  KVL_RETURN_IF_ERROR(EnsureSmemLimit(reinterpret_cast<const void*>(kernel), smem));
  const int64_t tpc = TcTokens(s.group_size());
  const dim3 grid(static_cast<unsigned>((s.seq_len + tpc - 1) / tpc),
                  static_cast<unsigned>(s.kv_num_heads), static_cast<unsigned>(s.batch));
  kernel<<<grid, kWarp * kWarps, smem, stream>>>(s, buf, present_st, q_ws);
  return CudaCheck(cudaGetLastError(), "tensor-core prefill launch");
}

// A quantized cache: the instances of head sizes 64 and 128 (PrefillQuantServes).
template <typename T, typename C>
Status LaunchQuant(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                   const float* q_ws, cudaStream_t stream) {
  if (s.head_size == 64) return LaunchHd<T, 64, C>(s, buf, present_st, q_ws, stream);
  if (s.head_size == 128) return LaunchHd<T, 128, C>(s, buf, present_st, q_ws, stream);
  return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): no quantized tensor-core "
                       "prefill for head_size " + std::to_string(s.head_size));
}

}  // namespace

template <typename T>
Status LaunchPrefillTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                       const Workspace& ws, cudaStream_t stream) {
  if (s.per_token() || s.fp8_cache()) {  // the plan gives these the portable kernel
    return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): no tensor-core prefill for "
                         "PER_TOKEN scales or an fp8 cache");
  }
  if (s.kv_bits == 8) return LaunchQuant<T, int8_t>(s, buf, present_st, ws.q, stream);
  if (s.kv_bits == 4) return LaunchQuant<T, PackedInt4>(s, buf, present_st, ws.q, stream);
  switch (TcHeadDim(s.head_size)) {
    case 32: return LaunchHd<T, 32>(s, buf, present_st, ws.q, stream);
    case 64: return LaunchHd<T, 64>(s, buf, present_st, ws.q, stream);
    case 96: return LaunchHd<T, 96>(s, buf, present_st, ws.q, stream);
    case 128: return LaunchHd<T, 128>(s, buf, present_st, ws.q, stream);
    case 160: return LaunchHd<T, 160>(s, buf, present_st, ws.q, stream);
    case 192: return LaunchHd<T, 192>(s, buf, present_st, ws.q, stream);
    case 224: return LaunchHd<T, 224>(s, buf, present_st, ws.q, stream);
    case 256: return LaunchHd<T, 256>(s, buf, present_st, ws.q, stream);
    default:
      return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): no tensor-core tile for "
                           "head_size " + std::to_string(s.head_size));
  }
}

#define KVL_PREFILL_TC_LAUNCH(T)                                                    \
  template Status LaunchPrefillTc<T>(const GqaShape&, const GqaCudaBuffers&, KvStrides, \
                                     const Workspace&, cudaStream_t);
KVL_PREFILL_TC_LAUNCH(__half)
KVL_PREFILL_TC_LAUNCH(__nv_bfloat16)
#undef KVL_PREFILL_TC_LAUNCH

}  // namespace cu
}  // namespace kvl
