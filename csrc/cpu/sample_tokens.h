// ai.kvlayout::SampleTokens on the CPU: one token per row of logits, by the rule of
// core/sample_rule.h (docs/CONTRACT.md section 15), the same token as the CUDA kernel.
#pragma once

#include "core/sample_types.h"
#include "cpu/thread_pool.h"

namespace kvl {

// Writes buffers.token_ids[r] for every row r, rows in parallel on `parallel`. `shape` was
// checked by CheckSampleInputs; every pointer is host memory. Never fails: a row with a
// non-finite logit gets -1, a row with invalid parameters -2.
void SampleTokensCpu(const SampleShape& shape, const SampleBuffers& buffers,
                     const Parallel& parallel);

}  // namespace kvl
