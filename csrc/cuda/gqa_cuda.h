// CUDA GroupQueryAttention: launchers callable from plain C++ (no CUDA headers needed).
//
// Every kernel reads seqlens_k / query_seqlens on the device and clamps them
// (ClampedBatchGeometry), takes its grid from sizes and capacities only, and runs on the given
// stream: the same launches are valid under CUDA graph capture at any length.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "core/status.h"

namespace kvl {

// On CUDA every pointer of GqaBuffers is device memory (total_sequence_length, read on the
// host, is not among them).
using GqaCudaBuffers = GqaBuffers;

struct CudaDeviceInfo {
  int device = 0;
  int sm_count = 0;
  int max_smem_optin = 0;  // bytes of shared memory one CTA may opt in to
};
Status QueryCudaDevice(CudaDeviceInfo* info);

// Shapes the device path cannot serve (v1), as a Status naming the feature.
Status CheckCudaSupport(const GqaShape& shape);

// Bytes of device workspace one call needs (queries in float32, split partials, split counters);
// the kernel choice depends on the buffers' alignment, so the plan sees them.
size_t GqaCudaWorkspaceBytes(const GqaShape& shape, const GqaCudaBuffers& buffers,
                             const CudaDeviceInfo& device);

// Enqueues the whole op on `stream` (a cudaStream_t). `workspace` holds
// GqaCudaWorkspaceBytes(shape, buffers, device) bytes, 256-byte aligned.
Status LaunchGqaCuda(const GqaShape& shape, const GqaCudaBuffers& buffers,
                     const CudaDeviceInfo& device, void* workspace, void* stream);

}  // namespace kvl
