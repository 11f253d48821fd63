// RunGqaCpu: calls the copy of the kernels (gqa_cpu.cc, one per CPU level) that ChosenCpuIsa
// picked. Compiled for the baseline ISA.
#include "cpu/cpu_isa.h"
#include "cpu/gqa_cpu.h"

namespace kvl {

Status RunGqaCpu(const GqaShape& shape, const GqaCpuBuffers& buffers, const Parallel& parallel) {
  const CpuIsaChoice& choice = ChosenCpuIsa();
  if (!choice.error.empty()) return Status::Error(choice.error);
  switch (choice.isa) {
#if defined(KVL_CPU_ISA_AVX512)
    case CpuIsa::kAvx512: return isa_avx512::RunGqaCpu(shape, buffers, parallel);
#endif
#if defined(KVL_CPU_ISA_AVX2)
    case CpuIsa::kAvx2: return isa_avx2::RunGqaCpu(shape, buffers, parallel);
#endif
    default: return isa_portable::RunGqaCpu(shape, buffers, parallel);
  }
}

}  // namespace kvl
