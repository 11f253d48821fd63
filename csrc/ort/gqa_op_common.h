// Pieces of the custom-op glue shared by the CPU and CUDA GroupQueryAttention ops: attribute
// reading, input description, output allocation, the op schema callbacks. FromOrtType,
// ToOrtStatus and GuardedCompute serve every op of the library (SampleTokens too).
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <vector>

#include "core/check_inputs.h"
#include "core/gqa_buffers.h"
#include "core/gqa_types.h"

namespace kvl {

constexpr const char* kDomain = "ai.kvlayout";
constexpr const char* kOpName = "GroupQueryAttention";

// The library's name of an ORT element type (DType::kOther for the types no op takes).
DType FromOrtType(ONNXTensorElementDataType type);

// Reads every attribute (absent ones keep the contract's defaults) and checks them: a wrong type,
// a missing required attribute or a value outside the contract is an error (kernel creation,
// i.e. session creation, fails with it). `caps`: what the op's kernels implement beyond the base
// contract (the CPU op: quantized KV caches).
Status ReadGqaAttributes(const OrtApi& api, const OrtKernelInfo* info, GqaAttributes* attrs,
                         const GqaKernelCaps& caps = {});

// Shapes, types and presence of a node's first N inputs as the kernel sees them this call (an
// absent optional input, or one past the node's count, stays `exists == false`); both ops' glue.
template <size_t N>
std::array<TensorInfo, N> DescribeInputs(Ort::KernelContext& ctx) {
  std::array<TensorInfo, N> infos;
  const size_t count = std::min<size_t>(ctx.GetInputCount(), N);
  for (size_t i = 0; i < count; ++i) {
    Ort::ConstValue value = ctx.GetInput(i);
    if (!value) continue;
    auto type_shape = value.GetTensorTypeAndShapeInfo();
    infos[i].exists = true;
    infos[i].dtype = FromOrtType(type_shape.GetElementType());
    infos[i].shape = type_shape.GetShape();
  }
  return infos;
}

// Describes the inputs, reads total_sequence_length (host memory for both ops) and runs
// CheckGqaInputs: the first step of both ops' Compute.
Status ReadAndCheckInputs(Ort::KernelContext& ctx, const GqaAttributes& attrs, GqaShape* shape,
                          const GqaKernelCaps& caps = {});

// Converts a kvl::Status into an OrtStatus (nullptr when ok).
OrtStatusPtr ToOrtStatus(const Status& status);

// Runs an op's compute, fn(Ort::KernelContext&) -> Status, so that no exception (the C++ API
// throws Ort::Exception) crosses the C API: every failure becomes an OrtStatus.
template <typename Fn>
OrtStatusPtr GuardedCompute(OrtKernelContext* context, Fn&& fn) {
  try {
    Ort::KernelContext ctx(context);
    return ToOrtStatus(fn(ctx));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

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

// Schema callbacks common to both ops: input/output types, optionality, memory types,
// past->present in-place hints and shape inference. Installed by SetCommonSchema.
void SetCommonSchema(OrtCustomOp* op);

// What the CPU and CUDA ops share: the schema (SetCommonSchema installs the real callbacks;
// CustomOpBase needs the names below to exist) and kernel creation returning a status.
template <typename TOp, typename TKernel>
struct GqaOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  GqaOpBase() { SetCommonSchema(this); }
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

template <typename T>
const T* InputData(Ort::KernelContext& ctx, GqaInput which) {
  const size_t index = static_cast<size_t>(which);
  if (index >= ctx.GetInputCount()) return nullptr;
  Ort::ConstValue value = ctx.GetInput(index);
  if (!value) return nullptr;
  return static_cast<const T*>(value.GetTensorRawData());
}

}  // namespace kvl
