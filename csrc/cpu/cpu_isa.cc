// Compiled for the baseline ISA (no -m flags): it runs before any level is chosen.
#include "cpu/cpu_isa.h"

#include <cstdint>

#include "core/knobs.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define KVL_X86_64 1
#endif

namespace kvl {
namespace {

#if defined(KVL_X86_64)
// XCR0: which register states the OS saves on a context switch. AVX needs XMM|YMM (bits 1-2);
// AVX-512 also opmask, ZMM_Hi256 and Hi16_ZMM (bits 5-7). CPUID alone says only what the
// silicon has; a kernel without XSAVE support for the state would fault on the first use.
uint64_t EnabledXState() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_OSXSAVE)) return 0;
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));  // _xgetbv needs -mxsave
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

bool CpuHasAvx2() {
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;  // F16C: CPUID.1:ECX bit 29
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c &&
         (EnabledXState() & 0x6) == 0x6;
}

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return CpuHasAvx2() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq") && (EnabledXState() & 0xe6) == 0xe6;
}
#endif

bool Built(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kPortable: return true;
#if defined(KVL_CPU_ISA_AVX2)
    case CpuIsa::kAvx2: return true;
#endif
#if defined(KVL_CPU_ISA_AVX512)
    case CpuIsa::kAvx512: return true;
#endif
    default: return false;
  }
}

std::string LevelList() {
  std::string out;
  for (CpuIsa isa : BuiltCpuIsas()) out += (out.empty() ? "" : ", ") + std::string(CpuIsaName(isa));
  return out;
}

CpuIsaChoice Choose() {
  CpuIsaChoice choice;
  const CpuIsa best = BestSupportedCpuIsa();
  choice.isa = best;
  const std::string& want = Knobs().cpu_isa;  // "" for auto
  if (want.empty()) return choice;
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (want != CpuIsaName(isa)) continue;
    if (!Built(isa)) {
      choice.error = "ORT_KVLAYOUT_CPU_ISA=" + want + ": this library was built with the CPU " +
                     "levels " + LevelList() + " only";
    } else if (static_cast<int>(isa) > static_cast<int>(best)) {
      choice.error = "ORT_KVLAYOUT_CPU_ISA=" + want + ": this CPU (or its OS) does not support " +
                     "it; the highest level it supports is " + CpuIsaName(best);
    } else {
      choice.isa = isa;
    }
    return choice;
  }
  choice.error = "ORT_KVLAYOUT_CPU_ISA='" + want + "' is not a CPU level: use auto, " + LevelList();
  return choice;
}

}  // namespace

const char* CpuIsaName(CpuIsa isa) {
  static constexpr const char* kNames[] = {"portable", "avx2", "avx512"};  // by CpuIsa's value
  const int i = static_cast<int>(isa);
  return i >= 0 && i < 3 ? kNames[i] : "?";
}

std::vector<CpuIsa> BuiltCpuIsas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (Built(isa)) out.push_back(isa);
  }
  return out;
}

CpuIsa BestSupportedCpuIsa() {
#if defined(KVL_X86_64)
  if (Built(CpuIsa::kAvx512) && CpuHasAvx512()) return CpuIsa::kAvx512;
  if (Built(CpuIsa::kAvx2) && CpuHasAvx2()) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kPortable;
}

const CpuIsaChoice& ChosenCpuIsa() {
  static const CpuIsaChoice choice = Choose();  // thread-safe, once per process
  return choice;
}

}  // namespace kvl
