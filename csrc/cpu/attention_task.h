// The attention task of the CPU kernels (gqa_cpu.cc's Run runs one per (batch entry, kv head
// group, query block, key split)): its rows mapped to query heads and tokens, the K/V tiles of
// its keys loaded (transposed, dequantized or pointed to), the online softmax over them
// (attention_rows.h), and the rows' outputs written, or their partial states merged across key
// splits (MergeSplits).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/gqa_types.h"
#include "core/softcap.h"
#include "cpu/attention_rows.h"
#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/row_io.h"
#include "cpu/score_kernels.h"
#include "cpu/simd.h"

KVL_ISA_BEGIN

// Where row r of a task lives: its KV head, query head and token (valid = false for padding).
struct TaskRow {
  bool valid;
  int64_t kv_head, head, token;
};
inline TaskRow MapRow(int64_t r, int64_t g0, int64_t i0, int64_t q_rows, int64_t G,
                      int64_t head_rows_pad) {
  const int64_t gl = r / head_rows_pad, rr = r % head_rows_pad;
  if (rr >= q_rows * G) return TaskRow{false, g0 + gl, 0, 0};
  return TaskRow{true, g0 + gl, (g0 + gl) * G + rr % G, i0 + rr / G};
}

// Normalizes one row's (o, m, l) state, adding the extra softmax term (smooth_softmax: a zero
// logit; head_sink: that head's sink logit), and stores it into output (B, S, N*H).
template <typename T>
void WriteOutputRow(const Call<T>& c, int64_t b, int64_t i, int64_t h, const float* o, float m,
                    float l) {
  const GqaShape& s = c.s;
  T* out = static_cast<T*>(c.buf.output) + (b * s.seq_len + i) * s.num_heads * s.head_size +
           h * s.head_size;
  const float sink = s.has_head_sink ? Get<T>(c.buf.head_sink, h) : 0.0f;
  const float factor = OutputScale(m, l, s.has_head_sink || s.smooth_softmax, sink);
  if (l == 0.0f) {  // no key (W = 0): zeros, whatever o holds
    for (int64_t d = 0; d < s.head_size; ++d) out[d] = FromFloat<T>(0.0f);
    return;
  }
  for (int64_t d = 0; d < s.head_size; ++d) out[d] = FromFloat<T>(o[d] * factor);
}

// One attention task's fixed facts, from its index: the block it covers, its key split, its
// rows, and how it reads the cache.
struct TaskPlan {
  TaskBlock blk;
  int64_t base;       // the task's index without the key split (MergeSplits' task)
  int64_t split;      // its key split
  int64_t head_rows;  // rows of one kv head, padded to the row block
  int64_t rows_pad;   // rows of the task: group_heads * head_rows
  // One row block per head (token generation): dot products over key rows; else a transposed K
  // tile shared by the head's row blocks.
  bool dot_scores;
  // There an int8 cache is read in place (Int8Rows) when its rows fill head_pad (no load past a
  // row's end); other quantized caches are dequantized into the scratch a tile at a time (LoadRow).
  bool codes;
  // float32 rows of head_pad length are read in place, except a prefill's seq-major V rows: the
  // PV micro-kernel walks a V tile once per row block (~40 times), and rows Nkv*H floats apart
  // (a page each at 32/8/128) cost TLB and prefetch misses every walk; a packed copy costs one
  // pass (part of what took seq-major S=2048 32/8/128 AVX2 prefill from ~30 to 40 GFLOP/s).
  bool direct_v;
  BatchGeometry geo;
};

template <typename T>
TaskPlan PlanTask(const Call<T>& c, size_t task_index) {
  const GqaShape& s = c.s;
  TaskPlan p;
  p.split = static_cast<int64_t>(task_index) % c.num_splits;
  p.base = static_cast<int64_t>(task_index) / c.num_splits;
  p.blk = c.task_block(p.base);
  p.head_rows = c.head_rows_pad();
  p.rows_pad = c.group_heads * p.head_rows;
  p.dot_scores = p.head_rows == c.row_block;
  const int64_t H = s.head_size;
  p.codes = p.dot_scores && s.quantized() && !s.fp8_cache() && s.kv_bits == 8 && H == c.head_pad;
  p.direct_v = std::is_same<T, float>::value && !s.quantized() && H == c.head_pad &&
               (p.dot_scores || c.present_strides.seq == H);
  p.geo = c.geo(p.blk.b);
  return p;
}

// The calling thread's scratch, reused across calls (ORT's pool threads persist). A reference
// to it, taken once per task: each use of a thread_local itself may look its address up again
// (__tls_get_addr in a shared library).
template <typename T>
Scratch& ThreadScratch() {
  thread_local Scratch t;
  return t;
}

// Sizes the per-thread scratch for the task and resets its softmax state (no keys yet).
template <typename T>
void ResetScratch(const Call<T>& c, const TaskPlan& p, Scratch& t) {
  const int64_t hp = c.head_pad, rows_pad = p.rows_pad;
  if (p.dot_scores) {
    t.k.resize(static_cast<size_t>(kTileKeys * hp));
  } else {
    t.kt.assign(static_cast<size_t>(c.s.head_size * kTileKeys), 0.0f);
  }
  t.v.resize(static_cast<size_t>(kTileKeys * hp));
  t.row.resize(static_cast<size_t>(hp));
  t.k_rows.resize(kTileKeys);
  t.scores.resize(static_cast<size_t>(kRowBlock * kTileKeys));
  t.o.assign(static_cast<size_t>(rows_pad * hp), 0.0f);
  t.m.assign(static_cast<size_t>(rows_pad), -std::numeric_limits<float>::infinity());
  t.l.assign(static_cast<size_t>(rows_pad), 0.0f);
  t.zero_q.assign(static_cast<size_t>(hp), 0.0f);
  t.q_rows.resize(rows_pad);
  t.o_rows.resize(rows_pad);
  t.v_rows.resize(kTileKeys);
  t.lo.assign(rows_pad, 0);
  t.hi.assign(rows_pad, 0);  // empty key range: padding rows
  t.head.assign(rows_pad, 0);
  t.token.assign(rows_pad, 0);
}

// Each row's query, query head, token and keys (per KV head of the task, token-major, so a
// micro-block usually shares a key range); returns the keys of all rows, within the task's split.
template <typename T>
KeyRange MapTaskRows(const Call<T>& c, const TaskPlan& p, Scratch& t) {
  const GqaShape& s = c.s;
  const int64_t hp = c.head_pad;
  int64_t key_lo = std::numeric_limits<int64_t>::max(), key_hi = 0;
  for (int64_t r = 0; r < p.rows_pad; ++r) {
    t.o_rows[r] = t.o.data() + r * hp;
    t.q_rows[r] = t.zero_q.data();
    const TaskRow row =
        MapRow(r, p.blk.g0, p.blk.i0, p.blk.i1 - p.blk.i0, s.group_size(), p.head_rows);
    if (!row.valid) continue;
    t.head[r] = row.head;
    t.token[r] = row.token;
    t.q_rows[r] =
        c.q_scaled.data() + ((p.blk.b * s.num_heads + row.head) * s.seq_len + row.token) * hp;
    // Right padding of a first prompt, rows beyond query_seqlens: no keys, output 0.
    const KeyRange keys = QueryKeyRange(s, p.geo, row.token);
    if (keys.lo >= keys.hi) continue;
    t.lo[r] = keys.lo;
    t.hi[r] = keys.hi;
    key_lo = std::min(key_lo, t.lo[r]);
    key_hi = std::max(key_hi, t.hi[r]);
  }
  // This task's key split.
  key_lo = std::max(key_lo, p.split * c.split_keys);
  key_hi = std::min(key_hi, (p.split + 1) * c.split_keys);
  return KeyRange{key_lo, key_hi};
}

// An int8 cache read in place: the queries times their head's K scales (PER_TOKEN: the scores
// take the rows' scales instead), and the tile's code rows and row scales sized.
template <typename T>
void FoldKeyScales(const Call<T>& c, const TaskPlan& p, Scratch& t) {
  const int64_t hp = c.head_pad;
  t.kc_rows.resize(kTileKeys);
  t.vc_rows.resize(kTileKeys);
  t.k_scale.assign(kTileKeys, 0.0f);
  t.v_scale.assign(kTileKeys, 0.0f);
  t.qk.resize(static_cast<size_t>(p.rows_pad * hp));
  t.qk_rows.resize(p.rows_pad);
  for (int64_t r = 0; r < p.rows_pad; ++r) {
    if (c.s.per_token()) {
      t.qk_rows[r] = t.q_rows[r];
      continue;
    }
    float* qk = t.qk.data() + r * hp;
    TimesHeadScales(c, 0, p.blk.g0 + r / p.head_rows, t.q_rows[r], qk);
    t.qk_rows[r] = qk;
  }
}

// Keys per tile. A task over all heads walks each tile once per head: keep a tile of every
// head's K near 64 KB so the tile stays in L2 across those passes (measured: 32/8/128 fp32
// seq-major decode 12 -> 16 GB/s with 16-key tiles; 9/3/64 keeps 64).
template <typename T>
int64_t TileKeys(const Call<T>& c) {
  if (c.group_heads == 1) return kTileKeys;
  const int64_t fit = (64 << 10) / (c.group_heads * static_cast<int64_t>(c.row_bytes));
  return std::min<int64_t>(kTileKeys, std::max<int64_t>(16, fit / 16 * 16));
}

// PrefetchNextTile, LoadTile and AttentionRowsAt run once per (tile, kv head), in AttentionTask's
// loop: inlined there (as calls they cost seq-major decode 5 to 9% at the AVX-512 level: a
// decode tile is 16 keys when one task covers every head).

// Prefetches kv head g's next tile (into L2) while the tile's other heads are worked on: in
// seq-major order one head's rows are Nkv*H apart, each on its own page, where hardware
// prefetchers stop. Issued per head, the prefetches spread over the tile's work instead of
// bursting at its start (seq-major decode +5 to 20%, DRAM-bound cases).
template <typename T>
[[gnu::always_inline]] inline void PrefetchNextTile(const Call<T>& c, const TaskPlan& p, int64_t g,
                                                    int64_t k0, int64_t tile_keys, int64_t key_hi) {
  const int64_t next_hi = std::min<int64_t>(key_hi, k0 + 2 * tile_keys);
  for (int64_t pos = k0 + tile_keys; pos < next_hi; ++pos) {
    const char* kp = reinterpret_cast<const char*>(c.key_row(p.blk.b, g, pos, p.geo, false));
    const char* vp = reinterpret_cast<const char*>(c.key_row(p.blk.b, g, pos, p.geo, true));
    for (size_t off = 0; off < c.row_bytes; off += 64) {
      __builtin_prefetch(kp + off, 0, 2);
      __builtin_prefetch(vp + off, 0, 2);
    }
  }
}

// kv head g's K tile, keys [k0, k0 + tile): transposed into t.kt[d][j] (zero past the tile), or
// rows; its V rows. float32 rows are used in place (direct_v); a quantized cache's rows are
// dequantized here by LoadRow; an int8 cache's rows at token generation are only pointed to
// (Int8Rows), with their PER_TOKEN scales.
template <typename T>
[[gnu::always_inline]] inline void LoadTile(const Call<T>& c, const TaskPlan& p, Scratch& t,
                                            int64_t g, int64_t k0, int tile) {
  const GqaShape& s = c.s;
  const int64_t H = s.head_size, hp = c.head_pad, b = p.blk.b;
  const BatchGeometry& geo = p.geo;
  int transposed = 0;  // keys [0, transposed) of kt filled 8 at a time
  while (!p.dot_scores && !s.quantized() && transposed + 8 <= tile) {
    const T* rows[8];
    for (int i = 0; i < 8; ++i) {
      rows[i] = reinterpret_cast<const T*>(c.key_row(b, g, k0 + transposed + i, geo, false));
    }
    if (!TransposeKRows8<T>(rows, H, t.kt.data() + transposed)) break;
    transposed += 8;
  }
  for (int j = 0; j < tile && p.codes; ++j) {
    t.kc_rows[j] = reinterpret_cast<const int8_t*>(c.key_row(b, g, k0 + j, geo, false));
    t.vc_rows[j] = reinterpret_cast<const int8_t*>(c.key_row(b, g, k0 + j, geo, true));
    if (s.per_token()) {
      t.k_scale[j] = c.row_scale(b, g, k0 + j, geo, false);
      t.v_scale[j] = c.row_scale(b, g, k0 + j, geo, true);
    }
  }
  for (int j = tile; j < kTileKeys && p.codes; ++j) t.k_scale[j] = t.v_scale[j] = 0.0f;
  for (int j = 0; j < tile && !p.codes; ++j) {
    const uint8_t* krow = c.key_row(b, g, k0 + j, geo, false);
    const uint8_t* vrow = c.key_row(b, g, k0 + j, geo, true);
    if (!p.dot_scores) {
      if (j >= transposed) {
        LoadRow(c, krow, 0, g, c.row_scale(b, g, k0 + j, geo, false), t.row.data());
        for (int64_t d = 0; d < H; ++d) t.kt[d * kTileKeys + j] = t.row[d];
      }
    } else if (p.direct_v) {
      t.k_rows[j] = reinterpret_cast<const float*>(krow);
    } else {
      const float scale = c.row_scale(b, g, k0 + j, geo, false);
      t.k_rows[j] = LoadPaddedRow(c, krow, 0, g, scale, t.k.data() + j * hp);
    }
    if (p.direct_v) {
      t.v_rows[j] = reinterpret_cast<const float*>(vrow);
    } else {
      const float scale = c.row_scale(b, g, k0 + j, geo, true);
      t.v_rows[j] = LoadPaddedRow(c, vrow, 1, g, scale, t.v.data() + j * hp);
    }
  }
  t.v_nonfinite = -1;  // new V rows
  for (int j = tile; j < kTileKeys && !p.dot_scores; ++j) {
    for (int64_t d = 0; d < H; ++d) t.kt[d * kTileKeys + j] = 0.0f;
  }
}

// AttentionRows at the call's row block (c.row_block, a compile-time RB for the micro-kernels).
template <typename T, typename KS, typename VS>
[[gnu::always_inline]] inline void AttentionRowsAt(const Call<T>& c, Scratch& t, TileScores<T> ts,
                                                   int64_t r_begin, int64_t r_end, bool dot_scores,
                                                   const KS& ks, const VS& vs) {
  if (c.row_block == kRowBlock) {
    AttentionRows<T, kRowBlock>(c, t, ts, r_begin, r_end, dot_scores, ks, vs);
  } else if (c.row_block == 1) {
    AttentionRows<T, 1>(c, t, ts, r_begin, r_end, dot_scores, ks, vs);
  } else if (c.row_block == 2) {
    AttentionRows<T, 2>(c, t, ts, r_begin, r_end, dot_scores, ks, vs);
  } else if (c.row_block == 3) {
    AttentionRows<T, 3>(c, t, ts, r_begin, r_end, dot_scores, ks, vs);
  } else {
    AttentionRows<T, 4>(c, t, ts, r_begin, r_end, dot_scores, ks, vs);
  }
}

// The task's rows once every tile is in: an int8 cache read in place takes the V scales of each
// row's head (per channel or tensor) here; with key splits the partial state goes to the call's
// buffers for MergeSplits, else each row's output is written.
template <typename T>
void FinishTask(const Call<T>& c, const TaskPlan& p, Scratch& t) {
  const int64_t hp = c.head_pad, rows_pad = p.rows_pad;
  if (p.codes && !c.s.per_token()) {
    for (int64_t r = 0; r < rows_pad; ++r) {
      TimesHeadScales(c, 1, p.blk.g0 + r / p.head_rows, t.o_rows[r], t.o_rows[r]);
    }
  }
  if (c.num_splits > 1) {  // partial state; MergeSplits finishes
    const int64_t slot = p.base * c.num_splits + p.split;
    const int64_t rpt = c.rows_per_task();
    std::memcpy(c.part_o->data() + slot * rpt * hp, t.o.data(), rows_pad * hp * sizeof(float));
    std::memcpy(c.part_m->data() + slot * rpt, t.m.data(), rows_pad * sizeof(float));
    std::memcpy(c.part_l->data() + slot * rpt, t.l.data(), rows_pad * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < rows_pad; ++r) {
    const int64_t rows = p.blk.i1 - p.blk.i0;
    if (!MapRow(r, p.blk.g0, p.blk.i0, rows, c.s.group_size(), p.head_rows).valid) continue;
    WriteOutputRow(c, p.blk.b, t.token[r], t.head[r], t.o_rows[r], t.m[r], t.l[r]);
  }
}

// Task (b, head group, q block, key split): the online softmax of the task's rows over the keys
// of its split, a tile at a time, every kv head of the group per tile.
template <typename T>
void AttentionTask(void* state, size_t task_index) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const TaskPlan p = PlanTask(c, task_index);
  Scratch& t = ThreadScratch<T>();
  ResetScratch(c, p, t);
  const KeyRange keys = MapTaskRows(c, p, t);
  if (p.codes) FoldKeyScales(c, p, t);
  const int64_t tile_keys = TileKeys(c);
  const float softcap = c.s.softcap;
  const float inv_softcap = softcap > 0.0f ? SoftcapInverse(softcap) : 0.0f;
  const T* bias = static_cast<const T*>(c.buf.attention_bias);
  for (int64_t k0 = keys.lo; k0 < keys.hi; k0 += tile_keys) {
    const int tile = static_cast<int>(std::min<int64_t>(tile_keys, keys.hi - k0));
    const TileScores<T> ts{p.blk.b, k0, tile, static_cast<int>(RoundUp(tile, kVW)),
                           softcap, inv_softcap, bias};
    for (int64_t gl = 0; gl < c.group_heads; ++gl) {
      const int64_t g = p.blk.g0 + gl;
      const int64_t r_begin = gl * p.head_rows, r_end = r_begin + p.head_rows;
      PrefetchNextTile(c, p, g, k0, tile_keys, keys.hi);
      bool any = false;
      for (int64_t r = r_begin; r < r_end; ++r) any |= t.lo[r] < k0 + tile && t.hi[r] > k0;
      if (!any) continue;
      LoadTile(c, p, t, g, k0, tile);
      if (p.codes) {
        AttentionRowsAt(c, t, ts, r_begin, r_end, p.dot_scores, Int8Rows{t.kc_rows.data()},
                        Int8Rows{t.vc_rows.data()});
      } else {
        AttentionRowsAt(c, t, ts, r_begin, r_end, p.dot_scores, FloatRows{t.k_rows.data()},
                        FloatRows{t.v_rows.data()});
      }
    }
  }
  FinishTask(c, p, t);
}

// Task (b, head group, q block): merges the key splits' partial states in a fixed order.
template <typename T>
void MergeSplits(void* state, size_t task_index) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const int64_t G = s.group_size(), hp = c.head_pad, rpt = c.rows_per_task();
  const int64_t base = static_cast<int64_t>(task_index);
  const TaskBlock blk = c.task_block(base);
  std::vector<float> o(static_cast<size_t>(hp));
  for (int64_t r = 0; r < rpt; ++r) {
    const TaskRow row = MapRow(r, blk.g0, blk.i0, blk.i1 - blk.i0, G, c.head_rows_pad());
    if (!row.valid) continue;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t sp = 0; sp < c.num_splits; ++sp) {
      m = std::max(m, (*c.part_m)[(base * c.num_splits + sp) * rpt + r]);
    }
    std::fill(o.begin(), o.end(), 0.0f);
    float l = 0.0f;
    for (int64_t sp = 0; sp < c.num_splits; ++sp) {
      const int64_t slot = base * c.num_splits + sp;
      const float ms = (*c.part_m)[slot * rpt + r];
      if (ms == -std::numeric_limits<float>::infinity()) {
        l += (*c.part_l)[slot * rpt + r];  // 0, or NaN for a split that saw only NaN scores
        continue;
      }
      const float w = std::exp(ms - m);
      l += (*c.part_l)[slot * rpt + r] * w;
      const float* os = c.part_o->data() + (slot * rpt + r) * hp;
      for (int64_t d = 0; d < hp; ++d) o[d] += os[d] * w;
    }
    WriteOutputRow(c, blk.b, row.token, row.head, o.data(), m, l);
  }
}

KVL_ISA_END
