// Environment variables the library reads as tuning and benchmarking knobs: one rule per kind
// of value, so every knob of a kind parses alike.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kvl {

// A positive integer from `name`, or 0 when it is unset or not one (a knob that sets a count).
inline int64_t EnvPositiveInt(const char* name) {
  const char* v = std::getenv(name);
  char* end = nullptr;
  const long long n = v != nullptr ? std::strtoll(v, &end, 10) : 0;
  return (v != nullptr && end != v && *end == '\0' && n > 0) ? int64_t(n) : int64_t(0);
}

// False only when `name` is exactly "0" (a knob that turns a fast path off).
inline bool EnvNotZero(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::strcmp(v, "0") != 0;
}

}  // namespace kvl
