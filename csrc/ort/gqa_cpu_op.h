// ai.kvlayout::GroupQueryAttention on CPUExecutionProvider.
#pragma once

#include "ort/gqa_op_common.h"

namespace kvl {

class GqaCpuKernel {
 public:
  explicit GqaCpuKernel(const GqaAttributes& attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  GqaAttributes attrs_;
};

struct GqaCpuOp : Ort::CustomOpBase<GqaCpuOp, GqaCpuKernel, /*WithStatus=*/true> {
  GqaCpuOp() { SetCommonSchema(this); }
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetName() const { return kOpName; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
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
