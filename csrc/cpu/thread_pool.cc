#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace kvl {

StdThreadParallel::StdThreadParallel(int threads) {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = threads > 0 ? threads : hw;
}

void StdThreadParallel::For(size_t n, TaskFn fn, void* state) const {
  const size_t workers = std::min<size_t>(static_cast<size_t>(threads_), n);
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) fn(state, i);
    return;
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(state, i);
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace kvl
