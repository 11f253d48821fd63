#include "ort/gqa_cuda_op.h"

#include <string>

namespace kvl {
namespace {

// Device memory from the session's CUDA allocator (ORT's arena): no cudaMalloc per call, and
// stream-ordered reuse, so a buffer released after the launches is safe.
class DeviceBuffer {
 public:
  DeviceBuffer(Ort::KernelContext& ctx, int device, size_t bytes) {
    if (bytes == 0) return;
    Ort::MemoryInfo info("Cuda", OrtDeviceAllocator, device, OrtMemTypeDefault);
    allocator_ = ctx.GetAllocator(*info);
    if (allocator_ == nullptr) return;
    data_ = allocator_->Alloc(allocator_, bytes);
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) allocator_->Free(allocator_, data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return data_; }

 private:
  OrtAllocator* allocator_ = nullptr;
  void* data_ = nullptr;
};

Status Compute(Ort::KernelContext& ctx, const GqaAttributes& attrs, const CudaDeviceInfo& dev) {
  GqaShape shape;
  KVL_RETURN_IF_ERROR(ReadAndCheckInputs(ctx, attrs, &shape));
  KVL_RETURN_IF_ERROR(CheckCudaSupport(shape));
  GqaOutputs outputs;
  KVL_RETURN_IF_ERROR(AllocateOutputs(ctx, shape, &outputs));
  GqaBuffers buf = CollectBuffers(ctx, shape, outputs);
  // A node without present outputs still needs the cache for this call's attention.
  DeviceBuffer scratch_k(ctx, dev.device, buf.present_key ? 0 : PresentBytes(shape));
  DeviceBuffer scratch_v(ctx, dev.device, buf.present_value ? 0 : PresentBytes(shape));
  if (!buf.present_key) buf.present_key = scratch_k.get();
  if (!buf.present_value) buf.present_value = scratch_v.get();
  const GqaCudaPlan plan = PlanGqaCuda(shape, buf, dev);  // once per call: sizes and launches
  DeviceBuffer workspace(ctx, dev.device, plan.WorkspaceBytes());
  if (!buf.present_key || !buf.present_value || !workspace.get()) {
    return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): could not allocate the "
                         "workspace from the CUDA allocator");
  }
  KVL_RETURN_IF_ERROR(CheckSharing(buf));
  // seqlens_k lives on the device: its values are clamped there, the capacity is checked here.
  if (buf.shared() && shape.total_seq_len > shape.past_capacity) {
    return Status::Error("ai.kvlayout::GroupQueryAttention: input 'total_sequence_length' (" +
                         std::to_string(shape.total_seq_len) +
                         ") exceeds the capacity of the shared past/present buffer (" +
                         std::to_string(shape.past_capacity) + ")");
  }
  return LaunchGqaCuda(shape, buf, dev, plan, workspace.get(), ctx.GetGPUComputeStream());
}

}  // namespace

OrtStatusPtr GqaCudaKernel::ComputeV2(OrtKernelContext* context) {
  return GuardedCompute(context,
                        [this](Ort::KernelContext& ctx) { return Compute(ctx, attrs_, device_); });
}

OrtStatusPtr GqaCudaOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                       void** kernel) const {
  GqaAttributes attrs;
  if (OrtStatusPtr st = ToOrtStatus(ReadGqaAttributes(api, info, &attrs))) return st;
  CudaDeviceInfo device;
  if (OrtStatusPtr st = ToOrtStatus(QueryCudaDevice(&device))) return st;
  *kernel = new GqaCudaKernel(attrs, device);
  return nullptr;
}

}  // namespace kvl
