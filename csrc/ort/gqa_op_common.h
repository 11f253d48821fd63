// The GroupQueryAttention kernels' context glue, shared by the CPU and CUDA ops: attributes read
// at kernel creation, the inputs described and checked, outputs allocated, pointers collected.
// The op's schema: gqa_schema.h.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>
#include <cstdint>

#include "core/check_inputs.h"
#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "ort/op_glue.h"

namespace kvl {

// Reads every attribute (absent ones keep the contract's defaults) and checks them: a wrong type,
// a missing required attribute or a value outside the contract is an error (kernel creation,
// i.e. session creation, fails with it). `caps`: what the op's kernels implement beyond the base
// contract (the CPU op: quantized KV caches).
Status ReadGqaAttributes(const OrtApi& api, const OrtKernelInfo* info, GqaAttributes* attrs,
                         const GqaKernelCaps& caps = {});

// Describes the inputs, reads total_sequence_length (host memory for both ops) and runs
// CheckGqaInputs: the first step of both ops' Compute.
Status ReadAndCheckInputs(Ort::KernelContext& ctx, const GqaAttributes& attrs, GqaShape* shape,
                          const GqaKernelCaps& caps = {});

// The outputs of one call. Present outputs the node does not produce are backed by `scratch`
// (the attention still reads the cache through present).
struct GqaOutputs {
  void* output = nullptr;
  void* present_key = nullptr;
  void* present_value = nullptr;
  float* present_key_scale = nullptr;  // PER_TOKEN only
  float* present_value_scale = nullptr;
};
Status AllocateOutputs(Ort::KernelContext& ctx, const GqaShape& shape, GqaOutputs* outputs);

// The input pointers of this call (rotary caches only when rotary is on) and the outputs.
GqaBuffers CollectBuffers(Ort::KernelContext& ctx, const GqaShape& shape,
                          const GqaOutputs& outputs);

template <typename T>
const T* InputData(Ort::KernelContext& ctx, GqaInput which) {
  const size_t index = static_cast<size_t>(which);
  if (index >= ctx.GetInputCount()) return nullptr;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return nullptr;
  return static_cast<const T*>(value.GetTensorRawData());
}

}  // namespace kvl
