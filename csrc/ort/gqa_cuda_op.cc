#include "ort/gqa_cuda_op.h"

#include <exception>
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
  const GqaInputInfos inputs = DescribeInputs(ctx);
  const int32_t* total_ptr = InputData<int32_t>(ctx, GqaInput::kTotalSequenceLength);  // host
  const bool total_ok = inputs[static_cast<int>(GqaInput::kTotalSequenceLength)].NumElements() == 1;
  GqaShape shape;
  KVL_RETURN_IF_ERROR(CheckGqaInputs(attrs, inputs, total_ok && total_ptr ? *total_ptr : 0, &shape));
  KVL_RETURN_IF_ERROR(CheckCudaSupport(shape));

  GqaOutputs outputs;
  KVL_RETURN_IF_ERROR(AllocateOutputs(ctx, shape, &outputs));
  const size_t elem = shape.dtype == DType::kFloat32 ? 4 : 2;
  const size_t cache_bytes = static_cast<size_t>(shape.batch * shape.kv_num_heads *
                                                 shape.present_capacity * shape.head_size) * elem;
  // A node without present outputs still needs the cache for this call's attention.
  DeviceBuffer scratch_k(ctx, dev.device, outputs.present_key ? 0 : cache_bytes);
  DeviceBuffer scratch_v(ctx, dev.device, outputs.present_value ? 0 : cache_bytes);
  DeviceBuffer workspace(ctx, dev.device, GqaCudaWorkspaceBytes(shape, dev));
  if ((!outputs.present_key && !scratch_k.get()) || (!outputs.present_value && !scratch_v.get()) ||
      !workspace.get()) {
    return Status::Error("ai.kvlayout::GroupQueryAttention (CUDA): could not allocate the "
                         "workspace from the CUDA allocator");
  }

  GqaCudaBuffers buf;
  buf.query = InputData<void>(ctx, GqaInput::kQuery);
  buf.key = InputData<void>(ctx, GqaInput::kKey);
  buf.value = InputData<void>(ctx, GqaInput::kValue);
  buf.past_key = InputData<void>(ctx, GqaInput::kPastKey);
  buf.past_value = InputData<void>(ctx, GqaInput::kPastValue);
  buf.seqlens_k = InputData<int32_t>(ctx, GqaInput::kSeqlensK);
  buf.query_seqlens = InputData<int32_t>(ctx, GqaInput::kQuerySeqlens);
  if (shape.rotary_dim > 0) {
    buf.cos_cache = InputData<void>(ctx, GqaInput::kCosCache);
    buf.sin_cache = InputData<void>(ctx, GqaInput::kSinCache);
  }
  buf.position_ids = InputData<int64_t>(ctx, GqaInput::kPositionIds);
  buf.attention_bias = InputData<void>(ctx, GqaInput::kAttentionBias);
  buf.head_sink = InputData<void>(ctx, GqaInput::kHeadSink);
  buf.q_norm_weight = InputData<void>(ctx, GqaInput::kQNormWeight);
  buf.k_norm_weight = InputData<void>(ctx, GqaInput::kKNormWeight);
  buf.output = outputs.output;
  buf.present_key = outputs.present_key ? outputs.present_key : scratch_k.get();
  buf.present_value = outputs.present_value ? outputs.present_value : scratch_v.get();
  if (buf.past_key != nullptr && (buf.past_key == buf.present_key) !=
                                     (buf.past_value == buf.present_value)) {
    return Status::Error("ai.kvlayout::GroupQueryAttention: past_key/present_key and "
                         "past_value/present_value must either both share memory or both not");
  }
  const bool shared = buf.past_key != nullptr && buf.past_key == buf.present_key;
  if (shared && shape.total_seq_len > shape.past_capacity) {
    return Status::Error("ai.kvlayout::GroupQueryAttention: input 'total_sequence_length' (" +
                         std::to_string(shape.total_seq_len) +
                         ") exceeds the capacity of the shared past/present buffer (" +
                         std::to_string(shape.past_capacity) + ")");
  }
  return LaunchGqaCuda(shape, buf, dev, workspace.get(), ctx.GetGPUComputeStream());
}

}  // namespace

OrtStatusPtr GqaCudaKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    return ToOrtStatus(Compute(ctx, attrs_, device_));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

OrtStatusPtr GqaCudaOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                       void** kernel) const {
  const GqaAttributes attrs = ReadGqaAttributes(api, info);
  if (OrtStatusPtr st = ToOrtStatus(CheckGqaAttributes(attrs))) return st;
  CudaDeviceInfo device;
  if (OrtStatusPtr st = ToOrtStatus(QueryCudaDevice(&device))) return st;
  *kernel = new GqaCudaKernel(attrs, device);
  return nullptr;
}

}  // namespace kvl
