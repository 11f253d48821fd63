// Everything a task of one GroupQueryAttention call reads (Call<T>, built once per call by
// gqa_cpu.cc's Run), the tiling of the attention, and where a task index points.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/gqa_types.h"
#include "core/kv_strides.h"
#include "cpu/gqa_cpu.h"
#include "cpu/isa_level.h"
#include "cpu/simd.h"

KVL_ISA_BEGIN

// ---- tiling --------------------------------------------------------------------------------
constexpr int kTileKeys = 64;  // keys per tile: a multiple of 2*kVW for every vector width
// Query rows per micro-kernel call. AVX-512: 8 rows x 2 vectors = 16 accumulators of 32
// registers. AVX2: 6 rows x 2 vectors = 12 accumulators + 2 K (or V) vectors + 1 broadcast = 15
// of 16 registers; 4 rows left 8 accumulators, fewer than the FMAs in flight it takes to cover
// FMA latency (2 pipes x 4-5 cycles). Portable (SSE, no FMA): 4 rows.
constexpr int kRowBlock = kVW >= 16 ? 8 : (kVW == 8 ? 6 : 4);
constexpr int kDimStep = 2 * kVW;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A task over one (batch entry, kv head) of the cache: CopyPast, WriteSlidingPresent.
struct KvTask {
  int64_t b, h;
  BatchGeometry geo;
};

// What an attention task (or MergeSplits) covers, from its index without the key split: batch
// entry b, kv heads from g0 (group_heads of them), query positions [i0, i1).
struct TaskBlock {
  int64_t b, g0, i0, i1;
};

// Everything an attention or preparation task reads; built once per call.
template <typename T>
struct Call {
  const GqaShape& s;
  const GqaCpuBuffers& buf;
  KvStrides past_strides;     // in stored cache elements (KvStrides)
  KvStrides present_strides;
  size_t cache_elem;  // bytes of one stored cache element: sizeof(T), or 1 when quantized
  size_t row_bytes;   // bytes of one cache row: cache_row * cache_elem
  // Quantized cache, per cache (0: key, 1: value): the scales, their inverses (what quantizing
  // multiplies by), and the scale pitch of a kv head (head_size per channel, 0 per tensor).
  const float* scale[2];
  const float* inv_scale[2];
  int64_t scale_pitch[2];
  int64_t head_pad;  // H rounded up to kDimStep: row pitch of the float32 scratch
  std::vector<float>& q_scaled;  // (B, N, S, head_pad): normed, rotated, scaled queries

  // Attention task grid: (b, head group, q block, key split).
  int64_t q_block;     // query positions per task
  int64_t num_q_blocks;
  int64_t group_heads;  // KV heads per task: all of them when a token's heads are adjacent
  int64_t num_groups;   // kv_num_heads / group_heads
  int64_t row_block;    // micro-kernel rows: 1 to 4 (a head's rows at decode) or kRowBlock
  int64_t num_splits;   // key splits per (b, head group, q block)
  int64_t split_keys;   // keys per split (multiple of kTileKeys)
  // Split partials: (task, split, row, head_pad) for o; (task, split, row) for m and l.
  std::vector<float>* part_o;
  std::vector<float>* part_m;
  std::vector<float>* part_l;

  // A sliding window cache keeps this call's new K/V rows apart, (B, Nkv, S) rows of the cache's
  // storage, until the attention has read the past rows that the shift of present overwrites.
  std::vector<uint8_t>* new_k;
  std::vector<uint8_t>* new_v;

  // PER_TOKEN (0: key, 1: value): the scale caches, one float32 per cache row at
  // MakeKvScaleStrides(layout, Nkv, capacity), and a sliding window cache's new rows' scales,
  // (B, Nkv, S), kept apart like new_k / new_v. qmax: the largest code (127, 7 or 448).
  const float* past_scale[2] = {nullptr, nullptr};
  float* present_scale[2] = {nullptr, nullptr};
  KvStrides past_scale_strides{};
  KvStrides present_scale_strides{};
  std::vector<float>* new_scale[2] = {nullptr, nullptr};
  float qmax = 0.0f;

  // Rows of one KV head in a task, padded to the micro-kernel block; heads' rows follow.
  int64_t head_rows_pad() const { return RoundUp(q_block * s.group_size(), row_block); }
  int64_t rows_per_task() const { return group_heads * head_rows_pad(); }
  BatchGeometry geo(int64_t b) const {
    return GetBatchGeometry(s, buf.seqlens_k[b], s.has_query_seqlens ? buf.query_seqlens[b] : 0);
  }
  // New rows written to the cache: a first prompt writes its padding rows too (as ORT does).
  int64_t written_rows(const BatchGeometry& g) const {
    return s.is_first_prompt() ? s.seq_len : g.new_rows;
  }
  // Cache row (b, h, s) of a buffer with strides `st`, as bytes.
  uint8_t* row(void* base, const KvStrides& st, int64_t b, int64_t h, int64_t r) const {
    return static_cast<uint8_t*>(base) + st.Offset(b, h, r) * static_cast<int64_t>(cache_elem);
  }
  const uint8_t* row(const void* base, const KvStrides& st, int64_t b, int64_t h, int64_t r) const {
    return row(const_cast<void*>(base), st, b, h, r);
  }
  // Row i of (b, kv head h) among a sliding window cache's new rows.
  uint8_t* new_row(bool value, int64_t b, int64_t h, int64_t i) const {
    std::vector<uint8_t>& dst = value ? *new_v : *new_k;
    const int64_t index = (b * s.kv_num_heads + h) * s.seq_len + i;
    return dst.data() + index * static_cast<int64_t>(row_bytes);
  }
  // Scale of row i of (b, kv head h) among a sliding window cache's new rows (PER_TOKEN).
  float* new_row_scale(bool value, int64_t b, int64_t h, int64_t i) const {
    return new_scale[value]->data() + (b * s.kv_num_heads + h) * s.seq_len + i;
  }
  // Scale of present row r of (b, kv head h) (PER_TOKEN).
  float* present_row_scale(bool value, int64_t b, int64_t h, int64_t r) const {
    return present_scale[value] + present_scale_strides.Offset(b, h, r);
  }
  // PER_TOKEN scale of the key/value row of absolute position `pos`, as key_row finds the row;
  // 0 (unused) for other caches.
  float row_scale(int64_t b, int64_t h, int64_t pos, const BatchGeometry& g, bool value) const {
    if (!s.per_token()) return 0.0f;
    if (s.sliding_window_cache) {
      if (pos >= g.past) return *new_row_scale(value, b, h, pos - g.past);
      return past_scale[value][past_scale_strides.Offset(b, h, pos - g.cache_base)];
    }
    return *present_row_scale(value, b, h, pos);
  }
  // Key/value row of absolute position `pos` (valid for this call's attention).
  const uint8_t* key_row(int64_t b, int64_t h, int64_t pos, const BatchGeometry& g,
                         bool value) const {
    if (s.sliding_window_cache) {
      if (pos >= g.past) return new_row(value, b, h, pos - g.past);
      return row(value ? buf.past_value : buf.past_key, past_strides, b, h, pos - g.cache_base);
    }
    return row(value ? buf.present_value : buf.present_key, present_strides, b, h, pos);
  }
  KvTask kv_task(size_t task) const {
    const int64_t b = static_cast<int64_t>(task) / s.kv_num_heads;
    return KvTask{b, static_cast<int64_t>(task) % s.kv_num_heads, geo(b)};
  }
  TaskBlock task_block(int64_t base) const {
    const int64_t qb = base % num_q_blocks;
    const int64_t g0 = (base / num_q_blocks) % num_groups * group_heads;
    const int64_t b = base / (num_q_blocks * num_groups);
    const int64_t i0 = qb * q_block;
    return TaskBlock{b, g0, i0, std::min(s.seq_len, i0 + q_block)};
  }
};

KVL_ISA_END
