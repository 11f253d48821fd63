// The per-token work before attention, as device functions: the length checks (recorded for the
// host), the queries' and new keys' norm and rotary, and the append of new K/V rows to the cache.
// Two kernels call them: the prepare kernel (prepare.cu), which serves prefill and the portable
// kernel, and the tensor-core decode kernel (decode_prologue.cuh), which does this work itself so
// that a decode step is one launch. One definition of the arithmetic for both.
#pragma once

#include "core/length_rules.h"
#include "cuda/common.cuh"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {

// Writes `v` into the host-mapped record unless an earlier violation is still unread there. The
// writer is elected in device memory (`claim` holds the generation last claimed): the first
// thread to move it from the host's `taken` generation to the next one writes the record, then
// publishes it by setting `written`. Rare path: runs only for a violation.
__device__ inline void RecordViolation(LengthRecord* rec, uint32_t* claim,
                                       const LengthViolation& v) {
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
// token; a position is checked only when the entry's lengths pass (as on the CPU). Callers check
// buf.length_record first (null: no record kept).
__device__ inline void CheckLengths(const GqaShape& s, const GqaCudaBuffers& buf, int64_t b,
                                    int64_t i) {
  const EntryLengths n = ReadLengths(s, buf, b);
  LengthViolation v = CheckBatchLengths(s, b, n.seqlens_k, n.query_len);
  if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
    if (i == 0) RecordViolation(buf.length_record, buf.length_claim, v);
    return;
  }
  if (s.rotary_dim == 0) return;
  const BatchGeometry g = GetBatchGeometry(s, n.seqlens_k, n.query_len);
  if (i >= RotaryRowsUsed(s, g)) return;
  v = CheckRotaryPosition(s, b, i, RotaryPosition(s, g, buf.position_ids, b, i));
  if (v.rule != static_cast<int32_t>(LengthRule::kNone)) {
    RecordViolation(buf.length_record, buf.length_claim, v);
  }
}

// Rotary position of new token i, clamped into the cos/sin caches: an out-of-range position is
// what CheckLengths records; the kernels never read outside the caches. 0 without rotary.
__device__ __forceinline__ int64_t ClampedRotaryPosition(const GqaShape& s,
                                                         const GqaCudaBuffers& buf,
                                                         const BatchGeometry& g, int64_t b,
                                                         int64_t i) {
  if (s.rotary_dim == 0) return 0;
  const int64_t pos = RotaryPosition(s, g, buf.position_ids, b, i);
  return pos < 0 ? 0 : (pos >= s.rotary_max_positions ? s.rotary_max_positions - 1 : pos);
}

// Where token i of batch entry b keeps its rows in the inputs (packed QKV or separate tensors).
template <typename T>
struct TokenInputs {
  const T* q;  // query head 0 of the token; head h at q + h * H
  const T* k;  // key head 0
  const T* v;  // value head 0
  __device__ TokenInputs(const GqaShape& s, const GqaCudaBuffers& buf, int64_t b, int64_t i) {
    const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
    const int64_t q_pitch = s.packed_qkv ? (N + 2 * Nkv) * H : N * H;
    const int64_t q_row = (b * s.seq_len + i) * q_pitch;
    q = static_cast<const T*>(buf.query) + q_row;
    if (s.packed_qkv) {
      k = q + N * H;
      v = k + Nkv * H;
    } else {
      const int64_t kv_row = (b * s.seq_len + i) * Nkv * H;
      k = static_cast<const T*>(buf.key) + kv_row;
      v = static_cast<const T*>(buf.value) + kv_row;
    }
  }
};

// One warp: the row in x[0, H) (the warp's own float scratch, written and synchronized by the
// warp), RMS-normed by the query's or key's norm weight when the op has one, then rotated at
// position `pos` when it has rotary. The warp has synchronized on x when this returns.
template <typename T>
__device__ void NormRotate(const GqaShape& s, const GqaCudaBuffers& buf, bool is_q, int64_t pos,
                           float* x, int lane) {
  const int64_t H = s.head_size;
  // The shape's flag, not the pointer: a constant in the decode kernel's plain instance.
  const void* w = is_q ? buf.q_norm_weight : buf.k_norm_weight;
  if (is_q ? s.has_q_norm : s.has_k_norm) {
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
}

// The same for the row `src` (H elements of the inputs), loaded into x first.
template <typename T>
__device__ void NormRotateRow(const GqaShape& s, const GqaCudaBuffers& buf, const T* src, bool is_q,
                              int64_t pos, float* x, int lane) {
  for (int64_t d = lane; d < s.head_size; d += kWarp) x[d] = ToF(src[d]);
  __syncwarp();
  NormRotate<T>(s, buf, is_q, pos, x, lane);
}

// Token i's raw key and value rows of kv head hk, E values of each per lane (element lane + 32 e
// for e < E, where below H; E x 32 >= H): every slice's load goes out at once. Loaded one slice
// per loop step in the store loop, each load waited behind the previous step's stores (the
// compiler cannot move a load above a store through pointers that may alias): 4 to 16 dependent
// trips per row at head sizes 64 to 256, measured at 1,900 to 4,100 cycles on the decode
// kernel's appending CTA, the last of its merge at B=1. The decode kernel loads a
// warp's first row before it issues its first steps, so the loads land while they go out.
template <typename T, int E>
struct NewKvRow {
  T k[E], v[E];
  __device__ __forceinline__ void Load(const GqaShape& s, const GqaCudaBuffers& buf, int64_t b,
                                       int64_t i, int64_t hk, int lane) {
    const int64_t H = s.head_size;
    const TokenInputs<T> in(s, buf, b, i);
    const T* ks = in.k + hk * H;
    const T* vs = in.v + hk * H;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t d = lane + e * kWarp;
      k[e] = d < H ? ks[d] : FromF<T>(0.0f);
      v[e] = d < H ? vs[d] : FromF<T>(0.0f);
    }
  }
};

// A quantized cache (C: int8_t, PackedInt4 or Fp8E4M3): the warp stores the codes of the key row
// in x (normed, rotated, still float) and of the value row `row.v`, each value rounded to T first
// (ORT holds them in T), at element offset `off` of present (codes or packed bytes). x is reused.
// PER_TOKEN (a runtime branch, uniform per launch): each row's scale is computed first (a warp
// reduction of |x| over the row, TokenScale) and stored in the scale cache at ScaleIndex(off),
// then the row is quantized with its inverse; a non-finite row stores codes 0. Static scales:
// QuantInverse of the channel's scale. One rule for every cache type: dtype.h's, bit for bit.
template <typename T, typename C, int E>
__device__ void StoreQuantRows(const GqaShape& s, const GqaCudaBuffers& buf, int64_t off,
                               int64_t hk, const NewKvRow<T, E>& row, float* x, int lane) {
  const int64_t H = s.head_size;
  // x holds the row's values (rounded to T, synchronized by the warp): its codes into dst.
  // The loops run over the E values a lane holds (H <= E x 32: NewKvRow), unrolled with the
  // bound as a predicate: as loops to a runtime H they were unrolled with remainders, per cache
  // type and tensor (the int8 append was 1,918 instructions, sm_90a, head size 128).
  auto store = [&](C* dst, const float* scale, float* tokens, KvQuant quant) {
    float token_inv = 0.0f;
    bool zero = false;
    if (quant == KvQuant::kPerToken) {
      float amax = 0.0f;
      bool finite = true;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < H) {
          const float a = fabsf(x[d]);
          finite &= a <= 3.402823466e38f;  // false for Inf and NaN
          amax = a > amax ? a : amax;
        }
      }
      amax = WarpMax(amax);  // exact: the same maximum in any order
      finite = __all_sync(0xffffffffu, finite);
      const float sc = TokenScale(amax, finite, kTokenQMax<C>, &token_inv);
      zero = !finite;
      if (lane == 0) tokens[ScaleIndex(s, off)] = sc;
    }
    auto inv_of = [&](int64_t d) {
      return quant == KvQuant::kPerToken ? token_inv
                                         : QuantInverse(ChannelScale(scale, quant, H, hk, d));
    };
    auto val = [&](int64_t d) { return zero ? 0.0f : x[d]; };
    if constexpr (kFp8Cache<C>) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < H) dst[d].bits = FloatToFp8(__fmul_rn(val(d), inv_of(d)));
      }
    } else if constexpr (kCacheBits<C> == 8) {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int64_t d = lane + e * kWarp;
        if (d < H) dst[d] = static_cast<int8_t>(QuantCode(val(d), inv_of(d), -128.0f, 127.0f));
      }
    } else {
      // Byte p holds channels 2p (low nibble) and 2p + 1 (high; code 0 past an odd H).
#pragma unroll
      for (int e = 0; e < (E + 1) / 2; ++e) {
        const int64_t p = lane + e * kWarp;
        if (p < (H + 1) / 2) {
          const int q0 = QuantCode(val(2 * p), inv_of(2 * p), -8.0f, 7.0f);
          const int q1 =
              2 * p + 1 < H ? QuantCode(val(2 * p + 1), inv_of(2 * p + 1), -8.0f, 7.0f) : 0;
          dst[p].bits = static_cast<uint8_t>(((q0 + 8) & 15) | (((q1 + 8) & 15) << 4));
        }
      }
    }
  };
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < H) x[d] = ToF(FromF<T>(x[d]));
  }
  __syncwarp();
  store(static_cast<C*>(buf.present_key) + off, buf.k_scale, buf.present_key_scale, s.k_quant);
  __syncwarp();
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < H) x[d] = ToF(row.v[e]);
  }
  __syncwarp();
  store(static_cast<C*>(buf.present_value) + off, buf.v_scale, buf.present_value_scale,
        s.v_quant);
  __syncwarp();
}

// One warp appends token i's key (normed, rotated) and value rows of kv head hk, `row` (loaded
// by NewKvRow::Load for the same token and head), to the cache `present_st` describes: the row
// of position past + i (cache_base is row 0, non-zero only when a sliding window cache stages
// the rows). `pos`: ClampedRotaryPosition of the token. C: the cache's element type (T, or the
// codes of a quantized cache, written by StoreQuantRows).
template <typename T, typename C = T, int E>
__device__ void AppendKvRow(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                            const BatchGeometry& g, int64_t b, int64_t i, int64_t hk, int64_t pos,
                            const NewKvRow<T, E>& row, float* x, int lane) {
  const int64_t H = s.head_size;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < H) x[d] = ToF(row.k[e]);
  }
  __syncwarp();
  NormRotate<T>(s, buf, false, pos, x, lane);
  const int64_t off = present_st.Offset(b, hk, g.past - g.cache_base + i);
  if constexpr (std::is_same<C, int8_t>::value) {  // the decode kernel's 8-bit instances
    if (s.fp8_cache()) {                            // also serve float8e4m3fn caches
      StoreQuantRows<T, Fp8E4M3>(s, buf, off, hk, row, x, lane);
      return;
    }
  }
  if constexpr (kQuantCache<C>) {
    StoreQuantRows<T, C>(s, buf, off, hk, row, x, lane);
    return;
  }
  T* kd = static_cast<T*>(buf.present_key) + off;
  T* vd = static_cast<T*>(buf.present_value) + off;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t d = lane + e * kWarp;
    if (d < H) {
      kd[d] = FromF<T>(x[d]);
      vd[d] = row.v[e];
    }
  }
  __syncwarp();  // x is reused by the warp's next row
}

}  // namespace cu
}  // namespace kvl
