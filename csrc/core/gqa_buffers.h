// Pointers of one call, for both execution providers (host memory on CPU, device memory on
// CUDA, except where noted). Element type is GqaShape::dtype (T) unless noted (caches:
// GqaShape::cache_dtype); absent inputs are null.
#pragma once

#include <cstdint>

namespace kvl {

struct LengthRecord;  // core/length_rules.h

struct GqaBuffers {
  const void* query = nullptr;             // (B, S, N*H) or packed (B, S, (N+2*Nkv)*H)
  const void* key = nullptr;               // (B, S, Nkv*H), null when packed
  const void* value = nullptr;             // (B, S, Nkv*H), null when packed
  const void* past_key = nullptr;          // (B, Nkv, C, cache_row) declared; layout byte order
  const void* past_value = nullptr;        // same as past_key
  const int32_t* seqlens_k = nullptr;      // (B) int32
  const int32_t* query_seqlens = nullptr;  // (B) int32
  const void* cos_cache = nullptr;         // (max_pos, rotary_dim/2); null without rotary
  const void* sin_cache = nullptr;         // (max_pos, rotary_dim/2); null without rotary
  const int64_t* position_ids = nullptr;   // (B, S) int64
  const void* attention_bias = nullptr;    // (B or 1, N or 1, S, total)
  const void* head_sink = nullptr;         // (N)
  const void* q_norm_weight = nullptr;     // (H)
  const void* k_norm_weight = nullptr;     // (H)
  const float* k_scale = nullptr;          // quantized cache: 1 or Nkv*H floats (host on CPU)
  const float* v_scale = nullptr;          // the same for the value cache
  void* output = nullptr;                  // (B, S, N*H)
  void* present_key = nullptr;             // (B, Nkv, C', cache_row) declared; may alias past_key
  void* present_value = nullptr;           // same as present_key
  // PER_TOKEN scale caches, float32 (B, Nkv, C) / (B, Nkv, C') declared, kv_layout byte order
  // (KvScaleStrides); a present may alias its past, exactly when present_key aliases past_key.
  const float* past_key_scale = nullptr;
  const float* past_value_scale = nullptr;
  float* present_key_scale = nullptr;
  float* present_value_scale = nullptr;
  // CUDA only: where the prepare/decode kernel records the first violated length rule (host-mapped
  // record, its device address) and the device word that elects the one writer. Null: no
  // record (the kernels still clamp every length).
  LengthRecord* length_record = nullptr;
  uint32_t* length_claim = nullptr;

  // Past and present share memory (onnxruntime-genai binds one buffer to both): append in place.
  bool shared() const { return past_key != nullptr && past_key == present_key; }
};

}  // namespace kvl
