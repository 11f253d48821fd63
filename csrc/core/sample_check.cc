#include "core/sample_check.h"

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/messages.h"

namespace kvl {
namespace {

// A per-row input: its element type and one element per row.
Status CheckPerRow(const SampleInputInfos& inputs, SampleInput which, DType dtype,
                   const SampleShape& s, const std::vector<int64_t>& logits_shape) {
  const TensorInfo& t = inputs[static_cast<int>(which)];
  if (t.dtype != dtype) {
    return SampleError("input '", SampleInputName(which), "' must be ", DTypeName(dtype), ", got ",
                       DTypeName(t.dtype));
  }
  if (t.NumElements() != s.rows) {
    return SampleError("input '", SampleInputName(which),
                       "' must hold one value per row of 'logits' (", s.rows,
                       " rows: logits has shape ", ShapeString(logits_shape),
                       ", rows = numel / vocab), got shape ", ShapeString(t.shape), " with ",
                       t.NumElements(), " elements");
  }
  return Status::Ok();
}

}  // namespace

const char* SampleInputName(SampleInput input) {
  static constexpr const char* kNames[kSampleInputCount] = {"logits", "temperature", "top_k",
                                                            "top_p", "uniform"};
  return kNames[static_cast<int>(input)];
}

Status CheckSampleInputs(const SampleInputInfos& inputs, SampleShape* shape) {
  for (int i = 0; i < kSampleInputCount; ++i) {
    if (!inputs[i].exists) {
      return SampleError("input '", SampleInputName(static_cast<SampleInput>(i)), "' is required");
    }
  }
  const TensorInfo& logits = inputs[static_cast<int>(SampleInput::kLogits)];
  SampleShape s;
  s.dtype = logits.dtype;
  if (s.dtype != DType::kFloat32 && s.dtype != DType::kFloat16 && s.dtype != DType::kBFloat16) {
    return SampleError("input 'logits' must be float32, float16 or bfloat16, got ",
                       DTypeName(logits.dtype));
  }
  if (logits.shape.size() < 2) {
    return SampleError(
        "input 'logits' must have rank >= 2, (..., vocab): one token per row of the ",
        "last dimension; got shape ", ShapeString(logits.shape));
  }
  s.vocab = logits.shape.back();
  if (s.vocab < 1 || s.vocab > std::numeric_limits<int32_t>::max()) {
    return SampleError("input 'logits' must have a last dimension (the vocabulary) in [1, ",
                       std::numeric_limits<int32_t>::max(), "] (token ids are int32 inside the ",
                       "kernels), got shape ", ShapeString(logits.shape));
  }
  s.output_shape.assign(logits.shape.begin(), logits.shape.end() - 1);
  s.rows = 1;
  for (int64_t d : s.output_shape) s.rows *= d;
  KVL_RETURN_IF_ERROR(
      CheckPerRow(inputs, SampleInput::kTemperature, DType::kFloat32, s, logits.shape));
  KVL_RETURN_IF_ERROR(CheckPerRow(inputs, SampleInput::kTopK, DType::kInt32, s, logits.shape));
  KVL_RETURN_IF_ERROR(CheckPerRow(inputs, SampleInput::kTopP, DType::kFloat32, s, logits.shape));
  KVL_RETURN_IF_ERROR(CheckPerRow(inputs, SampleInput::kUniform, DType::kFloat32, s, logits.shape));
  *shape = std::move(s);
  return Status::Ok();
}

}  // namespace kvl
