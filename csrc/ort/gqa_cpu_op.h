// ai.kvlayout::GroupQueryAttention on CPUExecutionProvider.
#pragma once

#include "ort/gqa_op_common.h"
#include "ort/gqa_schema.h"

namespace kvl {

class GqaCpuKernel {
 public:
  explicit GqaCpuKernel(const GqaAttributes& attrs) : attrs_(attrs) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  GqaAttributes attrs_;
};

struct GqaCpuOp : GqaOpBase<GqaCpuOp, GqaCpuKernel> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
};

}  // namespace kvl
