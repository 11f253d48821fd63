#include "ort/gqa_cuda_op.h"

#include <string>

#include "core/knobs.h"

namespace kvl {
namespace {

// Beyond the base contract, the CUDA kernels run ORT's quantized KV caches (int8 and packed int4
// codes, per-tensor or per-channel scales), float8e4m3fn caches and our PER_TOKEN scale caches:
// prepare (or the decode kernel) writes the codes and scales, the attention kernels read them
// dequantized (docs/CONTRACT.md sections 13 and 14).
GqaKernelCaps CudaCaps() {
  GqaKernelCaps caps;
  caps.quantized_kv = true;
  caps.fp8_kv = true;
  caps.per_token_kv = true;
  return caps;
}

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

// The knobs the CUDA op reads (core/knobs.h), checked when a kernel is created: a bad value
// fails the session's creation, naming the knob and its rule. Returns ORT_KVLAYOUT_STRICT_LENGTHS,
// which is read anew for each kernel (a session's choice).
Status ReadCudaKnobs(bool* strict) {
  const KnobValues now = ReadKnobs();
  std::string error = Knobs().ErrorFor(KnobRead::kCudaOnce);
  const std::string per_op = now.ErrorFor(KnobRead::kCudaOpCreation);
  if (!per_op.empty()) error += (error.empty() ? "" : "; ") + per_op;
  if (!error.empty()) return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): " + error);
  *strict = now.strict_lengths;
  return Status::Ok();
}

std::string NodeName(const OrtApi& api, const OrtKernelInfo* info) {
  size_t size = 0;
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, nullptr, &size)) {
    api.ReleaseStatus(st);
    return "?";
  }
  std::string name(size, '\0');
  if (OrtStatus* st = api.KernelInfo_GetNodeName(info, name.data(), &size)) {
    api.ReleaseStatus(st);
    return "?";
  }
  while (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

}  // namespace

Status GqaCudaKernel::Compute(Ort::KernelContext& ctx) {
  // A violation an earlier Run's kernels recorded: this Run fails with its message (no sync).
  KVL_RETURN_IF_ERROR(registration_.Take());
  const CudaDeviceInfo& dev = device_;
  GqaShape shape;
  KVL_RETURN_IF_ERROR(ReadAndCheckInputs(ctx, attrs_, &shape, CudaCaps()));
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
  // A decode call without splits needs no workspace (the decode kernel keeps its queries).
  if (!buf.present_key || !buf.present_value || (plan.WorkspaceBytes() > 0 && !workspace.get())) {
    return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): could not allocate the "
                         "workspace from the CUDA allocator");
  }
  KVL_RETURN_IF_ERROR(CheckSharing(buf));
  // total_sequence_length is a host input: checked here, as on the CPU. The other lengths live
  // on the device: the prepare (or decode) kernel checks them and records the first violation
  // (reported by the next Run or ort_kvlayout.take_length_error()), or, in strict mode, the
  // host checks them first, waiting for the copy.
  KVL_RETURN_IF_ERROR(CheckSharedCapacity(shape, buf.shared()));
  void* stream = ctx.GetGPUComputeStream();
  if (strict_) KVL_RETURN_IF_ERROR(CheckLengthsStrict(shape, buf, stream));
  KVL_RETURN_IF_ERROR(CheckScales(shape, buf, stream));
  buf.length_record = record_->device();
  buf.length_claim = record_->claim();
  unsigned* counters = nullptr;  // null: the workspace's, zeroed by a memset
  if (plan.counter_bytes > 0) {
    KVL_RETURN_IF_ERROR(decode_counters_.Get(stream, plan.counter_bytes, &counters));
  }
  return LaunchGqaCuda(shape, buf, dev, plan, workspace.get(), stream, counters);
}

Status GqaCudaKernel::CheckScales(const GqaShape& shape, const GqaBuffers& buf, void* stream) {
  if (!shape.quantized() || shape.per_token()) return Status::Ok();  // PER_TOKEN: no inputs
  {
    std::lock_guard<std::mutex> lock(scales_mutex_);
    if (!strict_ && buf.k_scale == checked_k_scale_ && buf.v_scale == checked_v_scale_) {
      return Status::Ok();
    }
  }
  bool checked = false;
  KVL_RETURN_IF_ERROR(CheckKvScalesOnDevice(shape, buf, stream, &checked));
  if (checked) {
    std::lock_guard<std::mutex> lock(scales_mutex_);
    checked_k_scale_ = buf.k_scale;
    checked_v_scale_ = buf.v_scale;
  }
  return Status::Ok();
}

OrtStatusPtr GqaCudaKernel::ComputeV2(OrtKernelContext* context) {
  return GuardedCompute(context, [this](Ort::KernelContext& ctx) { return Compute(ctx); });
}

OrtStatusPtr GqaCudaOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                       void** kernel) const {
  GqaAttributes attrs;
  if (OrtStatusPtr st = ToOrtStatus(ReadGqaAttributes(api, info, &attrs, CudaCaps()))) return st;
  CudaDeviceInfo device;
  if (OrtStatusPtr st = ToOrtStatus(QueryCudaDevice(&device))) return st;
  bool strict = false;
  if (OrtStatusPtr st = ToOrtStatus(ReadCudaKnobs(&strict))) return st;
  std::unique_ptr<CudaLengthRecord> record;
  if (OrtStatusPtr st = ToOrtStatus(CudaLengthRecord::Create(&record))) return st;
  *kernel = new GqaCudaKernel(attrs, device, std::move(record), NodeName(api, info), strict);
  return nullptr;
}

}  // namespace kvl
