// Input validation of ai.kvlayout::SampleTokens, shared by the CPU and CUDA ops: shapes and
// types only. The per-row parameter values are never an error of the call: an invalid row gets
// token -2 (sample_rule.h), since on CUDA the values are only seen on the device.
#pragma once

#include "core/sample_types.h"
#include "core/status.h"

namespace kvl {

// logits: float32, float16 or bfloat16, rank >= 2, a last dimension (the vocabulary) in
// [1, INT32_MAX]; temperature, top_p, uniform: float32, top_k: int32, each with one element per
// row (numel(logits) / vocab), of any shape. Fills `shape` on success; the message of a failure
// names the input, the rule and what the call brought.
Status CheckSampleInputs(const SampleInputInfos& inputs, SampleShape* shape);

}  // namespace kvl
