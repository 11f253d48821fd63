// ai.kvlayout::SampleTokens' vocabulary: its inputs named once, the checked shape of a call, and
// the buffers of a call (host memory for the CPU op, device memory for the CUDA op).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/gqa_types.h"  // DType, TensorInfo

namespace kvl {

enum class SampleInput : int {
  kLogits = 0,   // T (float32, float16, bfloat16), (..., vocab)
  kTemperature,  // float32, one per row
  kTopK,         // int32, one per row
  kTopP,         // float32, one per row
  kUniform,      // float32, one per row: the row's random number in [0, 1)
  kCount
};
constexpr int kSampleInputCount = static_cast<int>(SampleInput::kCount);

const char* SampleInputName(SampleInput input);

using SampleInputInfos = std::array<TensorInfo, kSampleInputCount>;

// A call's shape, filled by CheckSampleInputs.
struct SampleShape {
  DType dtype = DType::kUndefined;    // of logits
  int64_t rows = 0;                   // numel(logits) / vocab: one token each
  int64_t vocab = 0;                  // logits.shape[-1], in [1, INT32_MAX]
  std::vector<int64_t> output_shape;  // logits.shape[:-1]
};

// The pointers of one call; every per-row array holds `rows` elements, in row order.
struct SampleBuffers {
  const void* logits = nullptr;  // (rows, vocab) of SampleShape::dtype, contiguous
  const float* temperature = nullptr;
  const int32_t* top_k = nullptr;
  const float* top_p = nullptr;
  const float* uniform = nullptr;
  int64_t* token_ids = nullptr;  // output, (rows)
};

}  // namespace kvl
