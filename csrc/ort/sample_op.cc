#include "ort/sample_op.h"

#include <cstdint>
#include <string>
#include <vector>

#include "core/sample_check.h"
#include "cpu/sample_tokens.h"
#include "ort/op_glue.h"
#include "ort/ort_parallel.h"
#include "ort/shape_infer.h"
#if defined(KVL_WITH_CUDA)
#include "cuda/sample_tokens.h"
#endif

namespace kvl {
namespace {

// What both ops' Compute start with: the inputs checked, the output allocated, the pointers.
Status Prepare(Ort::KernelContext& ctx, SampleShape* shape, SampleBuffers* buf) {
  KVL_RETURN_IF_ERROR(CheckSampleInputs(DescribeInputs<kSampleInputCount>(ctx), shape));
  auto in = [&ctx](SampleInput which) {
    return ctx.GetInput(static_cast<size_t>(which)).GetTensorRawData();
  };
  buf->logits = in(SampleInput::kLogits);
  buf->temperature = static_cast<const float*>(in(SampleInput::kTemperature));
  buf->top_k = static_cast<const int32_t*>(in(SampleInput::kTopK));
  buf->top_p = static_cast<const float*>(in(SampleInput::kTopP));
  buf->uniform = static_cast<const float*>(in(SampleInput::kUniform));
  buf->token_ids = ctx.GetOutput(0, shape->output_shape).GetTensorMutableData<int64_t>();
  return Status::Ok();
}

Status ComputeCpu(Ort::KernelContext& ctx) {
  SampleShape shape;
  SampleBuffers buf;
  KVL_RETURN_IF_ERROR(Prepare(ctx, &shape, &buf));
  SampleTokensCpu(shape, buf, OrtParallel(ctx));
  return Status::Ok();
}

#if defined(KVL_WITH_CUDA)
Status ComputeCuda(Ort::KernelContext& ctx) {
  SampleShape shape;
  SampleBuffers buf;
  KVL_RETURN_IF_ERROR(Prepare(ctx, &shape, &buf));
  return LaunchSampleTokens(shape, buf, ctx.GetGPUComputeStream());
}
#endif

}  // namespace

ONNXTensorElementDataType SampleInputType(size_t index) {
  switch (static_cast<SampleInput>(index)) {
    case SampleInput::kTemperature:
    case SampleInput::kTopP:
    case SampleInput::kUniform: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    case SampleInput::kTopK: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // logits: float32, float16, bfloat16
  }
}

// token_ids: int64 of logits.shape[:-1]. Unknown dimensions get names in our namespace (see
// Dim); a logits of unknown rank (ORT gives rank 0) or rank < 2 is left to Compute.
OrtStatusPtr InferSampleOutputShape(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  const OrtApi& api = Ort::GetApi();
  const InputDims logits = ReadInputDims(api, ctx, static_cast<size_t>(SampleInput::kLogits));
  if (!logits.exists || logits.dims.size() < 2) return nullptr;
  std::vector<Dim> dims;
  for (size_t i = 0; i + 1 < logits.dims.size(); ++i) {
    dims.push_back(
        DimAt(logits, i, std::string(kDomain) + ":SampleTokens.logits_dim" + std::to_string(i)));
  }
  return SetOutput(api, ctx, 0, ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, dims);
}

OrtStatusPtr SampleCpuKernel::ComputeV2(OrtKernelContext* context) {
  return GuardedCompute(context, [](Ort::KernelContext& ctx) { return ComputeCpu(ctx); });
}

#if defined(KVL_WITH_CUDA)
OrtStatusPtr SampleCudaKernel::ComputeV2(OrtKernelContext* context) {
  return GuardedCompute(context, [](Ort::KernelContext& ctx) { return ComputeCuda(ctx); });
}
#endif

}  // namespace kvl
