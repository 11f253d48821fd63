// x86-64 instruction-set levels of the CPU kernels. gqa_cpu.cc is compiled once per level built
// (CMakeLists.txt), each copy in its own namespace (kvl::isa_portable, kvl::isa_avx2,
// kvl::isa_avx512); RunGqaCpu (gqa_cpu_dispatch.cc) calls the level chosen once per process:
// the best the CPU and OS support, or a lower one forced by ORT_KVLAYOUT_CPU_ISA.
#pragma once

#include <string>
#include <vector>

namespace kvl {

enum class CpuIsa : int {
  kPortable = 0,  // the compiler's baseline (x86-64: SSE2, 4-float vectors)
  kAvx2 = 1,      // AVX2 + FMA + F16C, 8-float vectors
  kAvx512 = 2,    // AVX-512 F/BW/VL/DQ + AVX2 + FMA + F16C, 16-float vectors
};

// "portable", "avx2", "avx512": the names ORT_KVLAYOUT_CPU_ISA takes.
const char* CpuIsaName(CpuIsa isa);

// The levels compiled into this library, lowest first (portable only off x86-64).
std::vector<CpuIsa> BuiltCpuIsas();

// The highest built level whose instructions this CPU has and whose register state the OS saves.
CpuIsa BestSupportedCpuIsa();

// The level the kernels run at, decided at the first call and kept for the process: the best
// supported, or ORT_KVLAYOUT_CPU_ISA when set ("auto" or empty: the best). A value that is not a
// level name, not built, or above the best supported is refused: `error` says why and every
// CPU kernel call returns it (no silent fallback that would make a forced measurement lie).
struct CpuIsaChoice {
  CpuIsa isa = CpuIsa::kPortable;
  std::string error;  // empty: isa is in use
};
const CpuIsaChoice& ChosenCpuIsa();

}  // namespace kvl
