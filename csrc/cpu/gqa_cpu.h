// CPU GroupQueryAttention: float32/float16/bfloat16 storage, float32 accumulation, threaded over
// (batch, kv head, query block, key split) tasks. The cache is indexed only through KvStrides.
#pragma once

#include <cstdint>

#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "core/status.h"
#include "cpu/thread_pool.h"

namespace kvl {

// On CPU every pointer of GqaBuffers is host memory.
using GqaCpuBuffers = GqaBuffers;

// Runs the op. The caller has validated shapes (CheckGqaInputs) and lengths (CheckLengthsOnHost).
// When present_key == past_key the new rows are appended in place.
Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel);

}  // namespace kvl
