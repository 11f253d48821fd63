// Parses the environment knobs of knobs.h.
#include "core/knobs.h"

#include <cstdlib>
#include <cstring>

namespace kvl {
namespace {

size_t IndexOf(const char* name) {
  for (size_t i = 0; i < kKnobCount; ++i) {
    if (std::strcmp(kKnobSpecs[i].name, name) == 0) return i;
  }
  std::abort();  // a parse below names a knob missing from kKnobSpecs
}

// The knob's value, or nullptr when it is unset or "" (its default).
const char* Get(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

void Bad(KnobValues* k, const char* name, const char* value, const std::string& rule) {
  k->errors[IndexOf(name)] =
      std::string("environment variable ") + name + " must be " + rule + ", got '" + value + "'";
}

void ReadString(const char* name, std::string* out) {
  if (const char* v = Get(name)) *out = v;
}

void ReadBool(KnobValues* k, const char* name, bool* out) {
  const char* v = Get(name);
  if (v == nullptr) return;
  if (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0) {
    *out = v[0] == '1';
  } else {
    Bad(k, name, v, "0 or 1");
  }
}

// A knob of two named values: `yes` sets *out, `no` clears it.
void ReadChoice(KnobValues* k, const char* name, const char* yes, const char* no, bool* out) {
  const char* v = Get(name);
  if (v == nullptr) return;
  if (std::strcmp(v, yes) == 0 || std::strcmp(v, no) == 0) {
    *out = std::strcmp(v, yes) == 0;
  } else {
    Bad(k, name, v, std::string(yes) + " or " + no);
  }
}

void ReadInt(KnobValues* k, const char* name, int64_t lo, int64_t hi, int64_t* out) {
  const char* v = Get(name);
  if (v == nullptr) return;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < lo || n > hi) {
    Bad(k, name, v, "an integer from " + std::to_string(lo) + " to " + std::to_string(hi));
    return;
  }
  *out = n;
}

}  // namespace

std::string KnobValues::ErrorFor(KnobRead read) const {
  std::string out;
  for (size_t i = 0; i < kKnobCount; ++i) {
    if (errors[i].empty() || kKnobSpecs[i].read != read) continue;
    out += (out.empty() ? "" : "; ") + errors[i];
  }
  return out;
}

KnobValues ReadKnobs() {
  KnobValues k;
  ReadString("ORT_KVLAYOUT_CPU_ISA", &k.cpu_isa);
  if (k.cpu_isa == "auto") k.cpu_isa.clear();
  ReadBool(&k, "ORT_KVLAYOUT_CUDNN", &k.cudnn);
  ReadString("ORT_KVLAYOUT_CUDNN_LIBRARY", &k.cudnn_library);
  ReadBool(&k, "ORT_KVLAYOUT_STRICT_LENGTHS", &k.strict_lengths);
  ReadBool(&k, "ORT_KVLAYOUT_CUDNN_VERBOSE", &k.cudnn_verbose);
  ReadInt(&k, "ORT_KVLAYOUT_CUDNN_MIN_ROWS", 1, int64_t(1) << 30, &k.cudnn_min_rows);
  ReadInt(&k, "ORT_KVLAYOUT_DECODE_SPLITS", 0, 256, &k.decode_splits);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_CLUSTERS", &k.decode_clusters);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS", &k.decode_group_clusters);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_WIDE", &k.decode_wide);
  ReadInt(&k, "ORT_KVLAYOUT_DECODE_PACKED", 0, 2, &k.decode_packed);
  ReadChoice(&k, "ORT_KVLAYOUT_DECODE_QUANT_PLAN", "bytes", "fp16", &k.decode_quant_bytes);
  for (KnobRead once : {KnobRead::kCpuOnce, KnobRead::kCudaOnce}) {
    const std::string e = k.ErrorFor(once);
    if (!e.empty()) k.error += (k.error.empty() ? "" : "; ") + e;
  }
  return k;
}

const KnobValues& Knobs() {
  static const KnobValues values = ReadKnobs();
  return values;
}

}  // namespace kvl
