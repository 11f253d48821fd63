#include "ort/gqa_cpu_op.h"

#include <string>
#include <vector>

#include "core/knobs.h"
#include "cpu/gqa_cpu.h"
#include "ort/ort_parallel.h"

namespace kvl {
namespace {

// ORT does not expose its pool size to custom ops; the grid heuristic only needs an estimate.
int EstimateThreads() {
  static const int threads = StdThreadParallel().NumThreads();
  return threads;
}

// The CPU kernels implement the quantized KV caches of ORT's contract, fp8 caches and PER_TOKEN.
constexpr GqaKernelCaps kCpuCaps{/*quantized_kv=*/true, /*fp8_kv=*/true, /*per_token_kv=*/true};

Status Compute(Ort::KernelContext& ctx, const GqaAttributes& attrs) {
  GqaShape shape;
  KVL_RETURN_IF_ERROR(ReadAndCheckInputs(ctx, attrs, &shape, kCpuCaps));
  KVL_RETURN_IF_ERROR(CheckKvScales(shape, InputData<float>(ctx, GqaInput::kKScale),
                                    InputData<float>(ctx, GqaInput::kVScale)));
  GqaOutputs outputs;
  KVL_RETURN_IF_ERROR(AllocateOutputs(ctx, shape, &outputs));
  GqaBuffers buf = CollectBuffers(ctx, shape, outputs);
  // A node without present outputs still needs the cache for this call's attention.
  std::vector<unsigned char> scratch_k(buf.present_key ? 0 : PresentBytes(shape));
  std::vector<unsigned char> scratch_v(buf.present_value ? 0 : PresentBytes(shape));
  if (!buf.present_key) buf.present_key = scratch_k.data();
  if (!buf.present_value) buf.present_value = scratch_v.data();
  KVL_RETURN_IF_ERROR(CheckSharing(buf));
  KVL_RETURN_IF_ERROR(
      CheckLengthsOnHost(shape, buf.seqlens_k, buf.query_seqlens, buf.position_ids, buf.shared()));
  OrtParallel parallel(ctx);
  parallel.set_threads(EstimateThreads());
  return RunGqaCpu(shape, buf, parallel);
}

}  // namespace

OrtStatusPtr GqaCpuKernel::ComputeV2(OrtKernelContext* context) {
  return GuardedCompute(context, [this](Ort::KernelContext& ctx) { return Compute(ctx, attrs_); });
}

OrtStatusPtr GqaCpuOp::CreateKernelV2(const OrtApi& api, const OrtKernelInfo* info,
                                      void** kernel) const {
  GqaAttributes attrs;
  if (OrtStatusPtr st = ToOrtStatus(ReadGqaAttributes(api, info, &attrs, kCpuCaps))) return st;
  // A knob of the CPU op set to a bad value (core/knobs.h) fails the session's creation. A CPU
  // level the build or the CPU lacks fails each call instead (cpu_isa.h).
  const std::string knob_error = Knobs().ErrorFor(KnobRead::kCpuOnce);
  if (!knob_error.empty()) {
    return ToOrtStatus(Status::Error("ai.kvlayout::GroupQueryAttention (CPU): " + knob_error));
  }
  *kernel = new GqaCpuKernel(attrs);
  return nullptr;
}

}  // namespace kvl
