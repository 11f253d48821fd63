// The one registry of the library's environment knobs: each has a name, a default, a class, the
// values it takes, who reads it and when, and a line of doc, and is parsed in one place
// (knobs.cc). docs/KNOBS.md is generated from this table (scripts/gen_knobs_doc.py, through
// ort_kvlayout._C.knobs()) with the build knobs beside it, and tests/op/test_knobs.py keeps the two
// equal.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kvl {

enum class KnobClass {
  kProduct,     // documented in README; stable
  kDiagnostic,  // for bug reports and tests: forces a path or prints what was chosen
  kTuning,      // benchmarking only; may change or go without notice
};

// Who reads a knob, and when: a knob read once keeps its first value for the process.
enum class KnobRead {
  kCpuOnce,          // the CPU op, once per process
  kCudaOnce,         // the CUDA op, once per process
  kCudaOpCreation,   // the CUDA op, each time one is created (a session's nodes)
};

struct KnobSpec {
  const char* name;
  const char* default_value;
  KnobClass cls;
  KnobRead read;
  const char* values;  // the legal values, as a user writes them
  const char* doc;     // one line
};

// Every environment variable the library reads. Adding one: an entry here, a field in
// KnobValues, its parse in knobs.cc; then regenerate docs/KNOBS.md.
inline constexpr KnobSpec kKnobSpecs[] = {
    {"ORT_KVLAYOUT_CPU_ISA", "auto", KnobClass::kProduct, KnobRead::kCpuOnce,
     "auto | portable | avx2 | avx512",
     "CPU kernel level; a level the build or the CPU lacks makes every CPU call fail, naming it"},
    {"ORT_KVLAYOUT_CUDNN", "1", KnobClass::kProduct, KnobRead::kCudaOnce, "0 | 1",
     "0 keeps prefill on the library's own CUDA kernels instead of cuDNN's fused attention"},
    {"ORT_KVLAYOUT_CUDNN_LIBRARY", "", KnobClass::kProduct, KnobRead::kCudaOnce, "a path",
     "libcudnn to open when libcudnn.so.9 is not already loaded or found by the loader"},
    {"ORT_KVLAYOUT_STRICT_LENGTHS", "0", KnobClass::kDiagnostic, KnobRead::kCudaOpCreation,
     "0 | 1",
     "1 checks seqlens_k, query_seqlens and position_ids on the host before each CUDA launch "
     "(synchronizes; no CUDA graph capture)"},
    {"ORT_KVLAYOUT_CUDNN_VERBOSE", "0", KnobClass::kDiagnostic, KnobRead::kCudaOnce, "0 | 1",
     "1 prints to stderr why cuDNN did not build a graph for a prefill shape"},
    {"ORT_KVLAYOUT_CUDNN_MIN_ROWS", "64", KnobClass::kTuning, KnobRead::kCudaOnce,
     "1 .. 2^30", "first prompts of at least this many new rows go to cuDNN"},
    {"ORT_KVLAYOUT_DECODE_SPLITS", "0", KnobClass::kTuning, KnobRead::kCudaOnce, "0 .. 256",
     "key splits per (batch, kv head) of the decode kernel; 0 = the plan's rule"},
    {"ORT_KVLAYOUT_DECODE_CLUSTERS", "1", KnobClass::kDiagnostic, KnobRead::kCudaOnce, "0 | 1",
     "0 launches decode without thread-block clusters (splits merge in global memory, as on "
     "sm_80)"},
    {"ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS", "1", KnobClass::kDiagnostic, KnobRead::kCudaOnce,
     "0 | 1",
     "0 merges rows of more splits than one cluster holds in global memory only (no group "
     "clusters)"},
    {"ORT_KVLAYOUT_DECODE_WIDE", "1", KnobClass::kDiagnostic, KnobRead::kCudaOnce, "0 | 1",
     "0 keeps the decode kernel at four warps where the plan would take eight (and so turns off "
     "default packed heads)"},
    {"ORT_KVLAYOUT_DECODE_PACKED", "1", KnobClass::kDiagnostic, KnobRead::kCudaOnce, "0 | 1 | 2",
     "packed heads (one CTA reads whole token rows of all kv heads): 0 never, 1 where the plan's "
     "rule says, 2 wherever they can serve"},
    {"ORT_KVLAYOUT_DECODE_QUANT_PLAN", "bytes", KnobClass::kTuning, KnobRead::kCudaOnce,
     "bytes | fp16",
     "the quantized decode's plan: bytes (its own, from the bytes it reads: codes and static "
     "scales) or fp16 (a cache of T's plan, for comparison)"},
};
inline constexpr size_t kKnobCount = sizeof(kKnobSpecs) / sizeof(kKnobSpecs[0]);

// The parsed values, one field per knob above. A knob that is unset or set to "" takes its
// default; one set to a value outside its `values` keeps the default here and is named in
// `error`, which the op that reads it reports instead of running on a guess.
struct KnobValues {
  std::string cpu_isa;                // ORT_KVLAYOUT_CPU_ISA, "" for auto (cpu_isa.cc checks it)
  bool cudnn = true;                  // ORT_KVLAYOUT_CUDNN
  std::string cudnn_library;          // ORT_KVLAYOUT_CUDNN_LIBRARY
  bool strict_lengths = false;        // ORT_KVLAYOUT_STRICT_LENGTHS
  bool cudnn_verbose = false;         // ORT_KVLAYOUT_CUDNN_VERBOSE
  int64_t cudnn_min_rows = 64;        // ORT_KVLAYOUT_CUDNN_MIN_ROWS
  int64_t decode_splits = 0;          // ORT_KVLAYOUT_DECODE_SPLITS
  bool decode_clusters = true;        // ORT_KVLAYOUT_DECODE_CLUSTERS
  bool decode_group_clusters = true;  // ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS
  bool decode_wide = true;            // ORT_KVLAYOUT_DECODE_WIDE
  int64_t decode_packed = 1;          // ORT_KVLAYOUT_DECODE_PACKED
  bool decode_quant_bytes = true;     // ORT_KVLAYOUT_DECODE_QUANT_PLAN: bytes (or fp16)

  // The bad knobs among those read once per process, each "environment variable NAME must be
  // RULE, got 'v'", joined by "; "; "" when all are good. (A knob read at op creation is checked
  // there, on the environment of that moment: ReadKnobs().ErrorFor(...).)
  std::string error;
  std::array<std::string, kKnobCount> errors;  // every bad knob's message, per entry of kKnobSpecs

  // The bad knobs among those read as `read` says, joined by "; ".
  std::string ErrorFor(KnobRead read) const;
};

// The environment parsed on first use, once per process (thread-safe): what every knob read
// once per process uses.
const KnobValues& Knobs();

// The environment parsed now: for the knobs read at op creation (KnobRead::kCudaOpCreation).
KnobValues ReadKnobs();

}  // namespace kvl
