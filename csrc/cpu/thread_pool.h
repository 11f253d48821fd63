// Parallel loop abstraction: the ORT op runs tasks on ORT's intra-op pool
// (KernelContext::ParallelFor); the pybind11 entry point uses a plain std::thread loop.
#pragma once

#include <cstddef>

namespace kvl {

using TaskFn = void (*)(void* state, size_t task);

class Parallel {
 public:
  virtual ~Parallel() = default;
  // Runs fn(state, i) for every i in [0, n); returns when all are done.
  virtual void For(size_t n, TaskFn fn, void* state) const = 0;
  virtual int NumThreads() const = 0;
};

// std::thread workers pulling tasks from an atomic counter; `threads` <= 0 means all cores.
class StdThreadParallel final : public Parallel {
 public:
  explicit StdThreadParallel(int threads = 0);
  void For(size_t n, TaskFn fn, void* state) const override;
  int NumThreads() const override { return threads_; }

 private:
  int threads_;
};

}  // namespace kvl
