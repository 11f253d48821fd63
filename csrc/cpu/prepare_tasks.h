// The tasks around the attention (gqa_cpu.cc's Run): queries and new K/V rows prepared (RMS norm,
// rotary, scale) and written to the cache, past rows copied into a separate present, and a
// sliding window cache's present written once the attention has read the past.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/gqa_types.h"
#include "cpu/gqa_call.h"
#include "cpu/isa_level.h"
#include "cpu/row_io.h"

KVL_ISA_BEGIN

// RMS norm (optional), rotary (optional) on one head vector x[0, H) in float32.
template <typename T>
void NormAndRotate(const Call<T>& c, float* x, const void* norm_weight, float eps, int64_t pos) {
  const int64_t H = c.s.head_size;
  if (norm_weight != nullptr) {
    double sum_sq = 0.0;
    for (int64_t d = 0; d < H; ++d) sum_sq += static_cast<double>(x[d]) * x[d];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum_sq / H) + eps);
    for (int64_t d = 0; d < H; ++d) x[d] = x[d] * inv * Get<T>(norm_weight, d);
  }
  if (c.s.rotary_dim == 0) return;
  const int64_t half = c.s.rotary_dim / 2;
  const int64_t row = pos * half;
  for (int64_t i = 0; i < half; ++i) {
    const float cs = Get<T>(c.buf.cos_cache, row + i);
    const float sn = Get<T>(c.buf.sin_cache, row + i);
    const int64_t i1 = c.s.interleaved ? 2 * i : i;
    const int64_t i2 = c.s.interleaved ? 2 * i + 1 : i + half;
    const float x1 = x[i1], x2 = x[i2];
    x[i1] = x1 * cs - x2 * sn;
    x[i2] = x2 * cs + x1 * sn;
  }
}

// Task (b, i): queries of token i of batch b -> q_scaled; its new K/V rows -> present.
template <typename T>
void PrepareToken(void* state, size_t task) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const int64_t b = static_cast<int64_t>(task) / s.seq_len;
  const int64_t i = static_cast<int64_t>(task) % s.seq_len;
  const int64_t H = s.head_size, N = s.num_heads, Nkv = s.kv_num_heads;
  const BatchGeometry geo = c.geo(b);
  const bool writes_kv = i < c.written_rows(geo);
  if (!s.is_first_prompt() && i >= geo.new_rows) return;  // beyond query_seqlens: unused
  const int64_t pos = s.rotary_dim ? RotaryPosition(s, geo, c.buf.position_ids, b, i) : 0;
  const int64_t q_pitch = s.packed_qkv ? (N + 2 * Nkv) * H : N * H;
  const int64_t q_row = (b * s.seq_len + i) * q_pitch;
  std::vector<float> x(static_cast<size_t>(H));
  for (int64_t h = 0; h < N; ++h) {
    ToFloatRow(static_cast<const T*>(c.buf.query) + q_row + h * H, H, x.data());
    NormAndRotate(c, x.data(), c.buf.q_norm_weight, s.q_norm_epsilon, pos);
    float* dst = c.q_scaled.data() + ((b * N + h) * s.seq_len + i) * c.head_pad;
    for (int64_t d = 0; d < H; ++d) dst[d] = x[d] * s.scale;
  }
  if (!writes_kv) return;
  const int64_t row = geo.past + i;  // < present capacity by validation
  const void* k_src = s.packed_qkv ? c.buf.query : c.buf.key;
  const void* v_src = s.packed_qkv ? c.buf.query : c.buf.value;
  const int64_t kv_row = s.packed_qkv ? q_row + N * H : (b * s.seq_len + i) * Nkv * H;
  const int64_t v_offset = s.packed_qkv ? Nkv * H : 0;
  for (int64_t h = 0; h < Nkv; ++h) {
    ToFloatRow(static_cast<const T*>(k_src) + kv_row + h * H, H, x.data());
    NormAndRotate(c, x.data(), c.buf.k_norm_weight, s.k_norm_epsilon, pos);
    uint8_t* kdst = c.row(c.buf.present_key, c.present_strides, b, h, row);
    uint8_t* vdst = c.row(c.buf.present_value, c.present_strides, b, h, row);
    float* kscale = nullptr;  // PER_TOKEN: where the rows' scales go
    float* vscale = nullptr;
    if (s.sliding_window_cache) {
      kdst = c.new_row(false, b, h, i);
      vdst = c.new_row(true, b, h, i);
    }
    if (s.per_token()) {
      kscale = s.sliding_window_cache ? c.new_row_scale(false, b, h, i)
                                      : c.present_row_scale(false, b, h, row);
      vscale = s.sliding_window_cache ? c.new_row_scale(true, b, h, i)
                                      : c.present_row_scale(true, b, h, row);
    }
    StoreRow(c, x.data(), 0, h, kdst, kscale);
    const T* vs = static_cast<const T*>(v_src) + kv_row + v_offset + h * H;
    if (s.quantized()) {
      ToFloatRow(vs, H, x.data());
      StoreRow(c, x.data(), 1, h, vdst, vscale);
    } else {
      std::memcpy(vdst, vs, static_cast<size_t>(H) * sizeof(T));
    }
  }
}

// Copies past rows [r0, r1) of (b, kv head h) into present, in the longest contiguous runs the
// strides allow: a head's rows (seq stride R, one row: head-major), or, when all heads of a row
// are adjacent (head stride R, seq stride Nkv*R: seq-major), a 1/Nkv share of every head's rows,
// so the Nkv tasks of batch b together copy each row range once. Rows are bytes: any storage
// (T, int8, packed int4) copies the same way.
template <typename T>
void CopyRows(const Call<T>& c, int64_t b, int64_t h, void* dst, const void* src, int64_t r0,
              int64_t r1) {
  const int64_t R = c.s.cache_row, Nkv = c.s.kv_num_heads;
  const size_t row_bytes = c.row_bytes;
  const KvStrides& ps = c.past_strides;
  const KvStrides& qs = c.present_strides;
  if (ps.seq == R && qs.seq == R) {
    std::memcpy(c.row(dst, qs, b, h, r0), c.row(src, ps, b, h, r0), (r1 - r0) * row_bytes);
  } else if (ps.head == R && qs.head == R && ps.seq == Nkv * R && qs.seq == Nkv * R) {
    const int64_t n = r1 - r0, lo = r0 + n * h / Nkv, hi = r0 + n * (h + 1) / Nkv;
    std::memcpy(c.row(dst, qs, b, 0, lo), c.row(src, ps, b, 0, lo), (hi - lo) * Nkv * row_bytes);
  } else {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(c.row(dst, qs, b, h, r), c.row(src, ps, b, h, r), row_bytes);
    }
  }
}

// Zeroes present rows [r0, capacity) of (b, kv head h) in `dst` (present_key or present_value).
template <typename T>
void ZeroPresentRows(const Call<T>& c, int64_t b, int64_t h, void* dst, int64_t r0) {
  for (int64_t r = r0; r < c.s.present_capacity; ++r) {
    std::memset(c.row(dst, c.present_strides, b, h, r), 0, c.row_bytes);
  }
}

// Task (b, kv head): copies the past rows [0, past) into a separate present and zeroes the rows
// no token of this call defines, so present never exposes uninitialized memory.
template <typename T>
void CopyPast(void* state, size_t task) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const auto [b, h, geo] = c.kv_task(task);
  for (int which = 0; which < 2; ++which) {
    const void* src = which ? c.buf.past_value : c.buf.past_key;
    void* dst = which ? c.buf.present_value : c.buf.present_key;
    CopyRows(c, b, h, dst, src, 0, geo.past);
    ZeroPresentRows(c, b, h, dst, geo.past + c.written_rows(geo));
    if (!s.per_token()) continue;
    // The scales of those rows; undefined rows get scale 0 (they read back 0).
    for (int64_t r = 0; r < geo.past; ++r) {
      *c.present_row_scale(which, b, h, r) =
          c.past_scale[which][c.past_scale_strides.Offset(b, h, r)];
    }
    for (int64_t r = geo.past + c.written_rows(geo); r < s.present_capacity; ++r) {
      *c.present_row_scale(which, b, h, r) = 0.0f;
    }
  }
}

// Task (b, kv head), sliding window cache, after the attention: present rows [0, L) take
// positions present_base .. total - 1 from the past rows and the new rows. With a shared buffer
// rows only move down (present_base >= cache_base), so ascending memmove is safe in place.
template <typename T>
void WriteSlidingPresent(void* state, size_t task) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const auto [b, h, geo] = c.kv_task(task);
  const int64_t rows = geo.total - geo.present_base;
  for (int which = 0; which < 2; ++which) {
    void* dst = which ? c.buf.present_value : c.buf.present_key;
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* src = c.key_row(b, h, geo.present_base + r, geo, which == 1);
      uint8_t* out = c.row(dst, c.present_strides, b, h, r);
      if (out != src) std::memmove(out, src, c.row_bytes);
    }
    // A shared buffer's rows past L keep their content, as in ORT.
    if (!c.buf.shared()) ZeroPresentRows(c, b, h, dst, rows);
    if (!s.per_token()) continue;
    // The scales move with their rows (ascending, as the rows: safe in place).
    for (int64_t r = 0; r < rows; ++r) {
      *c.present_row_scale(which, b, h, r) = c.row_scale(b, h, geo.present_base + r, geo, which);
    }
    for (int64_t r = rows; r < s.present_capacity && !c.buf.shared(); ++r) {
      *c.present_row_scale(which, b, h, r) = 0.0f;
    }
  }
}

KVL_ISA_END
