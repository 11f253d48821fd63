// The online softmax of an attention task's rows over one K/V tile: a row block's scores from the
// micro-kernels (score_kernels.h), each row's softmax weights against its running max and sum,
// and the weighted V rows added into the rows' outputs. The state (running max m, sum l, output
// o) lives in the task's per-thread Scratch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/softcap.h"
#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/score_kernels.h"
#include "cpu/simd.h"

KVL_ISA_BEGIN

// An attention task's working set (per thread: attention_task.h's ThreadScratch).
struct Scratch {
  int v_nonfinite = -1;  // the current tile's V rows: -1 not checked yet, 0 finite, 1 not
  std::vector<float> kt, k, v, row, scores, o, m, l, zero_q;
  std::vector<const float*> q_rows, k_rows, v_rows;
  // An int8 cache read in place (Int8Rows): the tile's code rows, each task row's query times the
  // K scales of its head (qk, qk_rows), and PER_TOKEN the tile's row scales (0 past the tile).
  std::vector<const int8_t*> kc_rows, vc_rows;
  std::vector<float> qk, k_scale, v_scale;
  std::vector<const float*> qk_rows;
  std::vector<float*> o_rows;
  std::vector<int64_t> lo, hi, head, token;
};

// What every row of a block needs to turn one tile's scores into weights: the tile (keys [k0,
// k0 + tile) of batch entry b), the score columns that can hold a key (width: short tiles at token
// generation over many heads skip the softmax work on the rest), softcap and the bias.
template <typename T>
struct TileScores {
  int64_t b, k0;
  int tile, width;
  float softcap, inv_softcap;
  const T* bias;
};

// Whether the tile's value rows (head_pad long) hold a NaN or an Inf; computed once per tile.
// Int8Rows: the codes are finite and the static scales validated finite; a PER_TOKEN row's scale
// (NaN for a non-finite row) multiplies its weight, so the tile's scales decide.
template <typename VS>
inline bool TileValuesNonFinite(Scratch& t, const VS& v, int tile, int64_t head_pad) {
  if (t.v_nonfinite < 0) {
    VecF acc = Splat(0.0f);
    if constexpr (std::is_same<VS, Int8Rows>::value) {
      for (int j = 0; j < tile; ++j) acc += Splat(t.v_scale[j]) * 0.0f;
    } else {
      for (int j = 0; j < tile; ++j) {
        for (int64_t d = 0; d < head_pad; d += kVW) acc += v.Get(j, d) * 0.0f;
      }
    }
    bool bad = false;
    for (int l = 0; l < kVW; ++l) bad |= acc[l] != 0.0f;  // x * 0 is NaN for NaN or Inf
    t.v_nonfinite = bad ? 1 : 0;
  }
  return t.v_nonfinite == 1;
}

// The scores of one row of a block, sc[0, kTileKeys) as the micro-kernels left them (softcap
// and bias not yet applied), become its softmax weights for this tile: capped, biased, masked to
// the row's keys [jlo, jhi) of the tile (range_lo/range_hi), exponentiated against the running max
// t.m[row], whose change rescales t.l[row] and the row's output. A row without keys in the tile
// (or whose scores so far are all -inf or NaN) gets weights 0. Returns whether the row leaves out
// a column of the tile that another row may use (a "partial" block, AccumulateRanges' case).
// Inlined into AttentionRows' row loop; `ts` by value, so its fields stay in registers there.
template <typename T>
[[gnu::always_inline]] inline bool SoftmaxRow(const Call<T>& c, Scratch& t, TileScores<T> ts,
                                              int64_t row, float* sc, int* range_lo,
                                              int* range_hi) {
  const GqaShape& s = c.s;
  const int64_t jlo = std::max<int64_t>(t.lo[row] - ts.k0, 0);
  const int64_t jhi = std::min<int64_t>(t.hi[row] - ts.k0, ts.tile);
  *range_lo = static_cast<int>(jlo);
  *range_hi = static_cast<int>(std::max(jlo, jhi));
  const bool partial = t.lo[row] < t.hi[row] && (jlo > 0 || jhi < ts.tile);
  if (jlo >= jhi) {
    std::fill(sc, sc + kTileKeys, 0.0f);
    return partial;
  }
  if (ts.softcap > 0.0f) {
    for (int j = 0; j < ts.width; j += kVW) {
      Store(sc + j, VecSoftcap(Load(sc + j), ts.softcap, ts.inv_softcap));
    }
  }
  if (ts.bias != nullptr) {
    const int64_t bb = s.bias_batch == 1 ? 0 : ts.b;
    const int64_t bh = s.bias_heads == 1 ? 0 : t.head[row];
    const T* brow = ts.bias + ((bb * s.bias_heads + bh) * s.seq_len + t.token[row]) * s.bias_total;
    for (int64_t j = jlo; j < jhi; ++j) sc[j] += ToFloat(brow[ts.k0 + j]);
  }
  for (int64_t j = 0; j < jlo; ++j) sc[j] = -std::numeric_limits<float>::infinity();
  for (int64_t j = jhi; j < ts.width; ++j) sc[j] = -std::numeric_limits<float>::infinity();
  // The running max skips NaN (x > NaN is false, and NaN never wins): a NaN score keeps
  // the max of the others, so exp(NaN - m) puts NaN into l and o below (IEEE propagation,
  // as ORT's softmax). A NaN first lane used to become the tile max and drop the tile.
  VecF vmax = Splat(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < ts.width; j += kVW) {
    const VecF x = Load(sc + j);
    vmax = x > vmax ? x : vmax;
  }
  float tile_max = vmax[0];
  for (int l = 1; l < kVW; ++l) tile_max = std::max(tile_max, vmax[l]);
  const float m_old = t.m[row];
  const float m_new = std::max(m_old, tile_max);
  if (m_new == -std::numeric_limits<float>::infinity()) {
    // Every score so far -inf (e.g. a -inf bias: no weight, as ORT) or NaN: a NaN score
    // (NaN query, key or bias) makes the row NaN through l.
    for (int64_t j = jlo; j < jhi; ++j) {
      if (std::isnan(sc[j])) t.l[row] = std::numeric_limits<float>::quiet_NaN();
    }
    std::fill(sc, sc + kTileKeys, 0.0f);
    return partial;
  }
  VecF sum = Splat(0.0f);
  for (int j = 0; j < ts.width; j += kVW) {
    const VecF e = VecExp(Load(sc + j) - m_new);
    Store(sc + j, e);
    sum += e;
  }
  float tile_sum = 0.0f;
  for (int k = 0; k < kVW; ++k) tile_sum += sum[k];
  const float alpha =
      m_old == -std::numeric_limits<float>::infinity() ? 0.0f : VecExp(Splat(m_old - m_new))[0];
  t.l[row] = t.l[row] * alpha + tile_sum;
  t.m[row] = m_new;
  if (alpha != 1.0f) {
    float* o = t.o_rows[row];
    for (int64_t d = 0; d < c.head_pad; d += kVW) Store(o + d, Load(o + d) * alpha);
  }
  return partial;
}

// Rows [r_begin, r_end) of the task against one tile, RB rows at a time: scores, softmax weights
// (SoftmaxRow), then the V rows weighted into the output rows. K and V rows come from ks / vs
// (dot_scores; a transposed tile reads t.kt). With Int8Rows the queries are t.qk_rows (K scales
// folded in), PER_TOKEN scores are multiplied by the keys' scales and weights by the values'
// scales (t.k_scale, t.v_scale); per-channel V scales are applied to the output at the task's end.
template <typename T, int RB, typename KS, typename VS>
void AttentionRows(const Call<T>& c, Scratch& t, TileScores<T> ts, int64_t r_begin, int64_t r_end,
                   bool dot_scores, const KS& ks, const VS& vs) {
  constexpr bool codes = std::is_same<VS, Int8Rows>::value;
  const bool token_scales = codes && c.s.per_token();
  const int64_t hp = c.head_pad;
  for (int64_t r0 = r_begin; r0 < r_end; r0 += RB) {
    bool any = false;
    for (int r = 0; r < RB; ++r) any |= t.lo[r0 + r] < ts.k0 + ts.tile && t.hi[r0 + r] > ts.k0;
    if (!any) continue;
    if (dot_scores) {
      const float* const* q = codes ? t.qk_rows.data() + r0 : t.q_rows.data() + r0;
      ScoreDot<RB>(q, ks, vs, ts.tile, hp, t.scores.data());
      if (token_scales) {
        for (int r = 0; r < RB; ++r) {
          float* sc = t.scores.data() + r * kTileKeys;
          const float* ks_tile = t.k_scale.data();
          for (int j = 0; j < kTileKeys; j += kVW) Store(sc + j, Load(sc + j) * Load(ks_tile + j));
        }
      }
    } else {
      ScoreBlock<RB>(t.q_rows.data() + r0, t.kt.data(), c.s.head_size, t.scores.data());
    }
    // A block where some row with keys leaves out a column is "partial" (causal diagonal, window
    // edges, rows whose keys lie elsewhere). Rows without keys (padding) are not written: they do
    // not count.
    int range_lo[RB], range_hi[RB];
    bool partial = false;
    for (int r = 0; r < RB; ++r) {
      partial |=
          SoftmaxRow(c, t, ts, r0 + r, t.scores.data() + r * kTileKeys, &range_lo[r], &range_hi[r]);
    }
    // A masked column has weight 0, but 0 * (NaN or Inf) in its value row is NaN: in a partial
    // block whose tile holds a non-finite value, each row sums its own columns only (rare: the
    // check runs for partial blocks, once per tile and head; a decode has none).
    if (token_scales) {  // weights times the values' scales (l summed the weights above)
      for (int r = 0; r < RB; ++r) {
        float* sc = t.scores.data() + r * kTileKeys;
        for (int j = range_lo[r]; j < range_hi[r]; ++j) sc[j] *= t.v_scale[j];
      }
    }
    if (partial && TileValuesNonFinite(t, vs, ts.tile, hp)) {
      AccumulateRanges<RB>(t.scores.data(), vs, range_lo, range_hi, hp, t.o_rows.data() + r0);
    } else {
      AccumulateBlock<RB>(t.scores.data(), vs, ts.tile, hp, t.o_rows.data() + r0);
    }
  }
}

KVL_ISA_END
