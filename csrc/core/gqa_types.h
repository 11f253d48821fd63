// The operator's vocabulary: input/output indices, attributes, and the validated shape struct.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <cmath>

#include "core/kv_strides.h"

namespace kvl {

// Input indices of com.microsoft::GroupQueryAttention (ORT 1.32), named once.
enum class GqaInput : int {
  kQuery = 0,
  kKey,
  kValue,
  kPastKey,
  kPastValue,
  kSeqlensK,
  kTotalSequenceLength,
  kCosCache,
  kSinCache,
  kPositionIds,
  kAttentionBias,
  kHeadSink,
  kKScale,
  kVScale,
  kQNormWeight,
  kKNormWeight,
  kQuerySeqlens,
  // ai.kvlayout only (PER_TOKEN): one float32 scale per (batch, kv head, cache row) of the key
  // and of the value cache, declared (B, Nkv, C), byte order of kv_layout (KvScaleStrides).
  kPastKeyScale,
  kPastValueScale,
  kCount
};
constexpr int kGqaInputCount = static_cast<int>(GqaInput::kCount);

// kPresentKeyScale / kPresentValueScale: ai.kvlayout only (PER_TOKEN), (B, Nkv, C') float32.
enum class GqaOutput : int {
  kOutput = 0,
  kPresentKey,
  kPresentValue,
  kOutputQk,
  kPresentKeyScale,
  kPresentValueScale,
  kCount
};
constexpr int kGqaOutputCount = static_cast<int>(GqaOutput::kCount);

const char* GqaInputName(GqaInput input);
const char* GqaOutputName(GqaOutput output);

// kInt8 / kUInt8 / kFloat8E4M3: KV cache element types of ORT's quantized-cache contract (int8,
// packed int4 in uint8, float8e4m3fn).
enum class DType {
  kUndefined,
  kFloat32,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kInt8,
  kUInt8,
  kFloat8E4M3,
  kOther
};
const char* DTypeName(DType dtype);

// Quantization of one KV cache (attributes k_quant_type / v_quant_type): none (the cache holds T),
// one scale for the cache, one scale per (kv head, channel) (ORT's static scales, k_scale /
// v_scale), or one scale per (batch, kv head, cache row) computed as the row is written and kept
// in a scale cache beside the KV cache (PER_TOKEN, ai.kvlayout only: docs/CONTRACT.md section 14).
enum class KvQuant { kNone, kPerTensor, kPerChannel, kPerToken };
const char* KvQuantName(KvQuant quant);

// Shape and type of one input as the op sees it; `exists` is false for an absent optional input.
struct TensorInfo {
  bool exists = false;
  DType dtype = DType::kUndefined;
  std::vector<int64_t> shape;

  int64_t NumElements() const;
};
using GqaInputInfos = std::array<TensorInfo, kGqaInputCount>;

struct GqaAttributes {
  int64_t num_heads = 0;
  int64_t kv_num_heads = 0;
  float scale = 0.0f;    // 0 -> 1/sqrt(head_size)
  float softcap = 0.0f;  // 0 -> off
  int64_t local_window_size = -1;
  int64_t do_rotary = 0;
  int64_t rotary_interleaved = 0;
  int64_t smooth_softmax = -1;
  float qk_norm_epsilon = 1e-6f;
  float q_norm_epsilon = -1.0f;  // < 0: use qk_norm_epsilon
  float k_norm_epsilon = -1.0f;  // < 0: use qk_norm_epsilon
  int64_t causal = 1;
  int64_t sliding_window_cache = 0;
  std::string k_quant_type = "NONE";
  std::string v_quant_type = "NONE";
  int64_t kv_cache_bit_width = 0;
  int64_t qk_output = 0;
  int64_t kv_layout = 0;
  // Node facts: true when the node names a 4th output (output_qk).
  bool output_qk_requested = false;
  // Node facts: true when the node names output present_key_scale / present_value_scale.
  bool present_key_scale_requested = false;
  bool present_value_scale_requested = false;
};

// What an execution provider's kernels implement beyond the base contract; the validation
// (check_inputs.h) refuses the rest by name. The default is the base contract.
struct GqaKernelCaps {
  bool quantized_kv = false;  // k/v_quant_type, kv_cache_bit_width, k_scale/v_scale, int caches
  bool fp8_kv = false;        // float8e4m3fn caches (8 bits)
  bool per_token_kv = false;  // k/v_quant_type = PER_TOKEN with the scale caches
};

enum class GqaCase { kFirstPrompt, kTokenGeneration, kSubsequentPrompt };

// Everything the kernels need to know about sizes, derived once by CheckGqaInputs.
struct GqaShape {
  DType dtype = DType::kUndefined;
  int64_t batch = 0;
  int64_t seq_len = 0;  // S, new tokens per batch entry
  int64_t num_heads = 0;
  int64_t kv_num_heads = 0;
  int64_t head_size = 0;
  bool packed_qkv = false;
  bool has_past = false;
  int64_t past_capacity = 0;     // C of past_key/past_value (0 without past)
  int64_t present_capacity = 0;  // C' = max(total_sequence_length, C)
  int64_t total_seq_len = 0;
  GqaCase gqa_case = GqaCase::kFirstPrompt;
  KvLayout layout = KvLayout::kHeadMajorBnsh;

  int64_t rotary_dim = 0;  // 0 when do_rotary is off
  int64_t rotary_max_positions = 0;
  bool interleaved = false;
  bool has_position_ids = false;

  bool has_attention_bias = false;
  int64_t bias_batch = 0;  // 1 or batch
  int64_t bias_heads = 0;  // 1 or num_heads
  int64_t bias_total = 0;  // last dim of attention_bias

  bool has_head_sink = false;
  bool has_q_norm = false;
  bool has_k_norm = false;
  bool smooth_softmax = false;
  bool has_query_seqlens = false;  // per-entry count of valid new rows (chunked prefill)
  bool causal = true;
  bool sliding_window_cache = false;  // window-sized cache, rows shifted as it fills

  // KV cache storage. Unquantized: the cache holds T, cache_row == head_size. Quantized (ORT's
  // contract): int8 codes or float8e4m3fn values (kv_bits 8, cache_dtype tells which) or two int4
  // codes per byte (kv_bits 4, cache_row = (head_size + 1) / 2), x ~ code * scale with the scales
  // of k_scale / v_scale, or (PER_TOKEN) of the scale caches, one per cache row.
  KvQuant k_quant = KvQuant::kNone;
  KvQuant v_quant = KvQuant::kNone;
  int64_t kv_bits = 0;     // 0 (unquantized), 8 or 4
  DType cache_dtype = DType::kUndefined;  // element type of past/present
  int64_t cache_row = 0;   // stored elements per cache row (KvRowElements)

  float scale = 0.0f;
  float softcap = 0.0f;
  float q_norm_epsilon = 1e-6f;
  float k_norm_epsilon = 1e-6f;
  int64_t local_window = -1;  // < 0: off; else the number of keys a query sees, itself included

  KVL_HOST_DEVICE bool is_first_prompt() const { return gqa_case == GqaCase::kFirstPrompt; }
  KVL_HOST_DEVICE bool quantized() const { return kv_bits != 0; }
  KVL_HOST_DEVICE bool per_token() const { return k_quant == KvQuant::kPerToken; }
  KVL_HOST_DEVICE bool fp8_cache() const { return cache_dtype == DType::kFloat8E4M3; }
  KVL_HOST_DEVICE int64_t group_size() const { return num_heads / kv_num_heads; }
};

// L(T): the number of rows a window-sized cache (capacity C >= window W) holds after T tokens.
// Rows [0, L) hold positions T - L .. T - 1; when full it drops the oldest G = C - W + 1 rows.
KVL_HOST_DEVICE int64_t SlidingResidentRows(int64_t total, int64_t capacity, int64_t window) {
  if (total <= capacity) return total;
  const int64_t g = capacity - window + 1;
  return total - g * ((total - capacity + g - 1) / g);
}

// Where one batch entry's tokens are this call: `past` cached tokens, `new_rows` valid new
// tokens (at positions past .. past + new_rows - 1), `total` = past + new_rows valid keys.
// `cache_base`: the position held by row 0 of the past buffer (non-zero only for a sliding
// window cache; on CUDA also row 0 of the staging copy the attention reads, sliding.cu);
// `present_base`: the same for present after this call.
struct BatchGeometry {
  int64_t past;
  int64_t new_rows;
  int64_t total;
  int64_t cache_base;
  int64_t present_base;
};

// cache_base / present_base of a geometry whose past and total are set (both 0 unless the cache
// is window-sized).
KVL_HOST_DEVICE void SetCacheBases(const GqaShape& s, BatchGeometry* g) {
  g->cache_base = 0;
  g->present_base = 0;
  if (s.sliding_window_cache) {
    g->cache_base = g->past - SlidingResidentRows(g->past, s.past_capacity, s.local_window);
    g->present_base = g->total - SlidingResidentRows(g->total, s.past_capacity, s.local_window);
  }
}

KVL_HOST_DEVICE BatchGeometry GetBatchGeometry(const GqaShape& s, int32_t seqlens_k_b,
                                               int32_t query_seqlens_b) {
  BatchGeometry g;
  g.total = static_cast<int64_t>(seqlens_k_b) + 1;
  if (s.is_first_prompt()) {
    g.new_rows = g.total;  // right padding: rows >= total are padding
    g.past = 0;
  } else {
    g.new_rows = s.has_query_seqlens ? query_seqlens_b : s.seq_len;
    g.past = g.total - g.new_rows;
  }
  SetCacheBases(s, &g);
  return g;
}

// The same, for kernels that read lengths on the device and cannot report an error: every length
// is clamped so that no row index leaves the buffers (total <= present capacity, past <= past
// capacity). Equal to GetBatchGeometry for inputs that CheckLengthsOnHost accepts.
// A window-sized cache holds positions [base, base + L) with L <= capacity whatever the
// absolute positions are, so there only the per-call counts are clamped (total >= 1, new rows
// in [0, S]) and positions stay unbounded, as on the host.
KVL_HOST_DEVICE BatchGeometry ClampedBatchGeometry(const GqaShape& s, int32_t seqlens_k_b,
                                                   int32_t query_seqlens_b) {
  BatchGeometry g;
  int64_t total = static_cast<int64_t>(seqlens_k_b) + 1;
  total = total < 1 ? 1 : total;
  if (!s.sliding_window_cache && total > s.present_capacity) total = s.present_capacity;
  if (s.is_first_prompt()) {
    g.new_rows = total < s.seq_len ? total : s.seq_len;
    g.past = 0;
  } else {
    int64_t rows = s.has_query_seqlens ? query_seqlens_b : s.seq_len;
    rows = rows < 0 ? 0 : (rows > s.seq_len ? s.seq_len : rows);
    rows = rows > total ? total : rows;
    g.new_rows = rows;
    g.past = total - rows;
    if (!s.sliding_window_cache && g.past > s.past_capacity) g.past = s.past_capacity;
  }
  g.total = g.past + g.new_rows;
  SetCacheBases(s, &g);
  return g;
}

// The keys [lo, hi) that new token `token` of a batch entry attends to (lo >= hi: none, as for
// right padding and rows beyond query_seqlens). A zero local window sees nothing (as ORT).
// Keys past the attention bias's last dimension are cut off: a no-op for inputs the host checks
// accept, and what keeps a device kernel inside the bias whatever seqlens_k holds.
struct KeyRange {
  int64_t lo;
  int64_t hi;
};

KVL_HOST_DEVICE KeyRange QueryKeyRange(const GqaShape& s, const BatchGeometry& g, int64_t token) {
  KeyRange r{0, 0};
  if (token >= g.new_rows) return r;
  const int64_t p = g.past + token;  // absolute position of this query
  r.hi = s.causal ? p + 1 : g.total;
  if (s.has_attention_bias && r.hi > s.bias_total) r.hi = s.bias_total;
  if (s.local_window > 0) {
    r.lo = p + 1 - s.local_window > 0 ? p + 1 - s.local_window : 0;
  } else {
    r.lo = s.local_window == 0 ? r.hi : 0;
  }
  if (s.sliding_window_cache && r.lo < g.cache_base) r.lo = g.cache_base;  // the window stays inside
  return r;
}

// Rotary position of new token i of batch entry b. ORT's rule: a first prompt reads only
// position_ids[0, 0], the offset of every entry; otherwise position_ids[b, i], or past + i.
KVL_HOST_DEVICE int64_t RotaryPosition(const GqaShape& s, const BatchGeometry& g,
                                       const int64_t* position_ids, int64_t b, int64_t i) {
  if (s.is_first_prompt()) return (s.has_position_ids ? position_ids[0] : 0) + i;
  return s.has_position_ids ? position_ids[b * s.seq_len + i] : g.past + i;
}

// Normalization of one query row's softmax state (running max m, sum l of exp(score - m), o
// unnormalized): the factor applied to o. smooth_softmax adds exp(0) to the denominator and a
// head sink exp(sink); both are taken relative to max(m, extra) so nothing overflows. A row
// that saw no key (l == 0) outputs zeros; a NaN l (a NaN or +Inf score reached the softmax)
// gives NaN, as ORT's softmax does.
KVL_HOST_DEVICE float OutputScale(float m, float l, bool extra_term, float extra_logit) {
  if (l != l) return l;
  if (!(l > 0.0f)) return 0.0f;
  if (!extra_term) return 1.0f / l;
  const float top = m > extra_logit ? m : extra_logit;
  const float kept = expf(m - top);
  return kept / (l * kept + expf(extra_logit - top));
}

}  // namespace kvl
