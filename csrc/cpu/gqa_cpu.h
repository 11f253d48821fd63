// CPU GroupQueryAttention: float32/float16/bfloat16 storage, float32 accumulation, threaded over
// (batch, kv head, query block, key split) tasks. The cache is indexed only through KvStrides.
#pragma once

#include <cstdint>

#include "core/gqa_types.h"
#include "core/status.h"
#include "cpu/thread_pool.h"

namespace kvl {

// Pointers of one call; element type is GqaShape::dtype (T) unless noted. Absent inputs are null.
struct GqaCpuBuffers {
  const void* query = nullptr;           // (B, S, N*H) or packed (B, S, (N+2*Nkv)*H)
  const void* key = nullptr;             // (B, S, Nkv*H)
  const void* value = nullptr;           // (B, S, Nkv*H)
  const void* past_key = nullptr;        // (B, Nkv, C, H) declared; byte order of the layout
  const void* past_value = nullptr;      // same as past_key
  const int32_t* seqlens_k = nullptr;    // (B) int32, host memory
  const void* cos_cache = nullptr;       // (max_pos, rotary_dim/2)
  const void* sin_cache = nullptr;       // (max_pos, rotary_dim/2)
  const int64_t* position_ids = nullptr; // (B, S) int64
  const int32_t* query_seqlens = nullptr; // (B) int32, host memory
  const void* attention_bias = nullptr;  // (B or 1, N or 1, S, total)
  const void* head_sink = nullptr;       // (N)
  const void* q_norm_weight = nullptr;   // (H)
  const void* k_norm_weight = nullptr;   // (H)
  void* output = nullptr;                // (B, S, N*H)
  void* present_key = nullptr;           // (B, Nkv, C', H) declared; may alias past_key
  void* present_value = nullptr;         // same as present_key
};

// Runs the op. The caller has validated shapes (CheckGqaInputs) and lengths (CheckLengthsOnHost).
// When present_key == past_key the new rows are appended in place.
Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel);

}  // namespace kvl
