// Parses the environment knobs of knobs.h once per process.
#include "core/knobs.h"

#include <cstdlib>
#include <cstring>

namespace kvl {
namespace {

const char* Get(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

void Bad(KnobValues* k, const char* name, const char* value, const char* rule) {
  if (!k->error.empty()) return;  // the first bad knob is the one reported
  k->error = std::string(name) + "='" + value + "': expected " + rule;
}

void ReadBool(KnobValues* k, const char* name, bool* out) {
  const char* v = Get(name);
  if (v == nullptr) return;
  if (std::strcmp(v, "0") == 0) {
    *out = false;
  } else if (std::strcmp(v, "1") == 0) {
    *out = true;
  } else {
    Bad(k, name, v, "0 or 1");
  }
}

void ReadInt(KnobValues* k, const char* name, int64_t lo, int64_t hi, int64_t* out) {
  const char* v = Get(name);
  if (v == nullptr) return;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < lo || n > hi) {
    Bad(k, name, v, ("an integer from " + std::to_string(lo) + " to " + std::to_string(hi)).c_str());
    return;
  }
  *out = n;
}

KnobValues Parse() {
  KnobValues k;
  if (const char* v = Get("ORT_KVLAYOUT_CPU_ISA")) k.cpu_isa = std::strcmp(v, "auto") ? v : "";
  ReadBool(&k, "ORT_KVLAYOUT_CUDNN", &k.cudnn);
  if (const char* v = Get("ORT_KVLAYOUT_CUDNN_LIBRARY")) k.cudnn_library = v;
  ReadBool(&k, "ORT_KVLAYOUT_STRICT_LENGTHS", &k.strict_lengths);
  ReadBool(&k, "ORT_KVLAYOUT_CUDNN_VERBOSE", &k.cudnn_verbose);
  ReadInt(&k, "ORT_KVLAYOUT_CUDNN_MIN_ROWS", 1, int64_t(1) << 30, &k.cudnn_min_rows);
  ReadInt(&k, "ORT_KVLAYOUT_DECODE_SPLITS", 0, 256, &k.decode_splits);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_CLUSTERS", &k.decode_clusters);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS", &k.decode_group_clusters);
  ReadBool(&k, "ORT_KVLAYOUT_DECODE_WIDE", &k.decode_wide);
  ReadInt(&k, "ORT_KVLAYOUT_DECODE_PACKED", 0, 2, &k.decode_packed);
  return k;
}

}  // namespace

const KnobValues& Knobs() {
  static const KnobValues values = Parse();
  return values;
}

}  // namespace kvl
