// Parallel (cpu/thread_pool.h) on ORT's intra-op thread pool, for the CPU ops' kernels.
#pragma once

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <cstddef>

#include "cpu/thread_pool.h"

namespace kvl {

// Runs tasks on ORT's intra-op thread pool (KernelContext::ParallelFor).
class OrtParallel final : public Parallel {
 public:
  explicit OrtParallel(Ort::KernelContext& ctx) : ctx_(ctx) {}
  void For(size_t n, TaskFn fn, void* state) const override {
    if (n == 0) return;
    if (n == 1) {
      fn(state, 0);
      return;
    }
    ctx_.ParallelFor(fn, n, n, state);
  }
  // ORT does not expose its pool size to custom ops: what the caller estimated (set_threads).
  int NumThreads() const override { return threads_; }
  void set_threads(int threads) { threads_ = threads; }

 private:
  Ort::KernelContext& ctx_;
  int threads_ = 1;
};

}  // namespace kvl
