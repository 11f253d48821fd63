// The CPU level a copy of the kernels is compiled for, and the brackets that give a kernel
// header's code that level's instructions. Only the per-level unit gqa_cpu.cc includes the kernel
// headers (simd.h, gqa_call.h, row_io.h, prepare_tasks.h, score_kernels.h, attention_rows.h,
// attention_task.h); CMakeLists.txt compiles it once per level with KVL_ISA_LEVEL = 0 (portable),
// 1 (AVX2 + FMA + F16C) or 2 (AVX-512) and KVL_ISA_NS naming the namespace of that copy.
//
// The level is switched on by a pragma, not by -m flags, and only between KVL_ISA_BEGIN and
// KVL_ISA_END, which every kernel header puts AFTER its includes: functions defined there get the
// level's instructions, while the inline functions and templates of the included headers
// (std::vector's members, dtype.h, softcap.h) keep the baseline ISA. Those are emitted in every
// copy under the same names and the linker keeps one of them; compiled with -mavx512f, the one
// kept could be an AVX-512 copy called from the portable level. Everything between the brackets is
// in kvl::KVL_ISA_NS and an anonymous namespace (one unit includes it), so no two levels share a
// symbol.
#pragma once

#if !defined(KVL_ISA_LEVEL) || !defined(KVL_ISA_NS)
#error "the CPU kernel headers need KVL_ISA_LEVEL and KVL_ISA_NS (see CMakeLists.txt)"
#endif

#if KVL_ISA_LEVEL != 0
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_ps/_si512(), written as a
// self-initialized variable (`__m512 __Y = __Y;`), and -Wmaybe-uninitialized reports that variable
// once per place _mm512_cvtph_ps, _mm512_cvtepi8_epi32 or _mm512_cvtepi32_ps is inlined (about
// 2,300 lines per build). The value is a don't-care source the instruction overwrites (mask all
// ones), so the warning is false (GCC bug 105593, fixed in GCC 13). GCC checks the pragma at the
// warning's location, which is inside these headers: the warning stays on for our own code.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

// (A target pragma does not expand macros: the strings are spelled out per compiler and level.)
#if KVL_ISA_LEVEL == 0
#define KVL_ISA_TARGET_PUSH
#define KVL_ISA_TARGET_POP
#elif KVL_ISA_LEVEL == 1 && defined(__clang__)
// clang-format off
#define KVL_ISA_TARGET_PUSH _Pragma("clang attribute push(__attribute__((target(\"avx,avx2,fma,f16c\"))), apply_to = function)")
// clang-format on
#define KVL_ISA_TARGET_POP _Pragma("clang attribute pop")
#elif KVL_ISA_LEVEL == 1
#define KVL_ISA_TARGET_PUSH _Pragma("GCC push_options") _Pragma("GCC target(\"avx,avx2,fma,f16c\")")
#define KVL_ISA_TARGET_POP _Pragma("GCC pop_options")
#elif KVL_ISA_LEVEL == 2 && defined(__clang__)
// clang-format off
#define KVL_ISA_TARGET_PUSH _Pragma("clang attribute push(__attribute__((target(\"avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq\"))), apply_to = function)")
// clang-format on
#define KVL_ISA_TARGET_POP _Pragma("clang attribute pop")
#elif KVL_ISA_LEVEL == 2
#define KVL_ISA_TARGET_PUSH   \
  _Pragma("GCC push_options") \
      _Pragma("GCC target(\"avx,avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq\")")
#define KVL_ISA_TARGET_POP _Pragma("GCC pop_options")
#else
#error "KVL_ISA_LEVEL must be 0, 1 or 2"
#endif

#define KVL_ISA_BEGIN    \
  KVL_ISA_TARGET_PUSH    \
  namespace kvl {        \
  namespace KVL_ISA_NS { \
  namespace {
#define KVL_ISA_END \
  }                 \
  }                 \
  }                 \
  KVL_ISA_TARGET_POP
