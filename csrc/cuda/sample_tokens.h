// ai.kvlayout::SampleTokens on CUDA: the launcher, callable from plain C++ (no CUDA headers).
#pragma once

#include "core/sample_types.h"
#include "core/status.h"

namespace kvl {

// Enqueues the op on `stream` (a cudaStream_t): one kernel launch, one CTA per row (a grid-stride
// loop past 65536 rows). Every pointer of `buffers` is device memory, and every per-row value is
// read on the device; nothing is allocated, copied or synchronized, so the launch is valid under
// CUDA graph capture and its replays read each call's values. Chooses the CPU kernel's token
// (core/sample_rule.h). The only error is a failed launch.
Status LaunchSampleTokens(const SampleShape& shape, const SampleBuffers& buffers, void* stream);

}  // namespace kvl
