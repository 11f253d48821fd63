// ai.kvlayout::GroupQueryAttention on CUDAExecutionProvider.
#pragma once

#include "cuda/gqa_cuda.h"
#include "ort/gqa_op_common.h"

namespace kvl {

class GqaCudaKernel {
 public:
  GqaCudaKernel(const GqaAttributes& attrs, const CudaDeviceInfo& device)
      : attrs_(attrs), device_(device) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  GqaAttributes attrs_;
  CudaDeviceInfo device_;
};

struct GqaCudaOp : Ort::CustomOpBase<GqaCudaOp, GqaCudaKernel, /*WithStatus=*/true> {
  GqaCudaOp() { SetCommonSchema(this); }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  // Unused: SetCommonSchema installs the real callbacks; CustomOpBase needs the names.
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
