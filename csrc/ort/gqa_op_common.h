// Pieces of the custom-op glue shared by the CPU and CUDA GroupQueryAttention ops: attribute
// reading, input description, output allocation, the op schema callbacks.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstdint>
#include <vector>

#include "core/check_inputs.h"
#include "core/gqa_types.h"

namespace kvl {

constexpr const char* kDomain = "ai.kvlayout";
constexpr const char* kOpName = "GroupQueryAttention";

// Reads every attribute (absent ones keep the contract's defaults).
GqaAttributes ReadGqaAttributes(const OrtApi& api, const OrtKernelInfo* info);

// Shapes, types and presence of the node's inputs as the kernel sees them this call.
GqaInputInfos DescribeInputs(Ort::KernelContext& ctx);

// Converts a kvl::Status into an OrtStatus (nullptr when ok).
OrtStatusPtr ToOrtStatus(const Status& status);

// The outputs of one call. Present outputs the node does not produce are backed by `scratch`
// (the attention still reads the cache through present).
struct GqaOutputs {
  void* output = nullptr;
  void* present_key = nullptr;
  void* present_value = nullptr;
};
Status AllocateOutputs(Ort::KernelContext& ctx, const GqaShape& shape, GqaOutputs* outputs);

// Schema callbacks common to both ops: input/output types, optionality, memory types,
// past->present in-place hints and shape inference. Installed by SetCommonSchema.
void SetCommonSchema(OrtCustomOp* op);

template <typename T>
const T* InputData(Ort::KernelContext& ctx, GqaInput which) {
  const size_t index = static_cast<size_t>(which);
  if (index >= ctx.GetInputCount()) return nullptr;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return nullptr;
  return static_cast<const T*>(value.GetTensorRawData());
}

}  // namespace kvl
