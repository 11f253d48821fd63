// The schema of ai.kvlayout::GroupQueryAttention, common to its CPU and CUDA ops: input and
// output types, optionality, memory types, past->present in-place hints and shape inference.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>

#include "core/gqa_types.h"

namespace kvl {

constexpr const char* kOpName = "GroupQueryAttention";

// Installs the schema callbacks on `op` (GqaOpBase does, for both ops).
void SetGqaSchema(OrtCustomOp* op);

// What the CPU and CUDA ops share: the schema (SetGqaSchema installs the real callbacks;
// CustomOpBase needs the names below to exist) and kernel creation returning a status.
template <typename TOp, typename TKernel>
struct GqaOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  GqaOpBase() { SetGqaSchema(this); }
  const char* GetName() const { return kOpName; }
  size_t GetInputTypeCount() const { return kGqaInputCount; }
  ONNXTensorElementDataType GetInputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
  size_t GetOutputTypeCount() const { return kGqaOutputCount; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  }
};

}  // namespace kvl
