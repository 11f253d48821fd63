// The host side of the device-side length records (core/length_rules.h): every CUDA kernel
// instance registers its record here, reads and clears it at the start of each Run, and the
// exported OrtKvlayoutTakeLengthError reads and clears all of them for the Python package
// (ort_kvlayout.take_length_error), which a CUDA graph replay needs: a replay runs no host code
// of the op. Plain C++, no CUDA: a build without CUDA exports the same function, which then
// always reports nothing.
#pragma once

#include <string>

#include "core/length_rules.h"
#include "core/status.h"

namespace kvl {

// Registers `record` (host address) under the node's name for its lifetime.
class RegisteredLengthRecord {
 public:
  RegisteredLengthRecord(LengthRecord* record, std::string node_name);
  ~RegisteredLengthRecord();
  RegisteredLengthRecord(const RegisteredLengthRecord&) = delete;
  RegisteredLengthRecord& operator=(const RegisteredLengthRecord&) = delete;

  // An error with the CPU op's message when a violation was recorded (and clears the record);
  // Ok otherwise. Does not synchronize: a violation whose kernel has not finished yet is
  // reported by a later Run (or the Python call).
  Status Take() const;

 private:
  LengthRecord* record_;
};

}  // namespace kvl

// Takes the first recorded length violation over all live CUDA op instances of the process
// (the earliest-created instance that holds one) and clears every instance's record. Writes
// its message, NUL-terminated and cut to `size` bytes, to `buffer`; returns the message's full
// length, 0 when nothing was recorded. Does not synchronize: call it after the step's work is
// known to be done (e.g. after its outputs were copied to the host).
extern "C" __attribute__((visibility("default"))) size_t OrtKvlayoutTakeLengthError(char* buffer,
                                                                                    size_t size);
