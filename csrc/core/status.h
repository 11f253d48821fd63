// Status: the error type of every core and kernel function. No exceptions cross the C API.
#pragma once

#include <string>
#include <utility>

namespace kvl {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }

  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message)
      : message_(message.empty() ? std::string("unknown error") : std::move(message)) {}
  std::string message_;
};

}  // namespace kvl

#define KVL_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::kvl::Status kvl_status__ = (expr);     \
    if (!kvl_status__.ok()) return kvl_status__; \
  } while (0)
