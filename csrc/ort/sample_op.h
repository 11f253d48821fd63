// ai.kvlayout::SampleTokens (since version 1) on CPUExecutionProvider and CUDAExecutionProvider:
// the schema (inputs, the int64 output, shape inference) and each EP's kernel glue. The per-row
// rule: core/sample_rule.h; the contract: docs/CONTRACT.md section 15.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>

#include "core/sample_types.h"

namespace kvl {

constexpr const char* kSampleOpName = "SampleTokens";

// Schema callbacks both ops share: input types (logits' left to CheckSampleInputs, so the error
// names the input), the int64 output and its shape, logits.shape[:-1].
OrtStatusPtr InferSampleOutputShape(const OrtCustomOp* op, OrtShapeInferContext* ctx);
ONNXTensorElementDataType SampleInputType(size_t index);

// Both ops: the schema, and kernel creation (a kernel holds no state: nothing to read or check).
template <typename TOp, typename TKernel>
struct SampleOpBase : Ort::CustomOpBase<TOp, TKernel, /*WithStatus=*/true> {
  SampleOpBase() { this->InferOutputShapeFn = InferSampleOutputShape; }
  const char* GetName() const { return kSampleOpName; }
  size_t GetInputTypeCount() const { return kSampleInputCount; }
  ONNXTensorElementDataType GetInputType(size_t index) const { return SampleInputType(index); }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const {
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
  }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo*, void** kernel) const {
    *kernel = new TKernel();
    return nullptr;
  }
};

// Every input in host memory.
class SampleCpuKernel {
 public:
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

struct SampleCpuOp : SampleOpBase<SampleCpuOp, SampleCpuKernel> {
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
};

#if defined(KVL_WITH_CUDA)
// Every input in device memory; one launch on ORT's compute stream, capture-safe
// (cuda/sample_tokens.h).
class SampleCudaKernel {
 public:
  OrtStatusPtr ComputeV2(OrtKernelContext* context);
};

struct SampleCudaOp : SampleOpBase<SampleCudaOp, SampleCudaKernel> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};
#endif

}  // namespace kvl
