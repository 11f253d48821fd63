// ai.kvlayout::GroupQueryAttention on CUDAExecutionProvider.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "cuda/gqa_cuda.h"
#include "ort/gqa_op_common.h"
#include "ort/gqa_schema.h"
#include "ort/length_errors.h"

namespace kvl {

// One node's kernel. Its length record (allocated here, once) receives the first length
// violation the device finds; each Run first takes it and fails with the CPU op's message.
// `strict` (ORT_KVLAYOUT_STRICT_LENGTHS=1 when the kernel was created) checks the lengths on the
// host before launching instead, at the cost of a copy and a stream synchronization per Run.
// The scales of a quantized cache are checked on the host (finite, > 0) when a Run brings scale
// buffers this kernel has not checked yet (an initializer's: once; a CUDA graph capture skips
// the check, its warm-up Runs made it), or on every Run in strict mode: a copy and a stream
// synchronization each time.
class GqaCudaKernel {
 public:
  GqaCudaKernel(const GqaAttributes& attrs, const CudaDeviceInfo& device,
                std::unique_ptr<CudaLengthRecord> record, const std::string& node_name,
                bool strict)
      : attrs_(attrs),
        device_(device),
        record_(std::move(record)),
        registration_(record_->host(), node_name),
        strict_(strict) {}
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

 private:
  Status Compute(Ort::KernelContext& ctx);
  Status CheckScales(const GqaShape& shape, const GqaBuffers& buf, void* stream);

  GqaAttributes attrs_;
  CudaDeviceInfo device_;
  std::unique_ptr<CudaLengthRecord> record_;  // outlives registration_ (declared before it)
  RegisteredLengthRecord registration_;
  bool strict_;
  CudaDecodeCounters decode_counters_;  // per stream, kept across Runs
  std::mutex scales_mutex_;  // the scale buffers last checked (CheckScales)
  const float* checked_k_scale_ = nullptr;
  const float* checked_v_scale_ = nullptr;
};

struct GqaCudaOp : GqaOpBase<GqaCudaOp, GqaCudaKernel> {
  OrtStatusPtr CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info, void** kernel) const;
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
};

}  // namespace kvl
