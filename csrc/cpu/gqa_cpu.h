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
// When present_key == past_key the new rows are appended in place. Runs the kernels of the CPU
// level chosen for the process (cpu_isa.h); returns an error when ORT_KVLAYOUT_CPU_ISA was refused.
Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel);

// The same, at one level: gqa_cpu.cc compiled with KVL_ISA_NS = isa_portable, isa_avx2 or
// isa_avx512 (only the levels built for the target are defined). Call these only through
// RunGqaCpu: a level above the CPU's faults.
#define KVL_DECLARE_CPU_LEVEL(ns)                                                          \
  namespace ns {                                                                          \
  Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel); \
  }
KVL_DECLARE_CPU_LEVEL(isa_portable)
KVL_DECLARE_CPU_LEVEL(isa_avx2)
KVL_DECLARE_CPU_LEVEL(isa_avx512)
#undef KVL_DECLARE_CPU_LEVEL

}  // namespace kvl
