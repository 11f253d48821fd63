// The online softmax of the tensor-core kernels (decode_*.cuh, prefill_sm80.cu) and the merge of
// its partial states: one key step's masks, maxima, rescale and sums over an m16 tile held in
// mma.sync C fragments, and the weights and sums that merge partials (warps, splits, clusters)
// with the same arithmetic everywhere, so every merge path gives the same bits.
//
// A thread holds two rows of the tile, hr = 0 (fragment elements e = 0, 1) and hr = 1 (e = 2, 3),
// each with its state: the running maximum m, the sum l of exp(score - m) over its keys (this
// thread's columns only, summed over the quad at the end: QuadSum) and the output accumulators o.
#pragma once

#include <cstdint>

#include "core/length_rules.h"
#include "core/softcap.h"
#include "cuda/common.cuh"
#include "cuda/ptx.cuh"

namespace kvl {
namespace cu {

// The weight of a partial softmax (its max m, its sum l) in a merge whose max is mx. A partial
// without live keys (m = -inf, l = 0) weighs 0 and is skipped, whatever its O holds. A NaN score
// makes l NaN (fmaxf drops it from m, which may stay -inf or lie far below mx, where the weight
// would underflow to 0 and be skipped): such a partial weighs NaN, so the NaN reaches the output
// as in ORT's op, whichever warp or split held it.
__device__ __forceinline__ float PartialWeight(float m, float l, float mx) {
  if (l != l) return l;
  if (m == -INFINITY) return 0.0f;  // l == 0: no live keys
  return __expf(m - mx);
}

// A row's value summed over the four threads (tq) of its fragment quad.
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// f(n, e, hr) for each score of the tile the thread holds (n-tile n, element e of row hr = e /
// 2), the second row's only with `upper`.
template <int NT, typename F>
__device__ __forceinline__ void ForEachRowScore(bool upper, F f) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hr = e / 2;
      if (hr == 1 && !upper) continue;
      f(n, e, hr);
    }
  }
}

// A score of the masked path: key `key` of a row whose live keys are `kr`, softcapped, plus its
// bias, -inf outside the live keys.
template <typename T>
__device__ __forceinline__ float MaskedScore(float x, int64_t key, const KeyRange& kr,
                                             const GqaShape& s, float inv_softcap, const T* bias,
                                             int64_t bias_row) {
  const bool live = key >= kr.lo && key < kr.hi;
  if (s.softcap > 0.0f) x = Softcap(x, s.softcap, inv_softcap);
  if (bias != nullptr && live) x += ToF(bias[bias_row + key]);
  return live ? x : -INFINITY;
}

// The scores `sc` of an m16 x (8 NT) tile in C fragments (n-tile n, element e: the thread's row
// hr = e / 2, key k0 + 8 n + 2 tq + e % 2), masked through MaskedScore unless `whole` (no
// softcap or bias and every key live for every working row: one branch for the step, not a
// test per score), and each of the thread's two rows' maxima over them. The second row
// (e = 2, 3) is skipped unless `upper`.
template <typename T, int NT>
__device__ __forceinline__ void MaskStepScores(float (&sc)[NT][4], float (&tmax)[2], bool whole,
                                               bool upper, int64_t k0, int tq,
                                               const KeyRange (&kr)[2], const GqaShape& s,
                                               float inv_softcap, const T* bias,
                                               const int64_t (&bias_row)[2]) {
  tmax[0] = tmax[1] = -INFINITY;
  if (whole) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (e < 2 || upper) tmax[e / 2] = fmaxf(tmax[e / 2], sc[n][e]);
      }
    }
    return;
  }
  ForEachRowScore<NT>(upper, [&](int n, int e, int hr) {
    const int64_t key = k0 + n * 8 + 2 * tq + (e % 2);
    sc[n][e] = MaskedScore(sc[n][e], key, kr[hr], s, inv_softcap, bias, bias_row[hr]);
    tmax[hr] = fmaxf(tmax[hr], sc[n][e]);
  });
}

// One key step of the online softmax after MaskStepScores: the rows' new maxima (tmax over the
// quad), sc turned into probabilities P = exp(score - m), l and o rescaled to the new maxima and
// l given the step's sums. `whole`: no score is masked (m is finite; NaN scores propagate).
// Without `upper` the second row is idle: its P only reaches its own O, so it is skipped.
template <int NT, int DT>
__device__ __forceinline__ void OnlineSoftmaxStep(float (&sc)[NT][4], float (&tmax)[2],
                                                  bool whole, bool upper, float (&m)[2],
                                                  float (&l)[2], float (&o)[DT][4]) {
  float alpha[2] = {1.0f, 1.0f};
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    if (hr == 1 && !upper) continue;
    tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 1));
    tmax[hr] = fmaxf(tmax[hr], __shfl_xor_sync(0xffffffffu, tmax[hr], 2));
    const float m_new = fmaxf(m[hr], tmax[hr]);
    alpha[hr] = m_new == -INFINITY ? 1.0f : __expf(m[hr] - m_new);  // 0 when m was -inf
    m[hr] = m_new;
  }
  float psum[2] = {0.0f, 0.0f};
  ForEachRowScore<NT>(upper, [&](int n, int e, int hr) {
    const float p = !whole && sc[n][e] == -INFINITY ? 0.0f : __expf(sc[n][e] - m[hr]);
    sc[n][e] = p;
    psum[hr] += p;
  });
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) l[hr] = l[hr] * alpha[hr] + psum[hr];  // QuadSum at the end
#pragma unroll
  for (int n = 0; n < DT; ++n) {
    o[n][0] *= alpha[0];
    o[n][1] *= alpha[0];
  }
  if (upper) {
#pragma unroll
    for (int n = 0; n < DT; ++n) {
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
  }
}

// acc += P V for KS keys: P from the score registers (the C layout of two n-tiles is the A layout
// of one k-step), V's B fragments of k-step kk and output n-tiles j, j + 1 from
// load_v(kk, j, vb) (an ldmatrix.x4.trans).
template <typename T, int KS, int DT, typename LoadV>
__device__ __forceinline__ void AccumulatePV(float (&acc)[DT][4], const float (&sc)[KS / 8][4],
                                             LoadV load_v) {
#pragma unroll
  for (int kk = 0; kk < KS / 16; ++kk) {
    uint32_t a[4];
    ptx::ScoresToA<T>(a, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
    for (int j = 0; j < DT; j += 2) {
      uint32_t vb[4];
      load_v(kk, j, vb);
      ptx::Mma16816<T>(acc[j], a, vb[0], vb[1]);
      ptx::Mma16816<T>(acc[j + 1], a, vb[2], vb[3]);
    }
  }
}

// acc += x * wt, one fused multiply-add per component: the arithmetic of every merge of
// partials (warps, cluster, global), so their bits agree.
__device__ __forceinline__ void Fma4(float4& acc, const float4& x, float wt) {
  acc.x = fmaf(x.x, wt, acc.x);
  acc.y = fmaf(x.y, wt, acc.y);
  acc.z = fmaf(x.z, wt, acc.z);
  acc.w = fmaf(x.w, wt, acc.w);
}
// Four output values of a row, scaled and rounded to T.
template <typename T>
__device__ __forceinline__ void StoreScaled4(T* out, const float4& v, float sc) {
  out[0] = FromF<T>(v.x * sc);
  out[1] = FromF<T>(v.y * sc);
  out[2] = FromF<T>(v.z * sc);
  out[3] = FromF<T>(v.w * sc);
}

// K items (each a row's values d .. d + 3; the first k_items of them are real) of a merge of
// n <= N partials, where load(k, sp, m, l, x) gives partial sp's maximum, sum and four values
// for item k: every load of every item is issued before any is used (one round trip to where the
// partials lie: a cluster's shared memory or L2), and an empty partial (weight 0) adds zeros
// through a select, not a skipped branch (the compiler sank a partial's load into such a
// branch, after the other loads had landed). The arithmetic and its order are the staged global
// merge's (split order, l sums in WarpSum's butterfly), so the bits do not depend on which of
// them ran. Gives each item's weighted sum of the values in acc, the merge's maximum in mx and
// its sum in lsum.
template <int N, int K, typename Load>
__device__ __forceinline__ void MergeFewPartials(int n, int k_items, Load load, float4 (&acc)[K],
                                                 float (&mx)[K], float (&lsum)[K]) {
  static_assert(N >= 2 && N <= 16 && (N & (N - 1)) == 0, "WarpSum's butterfly over N lanes");
  float pm[K][N], pl[K][N];
  float4 px[K][N];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (k < k_items && sp < n) load(k, sp, pm[k][sp], pl[k][sp], px[k][sp]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    mx[k] = -INFINITY;
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (sp < n) mx[k] = fmaxf(mx[k], pm[k][sp]);
    }
    float lw[N] = {};  // l x weight of each split, 0 past the live ones
    acc[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const float4 zero = acc[k];
#pragma unroll
    for (int sp = 0; sp < N; ++sp) {
      if (sp >= n) continue;  // compile-time sp against the count: a predicate
      const float wt = PartialWeight(pm[k][sp], pl[k][sp], mx[k]);
      // An empty partial adds nothing, whatever it holds (no 0 x Inf): x = 0 and wt = 0 leave
      // acc as it is (it is never -0: it starts at +0 and a sum with +0 is +0), as a skip would.
      const bool empty = wt == 0.0f;
      const float4 x = empty ? zero : px[k][sp];
      lw[sp] = empty ? 0.0f : __fmul_rn(pl[k][sp], wt);  // never contracted: rounded once
      Fma4(acc[k], x, wt);
    }
    // WarpSum's butterfly (xor 16, 8, 4, 2, 1) over lanes holding lw[0 .. N-1], zeros
    // elsewhere: the steps above N add zeros (exact), then lane i adds lane i + w's sum.
#pragma unroll
    for (int w = N / 2; w >= 1; w /= 2) {
#pragma unroll
      for (int i = 0; i < w; ++i) lw[i] = __fadd_rn(lw[i], lw[i + w]);
    }
    lsum[k] = lw[0];
  }
}
// One item: load(sp, m, l, x).
template <int N, typename Load>
__device__ __forceinline__ float4 MergeFewPartials(int n, Load load, float& mx, float& lsum) {
  float4 acc[1];
  float m1[1], l1[1];
  MergeFewPartials<N, 1>(
      n, 1, [&](int, int sp, float& m, float& l, float4& x) { load(sp, m, l, x); }, acc, m1, l1);
  mx = m1[0];
  lsum = l1[0];
  return acc[0];
}

}  // namespace cu
}  // namespace kvl
