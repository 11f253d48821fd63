// The decode CTA's key loop: each warp streams its own steps (every W-th KS-key step of the
// split) through ST cp.async stages, with no CTA barrier inside the loop, and keeps the online
// softmax (online_softmax.cuh) of the CTA's rows over its keys: scores and P V on mma.sync
// m16n8k16, one m16 tile of rows, so every K/V byte is read once per KV group.
#pragma once

#include "cuda/decode_cta.cuh"

namespace kvl {
namespace cu {

template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ bool DecodeCta<T, HD, kForm, W, C>::KeyLoop() {
  // Padding columns [row_width, HD) of every stage are zeroed once, now that no slot holds the
  // tile or a scratch row; the copies write columns [0, row_width) only.
  for (int64_t idx = lane; !kQuant && HD > row_width && idx < ST * 2 * KS * (HD - row_width); idx += kWarp) {
    const int row = static_cast<int>(idx / (HD - row_width));  // of the ST x {K, V} tiles
    wsm[(row / KS) * KS * P +
        DecKvAt<HD>(row % KS, static_cast<int>(row_width + idx % (HD - row_width)))] =
        FromF<T>(0.0f);
  }

  // This thread's two rows: their key ranges inside the split. Rows past S x G are idle: their
  // query is zero and they are never written, so they need no masks. With at most 8 rows, the
  // second row of every thread is idle and its softmax is skipped (a uniform branch).
  idle[0] = gq >= rows;
  idle[1] = gq + 8 >= rows;
  upper = rows > 8;
  kr[0] = RowKeys(gq);
  kr[1] = RowKeys(gq + 8);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    kr[hr].lo = max(kr[hr].lo, k_begin);
    kr[hr].hi = min(kr[hr].hi, k_end);
  }
  bias = s.has_attention_bias ? static_cast<const T*>(buf.attention_bias) : nullptr;
  raw_scores = !(s.softcap > 0.0f) && bias == nullptr;  // no softcap, no bias
  inv_softcap = s.softcap > 0.0f ? SoftcapInverse(s.softcap) : 0.0f;
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    bias_row[hr] = 0;
    const int r = gq + hr * 8;
    if (bias != nullptr && r < rows) {
      const int64_t bb = s.bias_batch == 1 ? 0 : b, bh = s.bias_heads == 1 ? 0 : RowHead(r);
      bias_row[hr] = ((bb * s.bias_heads + bh) * s.seq_len + RowTok(r)) * s.bias_total;
    }
  }

  // Packed: the kv heads of this thread's rows gq and gq + 8 (NH or more for idle rows: no
  // head's pass is theirs).
  head_lo = kPack ? gq / Gi : 0;
  head_hi = kPack ? (gq + 8) / Gi : 0;

  m[0] = m[1] = -INFINITY;
  l[0] = l[1] = 0.0f;
#pragma unroll
  for (int n = 0; n < DTO + kOBias; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  if constexpr (kBiased) {  // Q (1152, ..., 1152)^T: every column holds the row's 1152 x sum
    float qs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      ptx::Mma16816<T>(qs, qa[kk], kInt8HalfBiasPair, kInt8HalfBiasPair);
    }
    k_bias[0] = -qs[0];
    k_bias[1] = -qs[2];
  }

  if constexpr (QLaneAt) {
#pragma unroll
    for (int v = 0; v < QKB / QKV; ++v) {
      const int byte = (v * 4 + tq) * QKV;
      qk_at[v] = DecQuantAt<QCR>(gq, byte / 16) + byte % 16;
    }
#pragma unroll
    for (int o1 = 0; o1 < 2; ++o1) {
      const int byte = gq * QVB;
      qv_at[o1] = DecQuantAt<QCR>(2 * tq + o1, byte / 16) + byte % 16;
    }
  }

  if constexpr (kQuant) {
    // One variant of the step per (fp8, PER_TOKEN): a runtime test inside the step split its
    // unrolled conversions into basic blocks the compiler could not schedule across (a branch
    // per converted word: docs/DECISIONS.md, "quantized step variants").
    const bool token = s.per_token();
    if (QBITS == 8 && s.fp8_cache()) {
      if constexpr (QBITS == 8) {
        if (token) {
          for (int64_t i = 0; i < my_steps; ++i) StepQuant<true, true>(i);
        } else {
          for (int64_t i = 0; i < my_steps; ++i) StepQuant<true, false>(i);
        }
      }
    } else if (token) {
      for (int64_t i = 0; i < my_steps; ++i) StepQuant<false, true>(i);
    } else {
      for (int64_t i = 0; i < my_steps; ++i) StepQuant<false, false>(i);
    }
  } else {
    for (int64_t i = 0; i < my_steps; ++i) Step(i);
  }
  if constexpr (kBiased) {  // O less 1152 x P's sums: the codes' products (0 unless biased V)
#pragma unroll
    for (int n = 0; n < DTO; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] -= o[DTO][e];
    }
  }

  // (Every accumulator feeds the kept store: keeping o[0] alone let the compiler drop the other
  // P V products.)
  KVL_DECODE_STOP_AFTER(3, [&] {
    float t = m[0] + l[0] + m[1] + l[1];
    for (int n = 0; n < DTO; ++n) t += o[n][0] + o[n][1] + o[n][2] + o[n][3];
    return t;
  }() == 1234.5f)
  return true;
}

// O += P V (AccumulatePV), V through ldmatrix.trans: the products of V's n-tiles [n0, n0 + DTO)
// into acc.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::PV(float (&acc)[DTO][4], int n0,
                                                               const float (&sc)[NT][4],
                                                               const T* vs, unsigned v_lane) {
  constexpr bool kXorAddr = DecSwizzled(HD);
  AccumulatePV<T, KS, DTO>(acc, sc, [&](int kk, int j, uint32_t (&vb)[4]) {
    const int n = n0 + j;
    // matrices: (keys lo, d n) (keys hi, d n) (lo, n+8) (hi, n+8)
    const int mi = lane / 8;
    if constexpr (kXorAddr) {
      ptx::LdMatrixX4TransAt(vb, (v_lane ^ unsigned((n & 7) << 4)) +
                                     unsigned((kk * 16 * HD + (n & ~7) * 8) * 2));
    } else {
      ptx::LdMatrixX4Trans(vb, vs + DecKvAt<HD>(kk * 16 + (mi % 2) * 8 + lane % 8,
                                                n * 8 + (mi / 2) * 8));
    }
  });
}

// The opening of step i (Step, StepQuant): issue step i + ST - 1, then wait until every lane's
// copies of step i have landed. The slot of step i - 1 was read by every lane before the barrier
// closing that step, so step i + ST - 1 goes into it before waiting: ST steps in flight during
// the wait.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::WaitStep(int64_t i) {
  __syncwarp();
  if (i + ST - 1 < my_steps) Issue(i + ST - 1);
  ptx::CpAsyncCommit();
  ptx::CpAsyncWait<ST - 1>();  // this lane's copies of step i have landed
  __syncwarp();                // ... and every lane's
}

// The scores of the step at key k0 (Step, StepQuant) turned into P: masks, softcap, bias, then
// the online softmax of rows gq (e = 0, 1) and gq + 8 (e = 2, 3), which rescales l and o. A step
// inside the key range of every working row of the warp needs no masks.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
template <bool kBiasTile>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::SoftmaxStep(float (&sc)[NT][4],
                                                                        int64_t k0) {
  const bool whole =
      raw_scores &&
      __all_sync(0xffffffffu, (idle[0] || (kr[0].lo <= k0 && k0 + KS <= kr[0].hi)) &&
                                  (idle[1] || (kr[1].lo <= k0 && k0 + KS <= kr[1].hi)));
  float tmax[2];
  MaskStepScores<T, NT>(sc, tmax, whole, upper, k0, tq, kr, s, inv_softcap, bias, bias_row);
  if constexpr (kBiasTile) {
    OnlineSoftmaxStep<NT, DTO + 1>(sc, tmax, whole, upper, m, l, o);
  } else {  // o's first DTO n-tiles: a variant that leaves o[DTO] at 0 keeps no registers for it
    OnlineSoftmaxStep<NT, DTO>(sc, tmax, whole, upper, m, l,
                               reinterpret_cast<float(&)[DTO][4]>(o));
  }
}

// Step i of this warp: WaitStep, then its scores, softmax and P V.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::Step(int64_t i) {
  WaitStep(i);
  if constexpr (kDecodeTrace) {
    if (i == 0) {
      prologue_trace.Mark();  // warp 0's first step landed
      if (KVL_DECODE_TRACE == 1 && (split == 0 || appended || split == live - 1)) {
        prologue_trace.PrintPrologue(split, live, appended);
      }
    }
  }
  const T* ks = StepSlot(i);
  const T* vs = ks + KS * P;
  const int64_t k0 = StepKey(i);
  // Swizzled tiles: the lane's ldmatrix rows (K: keys (mi / 2) 8 + l, chunk mi % 2; V: keys
  // (mi % 2) 8 + l, chunk mi / 2; l = lane % 8) at chunk position (chunk ^ l), bits 4-6 of
  // these addresses (unused, and 0, with padded tiles). A lane's address for chunk position
  // c ^ k is its address for c with those bits XORed by k: one XOR and an immediate per
  // ldmatrix (DecKvAt's form cost about 45 more instructions per warp step at head size 128).
  constexpr bool kXorAddr = DecSwizzled(HD);
  const int mi_l = lane / 8, l8 = lane % 8;
  const unsigned k_lane =
      kXorAddr ? ptx::SharedAddress(ks) +
                     unsigned((((mi_l / 2) * 8 + l8) * HD + (((mi_l % 2) ^ l8) << 3)) * 2)
               : 0u;
  const unsigned v_lane =
      kXorAddr ? ptx::SharedAddress(vs) +
                     unsigned((((mi_l % 2) * 8 + l8) * HD + (((mi_l / 2) ^ l8) << 3)) * 2)
               : 0u;

  // Q K^T per head: head hh's k-steps (kk of hh's SH columns) into hs_sc[hh]; each row keeps
  // its own head's (one head: sc itself).
  float hs_sc[NH][NT][4];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) hs_sc[hh][n][e] = 0.0f;
    }
  }
#pragma unroll
  for (int kk = 0; kk < KT; ++kk) {
    const int hh = kk / KTQ;
#pragma unroll
    for (int n = 0; n < NT; n += 2) {  // two key n-tiles per ldmatrix.x4
      uint32_t kb[4];
      const int mi = lane / 8;  // matrices: (keys n, d lo) (keys n, d hi) (n+8, lo) (n+8, hi)
      if constexpr (kXorAddr) {
        ptx::LdMatrixX4At(kb, (k_lane ^ unsigned(((2 * kk) & 7) << 4)) +
                                  unsigned((n * 8 * HD + ((2 * kk) & ~7) * 8) * 2));
      } else {
        ptx::LdMatrixX4(kb, ks + DecKvAt<HD>(n * 8 + (mi / 2) * 8 + lane % 8,
                                             kk * 16 + (mi % 2) * 8));
      }
      ptx::Mma16816<T>(hs_sc[hh][n], qa[kk % KTQ], kb[0], kb[1]);
      ptx::Mma16816<T>(hs_sc[hh][n + 1], qa[kk % KTQ], kb[2], kb[3]);
    }
  }
  float sc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[n][e] = hs_sc[0][n][e];
  }
#pragma unroll
  for (int hh = 1; hh < NH; ++hh) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if ((e < 2 ? head_lo : head_hi) == hh) sc[n][e] = hs_sc[hh][n][e];
      }
    }
  }

  SoftmaxStep(sc, k0);

  if constexpr (!kPack) {
    PV(o, 0, sc, vs, v_lane);
  } else {
    // Head hh's columns for every row into a copy of o, which only hh's rows keep: a row never
    // adds another head's products (0 x a non-finite value would reach it), and its own are
    // added to its o as the per-head kernel adds them.
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      float t[DTO][4];
#pragma unroll
      for (int n = 0; n < DTO; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) t[n][e] = o[n][e];
      }
      PV(t, hh * DTO, sc, vs, v_lane);
#pragma unroll
      for (int n = 0; n < DTO; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if ((e < 2 ? head_lo : head_hi) == hh) o[n][e] = t[n][e];
        }
      }
    }
  }
}

// Step i of a quantized cache (Step's order: issue, wait, scores, softmax, P V), the operands
// converted from the raw codes in registers (QuantScores, QuantPV).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
template <bool kFp8, bool kToken>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::StepQuant(int64_t i) {
  WaitStep(i);
  const unsigned char* kt = reinterpret_cast<const unsigned char*>(StepSlot(i));
  const unsigned char* vt = kt + KST * P * sizeof(T);
  const int64_t k0 = StepKey(i);
  static_assert(!kFp8 || QBITS == 8, "float8e4m3fn bytes in the 8-bit instances only");
  // Biased int8 operands (kBiased): K's always (the K scale, static or per token, applies to
  // the corrected score), V's with static scales (a PER_TOKEN scale multiplies each code before
  // the MMA, where 1152 + code would lose the code's bits).
  constexpr bool kBiasK = kBiased && !kFp8, kBiasV = kBiasK && !kToken;
  const float* ksc = reinterpret_cast<const float*>(kt + kQuantScaleAt);
  const float* vsc = reinterpret_cast<const float*>(vt + kQuantScaleAt);

  float sc[NT][4];
  QuantScores<kFp8, kBiasK>(sc, kt);
  if constexpr (kToken) {  // each score column times its key's K scale (keys n 8 + 2 tq, + 1)
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[n][e] *= ksc[n * 8 + 2 * tq + (e & 1)];
    }
  }
  SoftmaxStep<kBiasV>(sc, k0);
  // A NaN V scale (non-finite row) reaches the rows attending its key: P = NaN.
  if constexpr (kToken) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = vsc[n * 8 + 2 * tq + (e & 1)];
        if (v != v && sc[n][e] != 0.0f) sc[n][e] = __int_as_float(0x7fc00000);
      }
    }
  }

  QuantPV<kFp8, kToken, kBiasV>(sc, vt, vsc);
}

// Q K^T of a quantized step into sc: n-tile n's B fragments are key n 8 + gq's codes, each lane
// of the quad reading its QKB bytes as whole vectors (QuantKDim gives the columns, in which order
// the query fragments were built). kBiasK: biased int8 K operands (the scores start at k_bias).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
template <bool kFp8, bool kBiasK>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::QuantScores(float (&sc)[NT][4],
                                                                        const unsigned char* kt) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[n][e] = kBiasK ? k_bias[e / 2] : 0.0f;
    const int r = n * 8 + gq;
    uint32_t kb[KT][2];
#pragma unroll
    for (int v = 0; v < QKB / QKV; ++v) {
      const int byte = (v * 4 + tq) * QKV;
      const unsigned char* src =
          kt + (QLaneAt ? n * QLS + qk_at[v] : DecQuantAt<QCR>(r, byte / 16) + byte % 16);
      uint32_t w[QKV / 4];
      if constexpr (QKV == 16) {
        const uint4 x = *reinterpret_cast<const uint4*>(src);
        w[0] = x.x;
        w[1] = x.y;
        w[2] = x.z;
        w[3] = x.w;
      } else {
        static_assert(QKV == 8, "8- or 16-byte key vectors");
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        w[0] = x.x;
        w[1] = x.y;
      }
#pragma unroll
      for (int ww = 0; ww < QKV / 4; ++ww) {
        const int ki = v * (QKV / 4) + ww;
        if constexpr (QBITS == 8) {
          if constexpr (kFp8) {
            Fp8x4ToPairs<T>(w[ww], kb[ki][0], kb[ki][1]);
          } else if constexpr (kBiasK) {
            Int8x4ToBiasedHalfPairs(w[ww], kb[ki][0], kb[ki][1]);
          } else {
            Int8x4ToPairs<T>(w[ww], kb[ki][0], kb[ki][1]);
          }
        } else {
          uint32_t p4[4];
          Int4x8ToPairs<T>(w[ww], p4);
          kb[2 * ki][0] = p4[0];
          kb[2 * ki][1] = p4[1];
          kb[2 * ki + 1][0] = p4[2];
          kb[2 * ki + 1][1] = p4[3];
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) ptx::Mma16816<T>(sc[n], qa[kk], kb[kk][0], kb[kk][1]);
  }
}

// O += P V of a quantized step: the lane reads QVB bytes (its eight-quad share of the columns,
// gq DTO .. gq DTO + DTO - 1) of its four keys 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 of each k-step
// and pairs them per column with byte permutes, so n-tile n's column gq is head column gq DTO + n
// (QuantVDim; MergeWarps stores them back in order). vsc: PER_TOKEN's V scales of the step;
// kBiasV: biased int8 V operands (o[DTO] sums 1152 x P).
template <typename T, int HD, DecodeForm kForm, int W, typename C>
template <bool kFp8, bool kToken, bool kBiasV>
__device__ __forceinline__ void DecodeCta<T, HD, kForm, W, C>::QuantPV(const float (&sc)[NT][4],
                                                                    const unsigned char* vt,
                                                                    const float* vsc) {
#pragma unroll
  for (int kk = 0; kk < KS / 16; ++kk) {
    uint32_t a[4];
    ptx::ScoresToA<T>(a, sc[2 * kk], sc[2 * kk + 1]);
    // PER_TOKEN: the V scales of keys (2 tq, 2 tq + 1) and (2 tq + 8, 2 tq + 9) as pairs of T
    // (a NaN one as 0: it must not reach rows whose P is 0 for its key).
    uint32_t vsp[2] = {0u, 0u};
    if constexpr (kToken) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int k = kk * 16 + 2 * tq + 8 * hf;
        const float v0 = vsc[k], v1 = vsc[k + 1];
        vsp[hf] = ptx::PackPair<T>(v0 == v0 ? v0 : 0.0f, v1 == v1 ? v1 : 0.0f);
      }
    }
    constexpr int NW = QVB / 4;  // words of each key's share
    uint32_t kw[4][NW];          // keys 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9
#pragma unroll
    for (int k4 = 0; k4 < 4; ++k4) {
      const int r = kk * 16 + 2 * tq + (k4 & 1) + (k4 >> 1) * 8;
      const int byte = gq * QVB;
      const unsigned char* src =
          vt + (QLaneAt ? (2 * kk + (k4 >> 1)) * QLS + qv_at[k4 & 1]
                        : DecQuantAt<QCR>(r, byte / 16) + byte % 16);
      if constexpr (NW == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(src);
        kw[k4][0] = x.x;
        kw[k4][1] = x.y;
        kw[k4][2] = x.z;
        kw[k4][3] = x.w;
      } else if constexpr (NW == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(src);
        kw[k4][0] = x.x;
        kw[k4][1] = x.y;
      } else {
        static_assert(NW == 1, "4-, 8- or 16-byte value shares");
        kw[k4][0] = *reinterpret_cast<const uint32_t*>(src);
      }
    }
    // Word w of each key's share at a time: its n-tiles' B fragments, then their products (the
    // fragments of one word live at once, not all DTO n-tiles').
    constexpr int NPW = DTO / NW;  // n-tiles (columns) per word
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      uint32_t vb[NPW][2];  // n-tile: (keys 2 tq, 2 tq + 1), (2 tq + 8, 2 tq + 9) of its column
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {  // b0 from keys 0, 1 of the four; b1 from keys 2, 3
        const uint32_t ka = kw[2 * hf][w], kb2 = kw[2 * hf + 1][w];
        if constexpr (QBITS == 8) {  // column 4 w + j: byte j of each key's word
          if constexpr (kFp8) {
            Fp8x4ToPairs<T>(__byte_perm(ka, kb2, 0x5140), vb[0][hf], vb[1][hf]);
            Fp8x4ToPairs<T>(__byte_perm(ka, kb2, 0x7362), vb[2][hf], vb[3][hf]);
          } else if constexpr (kBiasV) {
            Int8x4ToBiasedHalfPairs(__byte_perm(ka, kb2, 0x5140), vb[0][hf], vb[1][hf]);
            Int8x4ToBiasedHalfPairs(__byte_perm(ka, kb2, 0x7362), vb[2][hf], vb[3][hf]);
          } else {
            Int8x4ToPairs<T>(__byte_perm(ka, kb2, 0x5140), vb[0][hf], vb[1][hf]);
            Int8x4ToPairs<T>(__byte_perm(ka, kb2, 0x7362), vb[2][hf], vb[3][hf]);
          }
        } else {  // column 8 w + j: nibble j of each key's word
          uint32_t p4[4];
          Int4x8ToPairs<T>(__byte_perm(ka, kb2, 0x5410), p4);
#pragma unroll
          for (int j = 0; j < 4; ++j) vb[j][hf] = p4[j];
          Int4x8ToPairs<T>(__byte_perm(ka, kb2, 0x7632), p4);
#pragma unroll
          for (int j = 0; j < 4; ++j) vb[4 + j][hf] = p4[j];
        }
      }
      if constexpr (kToken) {
#pragma unroll
        for (int j = 0; j < NPW; ++j) {
          vb[j][0] = MulPairs<T>(vb[j][0], vsp[0]);
          vb[j][1] = MulPairs<T>(vb[j][1], vsp[1]);
        }
      }
#pragma unroll
      for (int j = 0; j < NPW; ++j) {
        ptx::Mma16816<T>(o[NPW * w + j], a, vb[j][0], vb[j][1]);
      }
    }
    if constexpr (kBiasV) {  // the k-step's 1152 x P sums, in every column of o[DTO]
      ptx::Mma16816<T>(o[DTO], a, kInt8HalfBiasPair, kInt8HalfBiasPair);
    }
  }
}

}  // namespace cu
}  // namespace kvl
