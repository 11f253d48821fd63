#include "cpu/gqa_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/check_inputs.h"
#include "core/dtype.h"
#include "core/kv_strides.h"
#include "core/softcap.h"

#if KVL_ISA_LEVEL != 0
#include <immintrin.h>
#endif

// This file is compiled once per CPU level (CMakeLists.txt) with KVL_ISA_LEVEL = 0 (portable), 1
// (AVX2 + FMA + F16C) or 2 (AVX-512), and KVL_ISA_NS naming the namespace of that copy. The target
// ISA is switched on by a pragma AFTER the includes, not by -m flags: functions defined from here
// on get the level's instructions, while the inline functions and templates of the headers
// (std::vector's members, dtype.h, softcap.h) keep the baseline ISA. Those are emitted in every
// copy under the same names and the linker keeps one of them; compiled with -mavx512f, the one kept
// could be an AVX-512 copy called from the portable level. Everything defined below is in
// KVL_ISA_NS (and mostly an anonymous namespace), so no two levels share a symbol.
#if !defined(KVL_ISA_LEVEL) || !defined(KVL_ISA_NS)
#error "gqa_cpu.cc needs KVL_ISA_LEVEL and KVL_ISA_NS (see CMakeLists.txt)"
#endif
// (#pragma GCC target does not expand macros: the strings are spelled out per compiler.)
#if KVL_ISA_LEVEL == 1 && defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx,avx2,fma,f16c"))), apply_to = function)
#elif KVL_ISA_LEVEL == 1
#pragma GCC push_options
#pragma GCC target("avx,avx2,fma,f16c")
#elif KVL_ISA_LEVEL == 2 && defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))),         \
    apply_to = function)
#elif KVL_ISA_LEVEL == 2
#pragma GCC push_options
#pragma GCC target("avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#elif KVL_ISA_LEVEL != 0
#error "KVL_ISA_LEVEL must be 0, 1 or 2"
#endif

namespace kvl {
namespace KVL_ISA_NS {
namespace {

// ---- float32 vectors through GCC/Clang vector extensions: the widest the level has -----------
#if KVL_ISA_LEVEL == 2
constexpr int kVW = 16;
#elif KVL_ISA_LEVEL == 1
constexpr int kVW = 8;
#else
constexpr int kVW = 4;
#endif
typedef float VecF __attribute__((vector_size(kVW * sizeof(float))));
typedef int32_t VecI __attribute__((vector_size(kVW * sizeof(int32_t))));

inline VecF Load(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }
// x in every lane, as one broadcast (a load-port vbroadcastss from memory). Not VecF{} + x: that
// is a scalar add then a shuffle (0 + x is not x for x = -0), both on the FP ports the FMAs of
// the micro-kernels need (AVX2 prefill: one add per broadcast, one per 2 FMAs).
inline VecF Splat(float x) {
#if KVL_ISA_LEVEL == 2
  return reinterpret_cast<VecF>(_mm512_set1_ps(x));
#elif KVL_ISA_LEVEL == 1
  return reinterpret_cast<VecF>(_mm256_set1_ps(x));
#else
  return VecF{x, x, x, x};
#endif
}

// Sum of a vector's lanes by halving shuffles (log2(kVW) vector adds, not kVW scalar ones).
inline float HorizontalSum(VecF v) {
#if KVL_ISA_LEVEL == 2
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#elif KVL_ISA_LEVEL == 1
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#else
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
#endif
  return v[0];
}

// The lane sums of 4 vectors, out[i * stride] = sum of v_i's lanes: one halving tree over all
// four (3 or 4 shuffle-add levels, the first two merging vectors), not 4 separate ones (a
// quarter of the shuffles, which compete with the FMAs for a port).
inline void HorizontalSum4(VecF a, VecF b, VecF c, VecF d, float* out, int64_t stride) {
#if KVL_ISA_LEVEL == 2
  const VecF ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                          29, 30, 31);
  const VecF cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                          29, 30, 31);
  VecF x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                   27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  constexpr int kStep = 4;
#elif KVL_ISA_LEVEL == 1
  const VecF ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  const VecF cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  VecF x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  x += __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6);
  constexpr int kStep = 2;
#else
  const VecF ab =
      __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
  const VecF cd =
      __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
  const VecF x =
      __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
  constexpr int kStep = 1;
#endif
  for (int i = 0; i < 4; ++i) out[i * stride] = x[i * kStep];
}

// exp(x) for a vector, relative error ~2e-7; inputs below -87 (and -inf) give exactly 0.
inline VecF VecExp(VecF x) {
  const VecF lo = Splat(-87.0f), hi = Splat(88.0f);
  const auto underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // x = n*ln2 + r, |r| <= ln2/2; the magic constant rounds to nearest.
  const VecF magic = Splat(12582912.0f);
  const VecF n = (x * 1.44269504088896341f + magic) - magic;
  VecF r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  VecF p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VecI bits = (__builtin_convertvector(n, VecI) + 127) << 23;
  VecF scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const VecF result = p * scale;
  return underflow ? Splat(0.0f) : result;
}

// core/softcap.h's rule (c * tanh(x / c) at float rounding for every finite c), on a vector;
// the exponential form is computed only when a lane needs it.
inline VecF VecSoftcap(VecF x, float c, float inv_c) {
  const VecF y = inv_c != 0.0f ? x * inv_c : x / Splat(c);
  const VecF z = y * y;
  VecF p = Splat(kTanhP4);
  p = p * z + kTanhP3;
  p = p * z + kTanhP2;
  p = p * z + kTanhP1;
  p = p * z + kTanhP0;
  const VecF small = y + y * z * p;
  const auto use_big = z >= kSoftcapPolyLimit * kSoftcapPolyLimit;  // false for NaN: polynomial
  bool any_big = false;
  for (int l = 0; l < kVW; ++l) any_big |= use_big[l] != 0;
  if (!any_big) return small * c;
  const auto neg = y < 0.0f;
  const VecF ay = neg ? -y : y;
  const VecF big = 1.0f - 2.0f / (VecExp(ay + ay) + 1.0f);
  const VecF t = use_big ? (neg ? -big : big) : small;
  return t * c;
}

// ---- tiling --------------------------------------------------------------------------------
constexpr int kTileKeys = 64;  // keys per tile: a multiple of 2*kVW for every vector width
// Query rows per micro-kernel call. AVX-512: 8 rows x 2 vectors = 16 accumulators of 32
// registers. AVX2: 6 rows x 2 vectors = 12 accumulators + 2 K (or V) vectors + 1 broadcast = 15
// of 16 registers; 4 rows left 8 accumulators, fewer than the FMAs in flight it takes to cover
// FMA latency (2 pipes x 4-5 cycles). Portable (SSE, no FMA): 4 rows.
constexpr int kRowBlock = kVW >= 16 ? 8 : (kVW == 8 ? 6 : 4);
constexpr int kDimStep = 2 * kVW;

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// float8e4m3fn byte -> float32, as a table of dtype.h's decoding (1 KB, stays in L1): the
// dequantization loop is then a load (a gather where the level has one) and a multiply.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) value[i] = Fp8E4M3ToFloat(static_cast<uint8_t>(i));
  }
};
const Fp8Table kFp8Table;

template <typename T>
inline float Get(const void* base, int64_t index) {
  return ToFloat(static_cast<const T*>(base)[index]);
}

// dtype.h's HalfToFloat without branches, so that a loop of it vectorizes (SSE2 at the portable
// level): the exponent is rebiased in place; inf/nan get a second rebias to 255; a zero or
// subnormal h is rebuilt as 2^-14 * (1 + m/1024) - 2^-14 = m * 2^-24, exact, every operand and
// result a float32 normal (no denormal slow path, unaffected by FTZ/DAZ).
inline float HalfToFloatBranchFree(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = bits & 0x0f800000u;
  const uint32_t inf_nan = 0u - static_cast<uint32_t>(exp == 0x0f800000u);  // all ones or 0
  const uint32_t tiny = 0u - static_cast<uint32_t>(exp == 0);
  const uint32_t normal = bits + (112u << 23) + (inf_nan & (112u << 23));
  const uint32_t sub = FloatToBits(BitsToFloat(bits + (113u << 23)) - BitsToFloat(113u << 23));
  return BitsToFloat((sub & tiny) | (normal & ~tiny) | sign);
}

// x[0, n) = src[0, n) as float32, exact: the bulk conversion of every T row (cache rows, queries,
// new K/V). float16 at the AVX2 and AVX-512 levels: F16C's vcvtph2ps, 8 or 16 per instruction
// (which quiets a signaling NaN that HalfToFloat keeps: every value converted here is an operand
// of arithmetic, which quiets it anyway, so results are the same bits). float16 at the portable
// level and in tails: HalfToFloatBranchFree; bfloat16: a 16-bit shift (both vectorized by the
// compiler at each level). A loop of HalfToFloat's branches does not vectorize: it read a
// float16 cache ~3x slower than this (32/8/128 seq-major decode, L = 4096, one thread).
template <typename T>
inline void ToFloatRow(const T* src, int64_t n, float* x) {
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(x, src, static_cast<size_t>(n) * sizeof(float));
  } else if constexpr (std::is_same<T, BFloat16>::value) {
    for (int64_t d = 0; d < n; ++d) x[d] = BFloat16ToFloat(src[d].bits);
  } else {
    int64_t d = 0;
#if KVL_ISA_LEVEL == 2
    for (; d + 16 <= n; d += 16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d));
      _mm512_storeu_ps(x + d, _mm512_cvtph_ps(h));
    }
#elif KVL_ISA_LEVEL == 1
    for (; d + 8 <= n; d += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      _mm256_storeu_ps(x + d, _mm256_cvtph_ps(h));
    }
#endif
    for (; d < n; ++d) x[d] = HalfToFloatBranchFree(src[d].bits);
  }
}

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
};

// One cache row -> float32 x[0, H): the T values, or the codes of a quantized cache times their
// scales (`which`: 0 key, 1 value; h: the kv head; token_scale: the row's scale, PER_TOKEN). The
// one place a cache row becomes float32 values, except int8 rows at token generation, which
// Int8Rows reads in place. T rows convert through ToFloatRow; each code loop is a plain
// element-wise map (int8 / fp8 decode, times one or H scales), which the compiler vectorizes at
// each CPU level.
template <typename T>
inline void LoadRow(const Call<T>& c, const uint8_t* row, int which, int64_t h, float token_scale,
                    float* x) {
  const int64_t H = c.s.head_size;
  if (!c.s.quantized()) {
    ToFloatRow(reinterpret_cast<const T*>(row), H, x);
    return;
  }
  const bool per_token = c.s.per_token();
  const float* sc = per_token ? &token_scale : c.scale[which] + h * c.scale_pitch[which];
  const bool per_channel = !per_token && c.scale_pitch[which] != 0;
  if (c.s.fp8_cache()) {
    const float* fp8 = kFp8Table.value;
    if (per_channel) {
      for (int64_t d = 0; d < H; ++d) x[d] = fp8[row[d]] * sc[d];
    } else {
      const float s0 = sc[0];
      for (int64_t d = 0; d < H; ++d) x[d] = fp8[row[d]] * s0;
    }
    return;
  }
  if (c.s.kv_bits == 8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    if (per_channel) {
      for (int64_t d = 0; d < H; ++d) x[d] = static_cast<float>(q[d]) * sc[d];
    } else {
      const float s0 = sc[0];
      for (int64_t d = 0; d < H; ++d) x[d] = static_cast<float>(q[d]) * s0;
    }
    return;
  }
  // int4: code + 8 per nibble, even channel low.
  for (int64_t i = 0; i < H / 2; ++i) {
    const int lo = (row[i] & 0x0f) - 8, hi = (row[i] >> 4) - 8;
    x[2 * i] = static_cast<float>(lo) * sc[per_channel ? 2 * i : 0];
    x[2 * i + 1] = static_cast<float>(hi) * sc[per_channel ? 2 * i + 1 : 0];
  }
  if (H % 2 != 0) {
    x[H - 1] = static_cast<float>((row[H / 2] & 0x0f) - 8) * sc[per_channel ? H - 1 : 0];
  }
}

// float32 x[0, H) -> one cache row: T values, or codes of a quantized cache (dtype.h's rule, on
// x rounded to T first, in place: ORT quantizes the rotated K and V it holds in T). PER_TOKEN:
// the row's scale (dtype.h's PerTokenScale) goes to *token_scale; a non-finite row stores code 0
// everywhere (scale NaN).
template <typename T>
inline void StoreRow(const Call<T>& c, float* x, int which, int64_t h, uint8_t* row,
                     float* token_scale) {
  const int64_t H = c.s.head_size;
  if (!c.s.quantized()) {
    T* r = reinterpret_cast<T*>(row);
    for (int64_t d = 0; d < H; ++d) r[d] = FromFloat<T>(x[d]);
    return;
  }
  for (int64_t d = 0; d < H; ++d) x[d] = ToFloat(FromFloat<T>(x[d]));
  const float* inv = c.inv_scale[which] + h * c.scale_pitch[which];
  int64_t step = c.scale_pitch[which] != 0 ? 1 : 0;
  float token_inv = 0.0f;
  if (c.s.per_token()) {
    *token_scale = PerTokenScale(x, H, c.qmax, &token_inv);
    if (*token_scale != *token_scale) std::fill(x, x + H, 0.0f);  // codes 0, read back NaN
    inv = &token_inv;
    step = 0;
  }
  if (c.s.fp8_cache()) {
    for (int64_t d = 0; d < H; ++d) row[d] = QuantizeFp8(x[d], inv[d * step]);
    return;
  }
  if (c.s.kv_bits == 8) {
    int8_t* q = reinterpret_cast<int8_t*>(row);
    for (int64_t d = 0; d < H; ++d) q[d] = QuantizeInt8(x[d], inv[d * step]);
    return;
  }
  for (int64_t i = 0; i < (H + 1) / 2; ++i) {
    const uint8_t lo = Int4Nibble(x[2 * i], inv[2 * i * step]);
    const int64_t d = 2 * i + 1;
    const uint8_t hi = d < H ? Int4Nibble(x[d], inv[d * step]) : 8;  // odd H: code 0
    row[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

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
  const int64_t b = static_cast<int64_t>(task) / s.seq_len, i = static_cast<int64_t>(task) % s.seq_len;
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
  const int64_t b = static_cast<int64_t>(task) / s.kv_num_heads;
  const int64_t h = static_cast<int64_t>(task) % s.kv_num_heads;
  const BatchGeometry geo = c.geo(b);
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

// Task (b, kv head), sliding window cache, after the attention: present rows [0, L) take
// positions present_base .. total - 1 from the past rows and the new rows. With a shared buffer
// rows only move down (present_base >= cache_base), so ascending memmove is safe in place.
template <typename T>
void WriteSlidingPresent(void* state, size_t task) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const int64_t b = static_cast<int64_t>(task) / s.kv_num_heads;
  const int64_t h = static_cast<int64_t>(task) % s.kv_num_heads;
  const BatchGeometry geo = c.geo(b);
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

#if KVL_ISA_LEVEL >= 1
typedef float Vec8 __attribute__((vector_size(8 * sizeof(float))));
// 8 T values as float32, exact (ToFloatRow's conversions, one vector).
template <typename T>
inline Vec8 LoadVec8(const T* p) {
  if constexpr (std::is_same<T, float>::value) {
    Vec8 v;
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same<T, Half>::value) {
      return reinterpret_cast<Vec8>(_mm256_cvtph_ps(h));
    } else {
      return reinterpret_cast<Vec8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}
#endif

// kt[d][i] = rows[i][d] for 8 T rows, d in [0, H), H a multiple of 8: 8 x 8 blocks converted to
// float32 and transposed in registers (AVX2 and AVX-512 levels). The scalar loop it replaces
// stored one float per instruction, 256 bytes apart (~8% of a seq-major S=2048 32/8/128 prefill).
template <typename T>
inline bool TransposeKRows8(const T* const* rows, int64_t H, float* kt) {
#if KVL_ISA_LEVEL >= 1
  if (H % 8 != 0) return false;
  for (int64_t d = 0; d < H; d += 8) {
    Vec8 r[8];
    // Unrolled, so r, t and u live in registers (a loop kept them in a stack array).
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) r[i] = LoadVec8(rows[i] + d);
    Vec8 t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // pairs of rows interleaved: (r0 r1), (r2 r3), ...
      t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
      t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // quads of rows: rows 0-3 (h = 0) and 4-7 (h = 1)
      const Vec8 a0 = t[4 * h], a1 = t[4 * h + 1], b0 = t[4 * h + 2], b1 = t[4 * h + 3];
      u[4 * h + 0] = __builtin_shufflevector(a0, b0, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 1] = __builtin_shufflevector(a0, b0, 2, 3, 10, 11, 6, 7, 14, 15);
      u[4 * h + 2] = __builtin_shufflevector(a1, b1, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * h + 3] = __builtin_shufflevector(a1, b1, 2, 3, 10, 11, 6, 7, 14, 15);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {  // u[k]: dims k and k + 4 of rows 0-3; u[4 + k]: rows 4-7
      const Vec8 lo = __builtin_shufflevector(u[k], u[4 + k], 0, 1, 2, 3, 8, 9, 10, 11);
      const Vec8 hi = __builtin_shufflevector(u[k], u[4 + k], 4, 5, 6, 7, 12, 13, 14, 15);
      std::memcpy(kt + (d + k) * kTileKeys, &lo, sizeof lo);
      std::memcpy(kt + (d + k + 4) * kTileKeys, &hi, sizeof hi);
    }
  }
  return true;
#else
  (void)rows, (void)H, (void)kt;
  return false;
#endif
}

// scores[r][j] = q_r . k_j for RB query rows and kTileKeys keys (k transposed: kt[d][j]).
template <int RB>
inline void ScoreBlock(const float* const* q, const float* kt, int64_t H, float* scores) {
  for (int j0 = 0; j0 < kTileKeys; j0 += 2 * kVW) {
    VecF acc[RB][2] = {};
    for (int64_t d = 0; d < H; ++d) {
      const VecF k0 = Load(kt + d * kTileKeys + j0);
      const VecF k1 = Load(kt + d * kTileKeys + j0 + kVW);
      for (int r = 0; r < RB; ++r) {
        const VecF qd = Splat(q[r][d]);
        acc[r][0] += qd * k0;
        acc[r][1] += qd * k1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      Store(scores + r * kTileKeys + j0, acc[r][0]);
      Store(scores + r * kTileKeys + j0 + kVW, acc[r][1]);
    }
  }
}

// The K or V rows of a tile as float32 vectors, for the dot-product micro-kernels: Get(j, d) is
// elements [d, d + kVW) of row j, d < head_pad (float32 rows are zero padded to head_pad; code
// rows are read in place only where H = head_pad, so no load passes a row's end).
// FloatRows: float32 rows (a float32 cache in place, or rows dequantized into the scratch).
struct FloatRows {
  const float* const* rows;
  static constexpr int64_t kElemBytes = sizeof(float);
  VecF Get(int j, int64_t d) const { return Load(rows[j] + d); }
  const void* Row(int j) const { return rows[j]; }
};
// Int8Rows: an int8 cache's codes read in place and widened in registers (vpmovsxbd + vcvtdq2ps at
// AVX2/AVX-512), exact. The scales are applied outside the micro-kernels (AttentionTask): folded
// into the queries for K, into the weights (PER_TOKEN) or the output (per channel / tensor) for V.
struct Int8Rows {
  const int8_t* const* rows;
  static constexpr int64_t kElemBytes = 1;
  // (Intrinsics: GCC 12 turns __builtin_convertvector of an int8 vector into kVW scalar
  // conversions, which made this path 2.5x slower than dequantizing into the scratch.)
  VecF Get(int j, int64_t d) const {
    const int8_t* p = rows[j] + d;
#if KVL_ISA_LEVEL == 2
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<VecF>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
#elif KVL_ISA_LEVEL == 1
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return reinterpret_cast<VecF>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
#else
    return VecF{static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                static_cast<float>(p[3])};
#endif
  }
  const void* Row(int j) const { return rows[j]; }
};

// The same scores by dot products over key rows (zero padded queries): cheaper than transposing
// the tile when a head has a single row block (token generation).
// Each step also prefetches into L1 the key row 4 ahead and the value row the PV pass will read:
// the tile's rows sit in L2/L3, and in seq-major order they are Nkv*H apart, so the hardware L1
// prefetchers do not bring them (shared-cache decode, AVX2: +10 to 50%, both layouts).
template <int RB, typename KS, typename VS>
inline void ScoreDot(const float* const* q, const KS& k, const VS& v, int tile, int64_t head_pad,
                     float* scores) {
  const int64_t kb = head_pad * KS::kElemBytes, vb = head_pad * VS::kElemBytes;
  for (int j = 0; j < tile; ++j) {
    for (int64_t o = 0; o < vb; o += 64) {
      __builtin_prefetch(static_cast<const char*>(v.Row(j)) + o, 0, 3);
    }
    if (j + 4 < tile) {
      for (int64_t o = 0; o < kb; o += 64) {
        __builtin_prefetch(static_cast<const char*>(k.Row(j + 4)) + o, 0, 3);
      }
    }
    VecF acc[RB] = {};
    for (int64_t d = 0; d < head_pad; d += kVW) {
      const VecF kv = k.Get(j, d);
      for (int r = 0; r < RB; ++r) acc[r] += Load(q[r] + d) * kv;
    }
    int r = 0;
    for (; r + 4 <= RB; r += 4) {
      HorizontalSum4(acc[r], acc[r + 1], acc[r + 2], acc[r + 3], scores + r * kTileKeys + j,
                     kTileKeys);
    }
    if constexpr (RB % 4 == 1) {
      scores[r * kTileKeys + j] = HorizontalSum(acc[r]);
    } else if constexpr (RB % 4 != 0) {  // 2 or 3 rows: one tree, zeros for the missing
      const VecF zero = Splat(0.0f);
      float sums[4];
      HorizontalSum4(acc[r], acc[r + 1], RB % 4 == 3 ? acc[(r + 2) % RB] : zero, zero, sums, 1);
      for (int i = 0; i < RB % 4; ++i) scores[(r + i) * kTileKeys + j] = sums[i];
    }
  }
  for (int r = 0; r < RB; ++r) {
    std::fill(scores + r * kTileKeys + tile, scores + (r + 1) * kTileKeys, 0.0f);
  }
}

// o[r][:] += sum_j p[r][j] * v_j for RB rows; v rows are head_pad long.
template <int RB, typename VS>
inline void AccumulateBlock(const float* p, const VS& v, int tile, int64_t head_pad,
                            float* const* o) {
  for (int64_t d0 = 0; d0 < head_pad; d0 += kDimStep) {
    VecF acc[RB][2];
    for (int r = 0; r < RB; ++r) {
      acc[r][0] = Load(o[r] + d0);
      acc[r][1] = Load(o[r] + d0 + kVW);
    }
    for (int j = 0; j < tile; ++j) {
      const VecF v0 = v.Get(j, d0);
      const VecF v1 = v.Get(j, d0 + kVW);
      for (int r = 0; r < RB; ++r) {
        const VecF pj = Splat(p[r * kTileKeys + j]);
        acc[r][0] += pj * v0;
        acc[r][1] += pj * v1;
      }
    }
    for (int r = 0; r < RB; ++r) {
      Store(o[r] + d0, acc[r][0]);
      Store(o[r] + d0 + kVW, acc[r][1]);
    }
  }
}

// Per-thread scratch, reused across calls (ORT's pool threads persist).
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

// o[r][:] += sum_{j in [lo[r], hi[r])} p[r][j] * v_j: AccumulateBlock restricted to each row's
// own columns.
template <int RB, typename VS>
void AccumulateRanges(const float* p, const VS& v, const int* lo, const int* hi,
                      int64_t head_pad, float* const* o) {
  for (int r = 0; r < RB; ++r) {
    for (int j = lo[r]; j < hi[r]; ++j) {
      const VecF pj = Splat(p[r * kTileKeys + j]);
      for (int64_t d = 0; d < head_pad; d += kVW) {
        Store(o[r] + d, Load(o[r] + d) + pj * v.Get(j, d));
      }
    }
  }
}

// dst[d] = src[d] x kv head h's static scale of element d, d < H (`which`: 0 key, 1 value; per
// channel H scales a head, per tensor one): an int8 cache read in place (Int8Rows) takes its K
// scales in the queries and its V scales in the output.
template <typename T>
inline void TimesHeadScales(const Call<T>& c, int which, int64_t h, const float* src, float* dst) {
  const float* sc = c.scale[which] + h * c.scale_pitch[which];
  const int64_t step = c.scale_pitch[which] != 0 ? 1 : 0;
  for (int64_t d = 0; d < c.s.head_size; ++d) dst[d] = src[d] * sc[d * step];
}

// K and V rows come from ks / vs (dot_scores; a transposed tile reads t.kt). With Int8Rows the
// queries are t.qk_rows (K scales folded in), PER_TOKEN scores are multiplied by the keys' scales
// and weights by the values' scales (t.k_scale, t.v_scale); per-channel V scales are applied to
// the output at the task's end.
template <typename T, int RB, typename KS, typename VS>
void AttentionRows(const Call<T>& c, Scratch& t, int64_t b, int64_t r_begin, int64_t r_end,
                   int64_t k0, int tile, bool dot_scores, const KS& ks, const VS& vs) {
  constexpr bool codes = std::is_same<VS, Int8Rows>::value;
  const bool token_scales = codes && c.s.per_token();
  const GqaShape& s = c.s;
  const int64_t H = s.head_size, hp = c.head_pad;
  const T* bias = static_cast<const T*>(c.buf.attention_bias);
  const float softcap = s.softcap;
  const float inv_softcap = softcap > 0.0f ? SoftcapInverse(softcap) : 0.0f;
  // Score columns that can hold a key: short tiles (token generation over many heads) skip the
  // softmax work on the rest.
  const int width = static_cast<int>(RoundUp(tile, kVW));
  for (int64_t r0 = r_begin; r0 < r_end; r0 += RB) {
    bool any = false;
    for (int r = 0; r < RB; ++r) any |= t.lo[r0 + r] < k0 + tile && t.hi[r0 + r] > k0;
    if (!any) continue;
    if (dot_scores) {
      const float* const* q = codes ? t.qk_rows.data() + r0 : t.q_rows.data() + r0;
      ScoreDot<RB>(q, ks, vs, tile, hp, t.scores.data());
      if (token_scales) {
        for (int r = 0; r < RB; ++r) {
          float* sc = t.scores.data() + r * kTileKeys;
          const float* ks_tile = t.k_scale.data();
          for (int j = 0; j < kTileKeys; j += kVW) Store(sc + j, Load(sc + j) * Load(ks_tile + j));
        }
      }
    } else {
      ScoreBlock<RB>(t.q_rows.data() + r0, t.kt.data(), H, t.scores.data());
    }
    // Each row's keys in this tile, [jlo, jhi); a block where some row with keys leaves out a
    // column is "partial" (causal diagonal, window edges, rows whose keys lie elsewhere). Rows
    // without keys (padding) are not written: they do not count.
    int range_lo[RB], range_hi[RB];
    bool partial = false;
    for (int r = 0; r < RB; ++r) {
      float* sc = t.scores.data() + r * kTileKeys;
      const int64_t row = r0 + r;
      const int64_t jlo = std::max<int64_t>(t.lo[row] - k0, 0);
      const int64_t jhi = std::min<int64_t>(t.hi[row] - k0, tile);
      range_lo[r] = static_cast<int>(jlo);
      range_hi[r] = static_cast<int>(std::max(jlo, jhi));
      partial |= t.lo[row] < t.hi[row] && (jlo > 0 || jhi < tile);
      if (jlo >= jhi) {
        std::fill(sc, sc + kTileKeys, 0.0f);
        continue;
      }
      if (softcap > 0.0f) {
        for (int j = 0; j < width; j += kVW) {
          Store(sc + j, VecSoftcap(Load(sc + j), softcap, inv_softcap));
        }
      }
      if (bias != nullptr) {
        const int64_t bb = s.bias_batch == 1 ? 0 : b;
        const int64_t bh = s.bias_heads == 1 ? 0 : t.head[row];
        const T* brow = bias + ((bb * s.bias_heads + bh) * s.seq_len + t.token[row]) * s.bias_total;
        for (int64_t j = jlo; j < jhi; ++j) sc[j] += ToFloat(brow[k0 + j]);
      }
      for (int64_t j = 0; j < jlo; ++j) sc[j] = -std::numeric_limits<float>::infinity();
      for (int64_t j = jhi; j < width; ++j) sc[j] = -std::numeric_limits<float>::infinity();
      // The running max skips NaN (x > NaN is false, and NaN never wins): a NaN score keeps
      // the max of the others, so exp(NaN - m) puts NaN into l and o below (IEEE propagation,
      // as ORT's softmax). A NaN first lane used to become the tile max and drop the tile.
      VecF vmax = Splat(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < width; j += kVW) {
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
        continue;
      }
      VecF sum = Splat(0.0f);
      for (int j = 0; j < width; j += kVW) {
        const VecF e = VecExp(Load(sc + j) - m_new);
        Store(sc + j, e);
        sum += e;
      }
      float tile_sum = 0.0f;
      for (int k = 0; k < kVW; ++k) tile_sum += sum[k];
      const float alpha = m_old == -std::numeric_limits<float>::infinity()
                              ? 0.0f
                              : VecExp(Splat(m_old - m_new))[0];
      t.l[row] = t.l[row] * alpha + tile_sum;
      t.m[row] = m_new;
      if (alpha != 1.0f) {
        float* o = t.o_rows[row];
        for (int64_t d = 0; d < hp; d += kVW) Store(o + d, Load(o + d) * alpha);
      }
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
    if (partial && TileValuesNonFinite(t, vs, tile, hp)) {
      AccumulateRanges<RB>(t.scores.data(), vs, range_lo, range_hi, hp, t.o_rows.data() + r0);
    } else {
      AccumulateBlock<RB>(t.scores.data(), vs, tile, hp, t.o_rows.data() + r0);
    }
  }
}

template <typename T>
void AttentionTask(void* state, size_t task_index) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const int64_t H = s.head_size, N = s.num_heads, G = s.group_size();
  const int64_t split = static_cast<int64_t>(task_index) % c.num_splits;
  const int64_t base = static_cast<int64_t>(task_index) / c.num_splits;
  const int64_t qb = base % c.num_q_blocks;
  const int64_t g0 = (base / c.num_q_blocks) % c.num_groups * c.group_heads;
  const int64_t b = base / (c.num_q_blocks * c.num_groups);
  const int64_t i0 = qb * c.q_block, i1 = std::min(s.seq_len, i0 + c.q_block);
  const int64_t head_rows = c.head_rows_pad();
  const int64_t rows_pad = c.group_heads * head_rows;
  const int64_t hp = c.head_pad;
  // One row block per head (token generation): dot products over key rows; else a transposed
  // K tile shared by the head's row blocks.
  const bool dot_scores = head_rows == c.row_block;
  // There an int8 cache is read in place (Int8Rows) when its rows fill head_pad (no load past a
  // row's end); other quantized caches are dequantized into the scratch a tile at a time (LoadRow).
  const bool codes =
      dot_scores && s.quantized() && !s.fp8_cache() && s.kv_bits == 8 && H == hp;

  thread_local Scratch t;
  if (dot_scores) {
    t.k.resize(static_cast<size_t>(kTileKeys * hp));
  } else {
    t.kt.assign(static_cast<size_t>(H * kTileKeys), 0.0f);
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

  // Rows: per KV head of the task, token-major, so a micro-block usually shares a key range.
  const BatchGeometry geo = c.geo(b);
  int64_t key_lo = std::numeric_limits<int64_t>::max(), key_hi = 0;
  for (int64_t r = 0; r < rows_pad; ++r) {
    t.o_rows[r] = t.o.data() + r * hp;
    t.q_rows[r] = t.zero_q.data();
    const TaskRow row = MapRow(r, g0, i0, i1 - i0, G, head_rows);
    if (!row.valid) continue;
    t.head[r] = row.head;
    t.token[r] = row.token;
    t.q_rows[r] = c.q_scaled.data() + ((b * N + row.head) * s.seq_len + row.token) * hp;
    // Right padding of a first prompt, rows beyond query_seqlens: no keys, output 0.
    const KeyRange keys = QueryKeyRange(s, geo, row.token);
    if (keys.lo >= keys.hi) continue;
    t.lo[r] = keys.lo;
    t.hi[r] = keys.hi;
    key_lo = std::min(key_lo, t.lo[r]);
    key_hi = std::max(key_hi, t.hi[r]);
  }
  if (codes) {  // queries times their head's K scales (PER_TOKEN: the scores take them)
    t.kc_rows.resize(kTileKeys);
    t.vc_rows.resize(kTileKeys);
    t.k_scale.assign(kTileKeys, 0.0f);
    t.v_scale.assign(kTileKeys, 0.0f);
    t.qk.resize(static_cast<size_t>(rows_pad * hp));
    t.qk_rows.resize(rows_pad);
    for (int64_t r = 0; r < rows_pad; ++r) {
      if (s.per_token()) {
        t.qk_rows[r] = t.q_rows[r];
        continue;
      }
      float* qk = t.qk.data() + r * hp;
      TimesHeadScales(c, 0, g0 + r / head_rows, t.q_rows[r], qk);
      t.qk_rows[r] = qk;
    }
  }
  // This task's key split.
  key_lo = std::max(key_lo, split * c.split_keys);
  key_hi = std::min(key_hi, (split + 1) * c.split_keys);

  // float32 rows of head_pad length are read in place, except a prefill's seq-major V rows: the
  // PV micro-kernel walks a V tile once per row block (~40 times), and rows Nkv*H floats apart
  // (a page each at 32/8/128) cost TLB and prefetch misses every walk; a packed copy costs one
  // pass (part of what took seq-major S=2048 32/8/128 AVX2 prefill from ~30 to 40 GFLOP/s).
  const bool direct_v = std::is_same<T, float>::value && !s.quantized() && H == hp &&
                        (dot_scores || c.present_strides.seq == H);
  // A task over all heads walks each tile once per head: keep a tile of every head's K near
  // 64 KB so the tile stays in L2 across those passes (measured: 32/8/128 fp32 seq-major decode
  // 12 -> 16 GB/s with 16-key tiles; 9/3/64 keeps 64).
  int64_t tile_keys = kTileKeys;
  if (c.group_heads > 1) {
    const int64_t fit = (64 << 10) / (c.group_heads * static_cast<int64_t>(c.row_bytes));
    tile_keys = std::min<int64_t>(kTileKeys, std::max<int64_t>(16, fit / 16 * 16));
  }
  for (int64_t k0 = key_lo; k0 < key_hi; k0 += tile_keys) {
    const int tile = static_cast<int>(std::min<int64_t>(tile_keys, key_hi - k0));
    for (int64_t gl = 0; gl < c.group_heads; ++gl) {
      const int64_t g = g0 + gl;
      const int64_t r_begin = gl * head_rows, r_end = r_begin + head_rows;
      // Prefetch this head's next tile (into L2) while the tile's other heads are worked on:
      // in seq-major order one head's rows are Nkv*H apart, each on its own page, where
      // hardware prefetchers stop. Issued per head, the prefetches spread over the tile's work
      // instead of bursting at its start (seq-major decode +5 to 20%, DRAM-bound cases).
      const int64_t next_hi = std::min<int64_t>(key_hi, k0 + 2 * tile_keys);
      for (int64_t pos = k0 + tile_keys; pos < next_hi; ++pos) {
        const char* kp = reinterpret_cast<const char*>(c.key_row(b, g, pos, geo, false));
        const char* vp = reinterpret_cast<const char*>(c.key_row(b, g, pos, geo, true));
        for (size_t off = 0; off < c.row_bytes; off += 64) {
          __builtin_prefetch(kp + off, 0, 2);
          __builtin_prefetch(vp + off, 0, 2);
        }
      }
      bool any = false;
      for (int64_t r = r_begin; r < r_end; ++r) any |= t.lo[r] < k0 + tile && t.hi[r] > k0;
      if (!any) continue;
      // K tile: rows or transposed into kt[d][j]; V rows (float32 rows are used in place).
      int transposed = 0;  // keys [0, transposed) of kt filled 8 at a time
      // (A quantized cache's rows are dequantized here, a tile at a time, by LoadRow; an int8
      // cache's rows at token generation are only pointed to: Int8Rows.)
      while (!dot_scores && !s.quantized() && transposed + 8 <= tile) {
        const T* rows[8];
        for (int i = 0; i < 8; ++i) {
          rows[i] = reinterpret_cast<const T*>(c.key_row(b, g, k0 + transposed + i, geo, false));
        }
        if (!TransposeKRows8<T>(rows, H, t.kt.data() + transposed)) break;
        transposed += 8;
      }
      for (int j = 0; j < tile && codes; ++j) {
        t.kc_rows[j] = reinterpret_cast<const int8_t*>(c.key_row(b, g, k0 + j, geo, false));
        t.vc_rows[j] = reinterpret_cast<const int8_t*>(c.key_row(b, g, k0 + j, geo, true));
        if (s.per_token()) {
          t.k_scale[j] = c.row_scale(b, g, k0 + j, geo, false);
          t.v_scale[j] = c.row_scale(b, g, k0 + j, geo, true);
        }
      }
      for (int j = tile; j < kTileKeys && codes; ++j) t.k_scale[j] = t.v_scale[j] = 0.0f;
      for (int j = 0; j < tile && !codes; ++j) {
        const uint8_t* krow = c.key_row(b, g, k0 + j, geo, false);
        const uint8_t* vrow = c.key_row(b, g, k0 + j, geo, true);
        if (!dot_scores) {
          if (j >= transposed) {
            LoadRow(c, krow, 0, g, c.row_scale(b, g, k0 + j, geo, false), t.row.data());
            for (int64_t d = 0; d < H; ++d) t.kt[d * kTileKeys + j] = t.row[d];
          }
        } else if (direct_v) {
          t.k_rows[j] = reinterpret_cast<const float*>(krow);
        } else {
          float* dst = t.k.data() + j * hp;
          LoadRow(c, krow, 0, g, c.row_scale(b, g, k0 + j, geo, false), dst);
          for (int64_t d = H; d < hp; ++d) dst[d] = 0.0f;
          t.k_rows[j] = dst;
        }
        if (direct_v) {
          t.v_rows[j] = reinterpret_cast<const float*>(vrow);
        } else {
          float* dst = t.v.data() + j * hp;
          LoadRow(c, vrow, 1, g, c.row_scale(b, g, k0 + j, geo, true), dst);
          for (int64_t d = H; d < hp; ++d) dst[d] = 0.0f;
          t.v_rows[j] = dst;
        }
      }
      t.v_nonfinite = -1;  // new V rows
      for (int j = tile; j < kTileKeys && !dot_scores; ++j) {
        for (int64_t d = 0; d < H; ++d) t.kt[d * kTileKeys + j] = 0.0f;
      }
      const auto rows = [&](const auto& ks, const auto& vs) {
        if (c.row_block == kRowBlock) {
          AttentionRows<T, kRowBlock>(c, t, b, r_begin, r_end, k0, tile, dot_scores, ks, vs);
        } else if (c.row_block == 1) {
          AttentionRows<T, 1>(c, t, b, r_begin, r_end, k0, tile, dot_scores, ks, vs);
        } else if (c.row_block == 2) {
          AttentionRows<T, 2>(c, t, b, r_begin, r_end, k0, tile, dot_scores, ks, vs);
        } else if (c.row_block == 3) {
          AttentionRows<T, 3>(c, t, b, r_begin, r_end, k0, tile, dot_scores, ks, vs);
        } else {
          AttentionRows<T, 4>(c, t, b, r_begin, r_end, k0, tile, dot_scores, ks, vs);
        }
      };
      if (codes) {
        rows(Int8Rows{t.kc_rows.data()}, Int8Rows{t.vc_rows.data()});
      } else {
        rows(FloatRows{t.k_rows.data()}, FloatRows{t.v_rows.data()});
      }
    }
  }

  if (codes && !s.per_token()) {  // the V scales of each row's head, per channel or tensor
    for (int64_t r = 0; r < rows_pad; ++r) {
      TimesHeadScales(c, 1, g0 + r / head_rows, t.o_rows[r], t.o_rows[r]);
    }
  }
  if (c.num_splits > 1) {  // partial state; MergeSplits finishes
    const int64_t slot = base * c.num_splits + split;
    const int64_t rpt = c.rows_per_task();
    std::memcpy(c.part_o->data() + slot * rpt * hp, t.o.data(), rows_pad * hp * sizeof(float));
    std::memcpy(c.part_m->data() + slot * rpt, t.m.data(), rows_pad * sizeof(float));
    std::memcpy(c.part_l->data() + slot * rpt, t.l.data(), rows_pad * sizeof(float));
    return;
  }
  for (int64_t r = 0; r < rows_pad; ++r) {
    if (!MapRow(r, g0, i0, i1 - i0, G, head_rows).valid) continue;
    WriteOutputRow(c, b, t.token[r], t.head[r], t.o_rows[r], t.m[r], t.l[r]);
  }
}

// Task (b, head group, q block): merges the key splits' partial states in a fixed order.
template <typename T>
void MergeSplits(void* state, size_t task_index) {
  const Call<T>& c = *static_cast<const Call<T>*>(state);
  const GqaShape& s = c.s;
  const int64_t G = s.group_size(), hp = c.head_pad, rpt = c.rows_per_task();
  const int64_t base = static_cast<int64_t>(task_index);
  const int64_t qb = base % c.num_q_blocks;
  const int64_t g0 = (base / c.num_q_blocks) % c.num_groups * c.group_heads;
  const int64_t b = base / (c.num_q_blocks * c.num_groups);
  const int64_t i0 = qb * c.q_block, i1 = std::min(s.seq_len, i0 + c.q_block);
  std::vector<float> o(static_cast<size_t>(hp));
  for (int64_t r = 0; r < rpt; ++r) {
    const TaskRow row = MapRow(r, g0, i0, i1 - i0, G, c.head_rows_pad());
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
    WriteOutputRow(c, b, row.token, row.head, o.data(), m, l);
  }
}

template <typename T>
Status Run(const GqaShape& s, const GqaCpuBuffers& buf, const Parallel& parallel) {
  std::vector<float> q_scaled, part_o, part_m, part_l;
  std::vector<uint8_t> new_k, new_v;
  std::vector<float> new_k_scale, new_v_scale;
  KVL_RETURN_IF_ERROR(CheckSharing(buf));
  const size_t cache_elem = s.quantized() ? 1 : sizeof(T);
  Call<T> c{s, buf, {}, {}, cache_elem, static_cast<size_t>(s.cache_row) * cache_elem,
            {buf.k_scale, buf.v_scale}, {}, {},
            RoundUp(s.head_size, kDimStep), q_scaled, 1, 1, 1, 1, 1, 1, 1,
            &part_o, &part_m, &part_l, &new_k, &new_v};
  c.past_strides = MakeKvStrides(s.layout, s.kv_num_heads, s.past_capacity, s.cache_row);
  c.present_strides = MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, s.cache_row);
  // Inverse scales, computed once as ORT does (quantizing multiplies by them).
  std::vector<float> inv_scales[2];
  const KvQuant quant[2] = {s.k_quant, s.v_quant};
  for (int which = 0; which < 2 && s.quantized() && !s.per_token(); ++which) {
    const int64_t n = quant[which] == KvQuant::kPerChannel ? s.kv_num_heads * s.head_size : 1;
    for (int64_t i = 0; i < n; ++i) {
      inv_scales[which].push_back(QuantInverseScale(c.scale[which][i]));
    }
    c.inv_scale[which] = inv_scales[which].data();
    c.scale_pitch[which] = quant[which] == KvQuant::kPerChannel ? s.head_size : 0;
  }
  if (s.per_token()) {
    c.past_scale[0] = buf.past_key_scale;
    c.past_scale[1] = buf.past_value_scale;
    c.present_scale[0] = buf.present_key_scale;
    c.present_scale[1] = buf.present_value_scale;
    c.past_scale_strides = MakeKvScaleStrides(s.layout, s.kv_num_heads, s.past_capacity);
    c.present_scale_strides = MakeKvScaleStrides(s.layout, s.kv_num_heads, s.present_capacity);
    c.new_scale[0] = &new_k_scale;
    c.new_scale[1] = &new_v_scale;
    c.qmax = PerTokenQMax(s.kv_bits, s.fp8_cache());
    if (s.sliding_window_cache) {
      new_k_scale.resize(static_cast<size_t>(s.batch * s.kv_num_heads * s.seq_len));
      new_v_scale.resize(new_k_scale.size());
    }
  }
  q_scaled.assign(static_cast<size_t>(s.batch * s.num_heads * s.seq_len * c.head_pad), 0.0f);

  const size_t kv_tasks = static_cast<size_t>(s.batch * s.kv_num_heads);
  if (s.sliding_window_cache) {
    const size_t rows = static_cast<size_t>(s.batch * s.kv_num_heads * s.seq_len) * c.row_bytes;
    new_k.resize(rows);
    new_v.resize(rows);
  } else if (!buf.shared()) {
    // 1. Past rows into a separate present (the new rows, written next, never overlap them).
    parallel.For(kv_tasks, CopyPast<T>, &c);
  }
  // A first prompt ignores past content: CopyPast copied nothing (past length 0).
  // 2. Queries normed/rotated/scaled; new K/V rows normed/rotated into present.
  parallel.For(static_cast<size_t>(s.batch * s.seq_len), PrepareToken<T>, &c);

  // 3. Attention. Query blocks give a prefill enough rows to reuse each K/V tile; key splits
  //    give a decode (one query block) enough tasks to use every thread. The grid depends on
  //    sizes and thread count only, so results are deterministic for a given machine.
  const int64_t G = s.group_size();
  // ~256 rows per task amortize the K tile's transposition (S=2048 32/8/128: 0.86x -> 0.94x
  // of ORT against 128 rows); fewer when that starves threads.
  const int64_t want = 4 * static_cast<int64_t>(parallel.NumThreads());
  c.q_block = std::min(s.seq_len, std::max<int64_t>(1, 256 / G));
  while (c.q_block > 1 &&
         s.batch * s.kv_num_heads * ((s.seq_len + c.q_block - 1) / c.q_block) < want) {
    c.q_block /= 2;
  }
  c.num_q_blocks = (s.seq_len + c.q_block - 1) / c.q_block;
  // Token generation: micro-blocks of a head's query rows when it has <= 4 (1 to 4 rows: no
  // padding rows, whose FMAs and score sums a 4-row block paid for at G = 3, 2 or 1), and,
  // when a token's heads are adjacent in the cache (seq-major), one task over all of them so
  // the cache streams in address order; key splits then provide the parallelism.
  const bool decode_like = c.q_block * G <= kRowBlock;
  c.row_block = c.q_block * G <= 4 ? c.q_block * G : kRowBlock;
  const bool heads_adjacent = c.present_strides.head == s.cache_row && !s.sliding_window_cache;
  c.group_heads = decode_like && heads_adjacent ? s.kv_num_heads : 1;
  c.num_groups = s.kv_num_heads / c.group_heads;
  const int64_t base_tasks = s.batch * c.num_groups * c.num_q_blocks;
  const int64_t max_splits = std::max<int64_t>(1, s.total_seq_len / (4 * kTileKeys));
  c.num_splits = base_tasks >= want ? 1 : std::min(max_splits, (want + base_tasks - 1) / base_tasks);
  c.split_keys = RoundUp((s.total_seq_len + c.num_splits - 1) / c.num_splits, kTileKeys);
  if (c.num_splits > 1) {
    const int64_t slots = base_tasks * c.num_splits * c.rows_per_task();
    part_o.assign(static_cast<size_t>(slots * c.head_pad), 0.0f);
    part_m.assign(static_cast<size_t>(slots), -std::numeric_limits<float>::infinity());
    part_l.assign(static_cast<size_t>(slots), 0.0f);
  }
  parallel.For(static_cast<size_t>(base_tasks * c.num_splits), AttentionTask<T>, &c);
  if (c.num_splits > 1) parallel.For(static_cast<size_t>(base_tasks), MergeSplits<T>, &c);
  // 4. A sliding window cache's present, once the attention no longer reads the past.
  if (s.sliding_window_cache) parallel.For(kv_tasks, WriteSlidingPresent<T>, &c);
  return Status::Ok();
}

}  // namespace

Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel) {
  switch (shape.dtype) {
    case DType::kFloat32: return Run<float>(shape, buffers, parallel);
    case DType::kFloat16: return Run<Half>(shape, buffers, parallel);
    case DType::kBFloat16: return Run<BFloat16>(shape, buffers, parallel);
    default:
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention: unsupported type ") +
                           DTypeName(shape.dtype));
  }
}

}  // namespace KVL_ISA_NS
}  // namespace kvl

#if KVL_ISA_LEVEL != 0 && defined(__clang__)
#pragma clang attribute pop
#elif KVL_ISA_LEVEL != 0
#pragma GCC pop_options
#endif
