// The one registry of the library's environment knobs: each has a name, a default, a class and a
// line of doc here, and is parsed once per process (Knobs()). docs/KNOBS.md is generated from
// this table (tools/gen_knobs_doc.py) and a test keeps the two equal. Build knobs (CMake
// options) are listed in docs/KNOBS.md from CMakeLists.txt.
#pragma once

#include <cstdint>
#include <string>

namespace kvl {

enum class KnobClass {
  kProduct,     // documented in README; stable
  kDiagnostic,  // for bug reports and tests: forces a path or prints what was chosen
  kTuning,      // benchmarking only; may change or go without notice
};

struct KnobSpec {
  const char* name;
  const char* default_value;
  KnobClass cls;
  const char* values;  // the legal values, as a user writes them
  const char* doc;     // one line
};

// Every environment variable the library reads. Adding one: an entry here, a field in
// KnobValues, its parse in knobs.cc; then regenerate docs/KNOBS.md.
inline constexpr KnobSpec kKnobSpecs[] = {
    {"ORT_KVLAYOUT_CPU_ISA", "auto", KnobClass::kProduct, "auto | portable | avx2 | avx512",
     "CPU kernel level; a level above what the CPU supports makes every CPU call fail, naming it"},
    {"ORT_KVLAYOUT_CUDNN", "1", KnobClass::kProduct, "0 | 1",
     "0 keeps prefill on the library's own CUDA kernels instead of cuDNN's fused attention"},
    {"ORT_KVLAYOUT_CUDNN_LIBRARY", "", KnobClass::kProduct, "a path",
     "libcudnn to open when libcudnn.so.9 is not already loaded or found by the loader"},
    {"ORT_KVLAYOUT_STRICT_LENGTHS", "0", KnobClass::kDiagnostic, "0 | 1",
     "1 checks seqlens_k, query_seqlens and position_ids on the host before each CUDA launch "
     "(synchronizes; no CUDA graph capture)"},
    {"ORT_KVLAYOUT_CUDNN_VERBOSE", "0", KnobClass::kDiagnostic, "0 | 1",
     "1 prints why cuDNN did not build a graph for a prefill shape"},
    {"ORT_KVLAYOUT_CUDNN_MIN_ROWS", "64", KnobClass::kTuning, "a positive integer",
     "first prompts of at least this many new rows go to cuDNN"},
    {"ORT_KVLAYOUT_DECODE_SPLITS", "0", KnobClass::kTuning, "0 | 1..256",
     "key splits per (batch, kv head) of the decode kernel; 0 = the plan's rule"},
    {"ORT_KVLAYOUT_DECODE_CLUSTERS", "1", KnobClass::kDiagnostic, "0 | 1",
     "0 launches decode without thread-block clusters (splits merge in global memory, as on "
     "sm_80)"},
    {"ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS", "1", KnobClass::kDiagnostic, "0 | 1",
     "0 merges rows of more splits than one cluster holds in global memory only (no group "
     "clusters)"},
    {"ORT_KVLAYOUT_DECODE_WIDE", "1", KnobClass::kDiagnostic, "0 | 1",
     "0 keeps the decode kernel at four warps where the plan would take eight (and so turns off "
     "default packed heads)"},
    {"ORT_KVLAYOUT_DECODE_PACKED", "1", KnobClass::kDiagnostic, "0 | 1 | 2",
     "packed heads (one CTA reads whole token rows of all kv heads): 0 never, 1 where the plan's "
     "rule says, 2 wherever they can serve"},
};

// The parsed values, one field per knob above.
struct KnobValues {
  std::string cpu_isa;        // ORT_KVLAYOUT_CPU_ISA, "" for auto (cpu_isa.cc checks the name)
  bool cudnn = true;          // ORT_KVLAYOUT_CUDNN
  std::string cudnn_library;  // ORT_KVLAYOUT_CUDNN_LIBRARY
  bool strict_lengths = false;  // ORT_KVLAYOUT_STRICT_LENGTHS
  bool cudnn_verbose = false;   // ORT_KVLAYOUT_CUDNN_VERBOSE
  int64_t cudnn_min_rows = 64;  // ORT_KVLAYOUT_CUDNN_MIN_ROWS
  int64_t decode_splits = 0;    // ORT_KVLAYOUT_DECODE_SPLITS
  bool decode_clusters = true;  // ORT_KVLAYOUT_DECODE_CLUSTERS
  bool decode_group_clusters = true;  // ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS
  bool decode_wide = true;            // ORT_KVLAYOUT_DECODE_WIDE
  int64_t decode_packed = 1;          // ORT_KVLAYOUT_DECODE_PACKED
  // A knob set to a value outside its `values`: "NAME='v': expected ...", else "". Kernels that
  // read such a knob fail with this message instead of running on a guess.
  std::string error;
};

// Parsed on first use, once per process (thread-safe).
const KnobValues& Knobs();

}  // namespace kvl
