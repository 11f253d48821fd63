// The wording of the ops' error messages: one shape notation and one "op: what" form for every
// check (core/check_inputs.cc, core/sample_check.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/status.h"

namespace kvl {

// "(2, 3)"; a one-element shape "(4,)", as numpy and ORT write it.
inline std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

// An error whose message is `op` (e.g. "ai.kvlayout::SampleTokens: ") followed by `parts`.
template <typename... Args>
Status OpError(const char* op, Args&&... parts) {
  std::ostringstream out;
  out << op;
  (out << ... << std::forward<Args>(parts));
  return Status::Error(out.str());
}

// How each op's messages start, and its errors.
constexpr const char* kGqaOp = "ai.kvlayout::GroupQueryAttention: ";
constexpr const char* kSampleOp = "ai.kvlayout::SampleTokens: ";

template <typename... Args>
Status GqaError(Args&&... parts) {
  return OpError(kGqaOp, std::forward<Args>(parts)...);
}

template <typename... Args>
Status SampleError(Args&&... parts) {
  return OpError(kSampleOp, std::forward<Args>(parts)...);
}

}  // namespace kvl
