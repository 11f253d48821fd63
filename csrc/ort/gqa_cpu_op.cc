#include "ort/gqa_cpu_op.h"

#include <exception>
#include <vector>

#include "cpu/gqa_cpu.h"

namespace kvl {
namespace {

// Runs tasks on ORT's intra-op thread pool.
class OrtParallel final : public Parallel {
 public:
  explicit OrtParallel(Ort::KernelContext& ctx) : ctx_(ctx) {}
  void For(size_t n, TaskFn fn, void* state) const override {
    if (n == 0) return;
    if (n == 1) {
      fn(state, 0);
      return;
    }
    ctx_.ParallelFor(fn, n, n, state);
  }
  int NumThreads() const override { return threads_; }
  void set_threads(int threads) { threads_ = threads; }

 private:
  Ort::KernelContext& ctx_;
  int threads_ = 1;
};

// ORT does not expose its pool size to custom ops; the grid heuristic only needs an estimate.
int EstimateThreads() {
  static const int threads = StdThreadParallel().NumThreads();
  return threads;
}

Status Compute(Ort::KernelContext& ctx, const GqaAttributes& attrs) {
  const GqaInputInfos inputs = DescribeInputs(ctx);
  const int32_t* total_ptr = InputData<int32_t>(ctx, GqaInput::kTotalSequenceLength);
  const bool total_ok = inputs[static_cast<int>(GqaInput::kTotalSequenceLength)].NumElements() == 1;
  const int32_t total = total_ok && total_ptr ? *total_ptr : 0;
  GqaShape shape;
  KVL_RETURN_IF_ERROR(CheckGqaInputs(attrs, inputs, total, &shape));

  GqaOutputs outputs;
  KVL_RETURN_IF_ERROR(AllocateOutputs(ctx, shape, &outputs));
  GqaCpuBuffers buf;
  buf.query = InputData<void>(ctx, GqaInput::kQuery);
  buf.key = InputData<void>(ctx, GqaInput::kKey);
  buf.value = InputData<void>(ctx, GqaInput::kValue);
  buf.past_key = InputData<void>(ctx, GqaInput::kPastKey);
  buf.past_value = InputData<void>(ctx, GqaInput::kPastValue);
  buf.seqlens_k = InputData<int32_t>(ctx, GqaInput::kSeqlensK);
  if (shape.rotary_dim > 0) {
    buf.cos_cache = InputData<void>(ctx, GqaInput::kCosCache);
    buf.sin_cache = InputData<void>(ctx, GqaInput::kSinCache);
  }
  buf.position_ids = InputData<int64_t>(ctx, GqaInput::kPositionIds);
  buf.query_seqlens = InputData<int32_t>(ctx, GqaInput::kQuerySeqlens);
  buf.attention_bias = InputData<void>(ctx, GqaInput::kAttentionBias);
  buf.head_sink = InputData<void>(ctx, GqaInput::kHeadSink);
  buf.q_norm_weight = InputData<void>(ctx, GqaInput::kQNormWeight);
  buf.k_norm_weight = InputData<void>(ctx, GqaInput::kKNormWeight);
  buf.output = outputs.output;

  // A node without present outputs still needs the cache for this call's attention.
  const size_t elem = shape.dtype == DType::kFloat32 ? 4 : 2;
  const size_t cache_bytes = static_cast<size_t>(shape.batch * shape.kv_num_heads *
                                                 shape.present_capacity * shape.head_size) * elem;
  std::vector<unsigned char> scratch_k, scratch_v;
  if (outputs.present_key == nullptr) {
    scratch_k.resize(cache_bytes);
    outputs.present_key = scratch_k.data();
  }
  if (outputs.present_value == nullptr) {
    scratch_v.resize(cache_bytes);
    outputs.present_value = scratch_v.data();
  }
  buf.present_key = outputs.present_key;
  buf.present_value = outputs.present_value;
  const bool shared = buf.past_key != nullptr && buf.past_key == buf.present_key;
  KVL_RETURN_IF_ERROR(CheckLengthsOnHost(shape, buf.seqlens_k, buf.query_seqlens, buf.position_ids, shared));

  OrtParallel parallel(ctx);
  parallel.set_threads(EstimateThreads());
  return RunGqaCpu(shape, buf, parallel);
}

}  // namespace

OrtStatusPtr GqaCpuKernel::ComputeV2(OrtKernelContext* context) {
  try {
    Ort::KernelContext ctx(context);
    return ToOrtStatus(Compute(ctx, attrs_));
  } catch (const Ort::Exception& e) {
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  } catch (const std::exception& e) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, e.what());
  }
}

OrtStatusPtr GqaCpuOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                      void** kernel) const {
  const GqaAttributes attrs = ReadGqaAttributes(api, info);
  if (OrtStatusPtr st = ToOrtStatus(CheckGqaAttributes(attrs))) return st;
  *kernel = new GqaCpuKernel(attrs);
  return nullptr;
}

}  // namespace kvl
