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

struct GqaCudaOp : GqaOpBase<GqaCudaOp, GqaCudaKernel> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace kvl
