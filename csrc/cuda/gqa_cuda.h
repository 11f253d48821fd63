// CUDA GroupQueryAttention: launchers callable from plain C++ (no CUDA headers needed).
//
// Every kernel reads seqlens_k / query_seqlens on the device and clamps them
// (ClampedBatchGeometry), takes its grid from sizes and capacities only, and runs on the given
// stream: the same launches are valid under CUDA graph capture at any length.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/gqa_types.h"
#include "core/status.h"

namespace kvl {

// Device pointers of one call; element type is GqaShape::dtype (T) unless noted.
struct GqaCudaBuffers {
  const void* query = nullptr;            // (B, S, N*H) or packed (B, S, (N+2*Nkv)*H)
  const void* key = nullptr;              // (B, S, Nkv*H) or null (packed)
  const void* value = nullptr;            // (B, S, Nkv*H) or null (packed)
  const void* past_key = nullptr;         // (B, Nkv, C, H) declared, layout byte order
  const void* past_value = nullptr;
  const int32_t* seqlens_k = nullptr;     // (B) int32, device
  const int32_t* query_seqlens = nullptr; // (B) int32, device, or null
  const void* cos_cache = nullptr;        // (max_pos, rotary_dim/2)
  const void* sin_cache = nullptr;
  const int64_t* position_ids = nullptr;  // (B, S) int64, device
  const void* attention_bias = nullptr;   // (B or 1, N or 1, S, total)
  const void* head_sink = nullptr;        // (N)
  const void* q_norm_weight = nullptr;    // (H)
  const void* k_norm_weight = nullptr;    // (H)
  void* output = nullptr;                 // (B, S, N*H)
  void* present_key = nullptr;            // (B, Nkv, C', H) declared; may alias past_key
  void* present_value = nullptr;
};

struct CudaDeviceInfo {
  int device = 0;
  int sm_count = 0;
};
Status QueryCudaDevice(CudaDeviceInfo* info);

// Shapes the device path cannot serve (v1), as a Status naming the feature.
Status CheckCudaSupport(const GqaShape& shape);

// Bytes of device workspace one call needs (queries in float32, split partials).
size_t GqaCudaWorkspaceBytes(const GqaShape& shape, const CudaDeviceInfo& device);

// Enqueues the whole op on `stream` (a cudaStream_t). `workspace` holds
// GqaCudaWorkspaceBytes(shape, device) bytes, 256-byte aligned.
Status LaunchGqaCuda(const GqaShape& shape, const GqaCudaBuffers& buffers,
                     const CudaDeviceInfo& device, void* workspace, void* stream);

}  // namespace kvl
