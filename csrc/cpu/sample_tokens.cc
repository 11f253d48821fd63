// Built with -ffp-contract=off (CMakeLists.txt): the weights of core/sample_rule.h must round as
// the CUDA kernel's do.
#include "cpu/sample_tokens.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/sample_rule.h"

namespace kvl {
namespace {

// One element of a row in the contract's order: its key in the high word and the complement of
// its index in the low word, so that a greater `order` goes first: the greater logit, and of
// equal logits the lower index.
struct Entry {
  uint64_t order;
  uint64_t weight;  // sample::FixedWeight, set for the top-K elements only
};

bool Before(const Entry& a, const Entry& b) { return a.order > b.order; }
uint64_t OrderOf(float x, uint32_t index) {
  return (uint64_t{sample::OrderKey(x)} << 32) | static_cast<uint32_t>(~index);
}
uint32_t IndexOf(uint64_t order) { return ~static_cast<uint32_t>(order); }
float ValueOf(uint64_t order) { return sample::KeyValue(static_cast<uint32_t>(order >> 32)); }

struct RowParams {
  float temperature;
  int32_t top_k;
  float top_p;
  float uniform;
};

// The length j of the shortest prefix of e[0, k) in the contract's order whose weight reaches
// `target` (1 <= target <= the weight of all k). e[0, k) ends up holding that prefix first.
// A selection by halves: each round partitions the range that holds the cut at its middle
// (nth_element) and keeps the half the cut is in, so the whole costs O(k), not a sort.
size_t CutForMass(Entry* e, size_t k, uint64_t target) {
  size_t lo = 0, hi = k;
  uint64_t above = 0;  // the weight of e[0, lo): below target; that of e[0, hi) reaches it
  while (hi - lo > 32) {
    const size_t mid = lo + (hi - lo) / 2;
    std::nth_element(e + lo, e + mid, e + hi, Before);
    uint64_t mass = 0;
    for (size_t j = lo; j < mid; ++j) mass += e[j].weight;
    if (above + mass >= target) {
      hi = mid;
    } else {
      above += mass;
      lo = mid;
    }
  }
  std::sort(e + lo, e + hi, Before);
  for (size_t j = lo; j < hi; ++j) {
    above += e[j].weight;
    if (above >= target) return j + 1;
  }
  return hi;  // not reached: the weight of e[0, hi) reaches target
}

template <typename T>
int64_t SampleRow(const T* x, uint32_t n, const RowParams& p) {
  bool finite = true;
  uint64_t best = 0;  // the first element of the order: the greedy token
  for (uint32_t i = 0; i < n; ++i) {
    const float v = ToFloat(x[i]);
    finite &= sample::IsFinite(v);
    best = std::max(best, OrderOf(v, i));
  }
  if (!finite) return sample::kNonFiniteRow;
  if (!sample::ParamsValid(p.temperature, p.top_k, p.top_p, p.uniform)) {
    return sample::kInvalidParams;
  }
  if (sample::IsGreedy(p.temperature, p.top_k)) return IndexOf(best);

  const int fixed_bits = sample::FixedBits(n);
  const float x_max = ValueOf(best);
  std::vector<Entry> e(n);
  for (uint32_t i = 0; i < n; ++i) e[i].order = OrderOf(ToFloat(x[i]), i);
  // The top K: the first K of the order, exactly (orders are distinct).
  const size_t k = p.top_k > 0 && static_cast<uint32_t>(p.top_k) < n ? p.top_k : n;
  if (k < n) std::nth_element(e.begin(), e.begin() + k, e.end(), Before);
  uint64_t z = 0;
  for (size_t j = 0; j < k; ++j) {
    e[j].weight = sample::FixedWeight(ValueOf(e[j].order), x_max, p.temperature, fixed_bits);
    z += e[j].weight;
  }
  // Top-p: the shortest prefix of the order whose weight reaches top_p * z (rounded up: the
  // weights are integers). The maximum weighs 2^fixed_bits > 0, so it holds a token.
  const size_t kept =
      sample::TopPIsOne(p.top_p) ? k : CutForMass(e.data(), k, sample::MulCeil(p.top_p, z));
  // The kept weights by index; the token is the first at which their running sum exceeds
  // r = floor(uniform * kept weight) < kept weight.
  std::vector<uint64_t> weight_at(n, 0);
  uint64_t z_kept = 0;
  uint32_t last_kept = 0;
  for (size_t j = 0; j < kept; ++j) {
    const uint32_t index = IndexOf(e[j].order);
    weight_at[index] = e[j].weight;
    z_kept += e[j].weight;
    last_kept = std::max(last_kept, index);
  }
  const uint64_t r = sample::MulFloor(p.uniform, z_kept);
  uint64_t running = 0;
  for (uint32_t i = 0; i < n; ++i) {
    running += weight_at[i];
    if (running > r) return i;
  }
  return last_kept;  // not reached (r < z_kept); the contract's answer when none exceeds r
}

struct Task {
  const SampleShape* shape;
  const SampleBuffers* buf;
};

template <typename T>
void RunRow(void* state, size_t row) {
  const Task& t = *static_cast<const Task*>(state);
  const SampleBuffers& b = *t.buf;
  const uint32_t n = static_cast<uint32_t>(t.shape->vocab);
  const T* x = static_cast<const T*>(b.logits) + static_cast<int64_t>(row) * t.shape->vocab;
  const RowParams p{b.temperature[row], b.top_k[row], b.top_p[row], b.uniform[row]};
  b.token_ids[row] = SampleRow(x, n, p);
}

}  // namespace

void SampleTokensCpu(const SampleShape& shape, const SampleBuffers& buffers,
                     const Parallel& parallel) {
  Task task{&shape, &buffers};
  TaskFn fn = nullptr;
  switch (shape.dtype) {
    case DType::kFloat32: fn = RunRow<float>; break;
    case DType::kFloat16: fn = RunRow<Half>; break;
    case DType::kBFloat16: fn = RunRow<BFloat16>; break;
    default: return;  // CheckSampleInputs admits no other type
  }
  parallel.For(static_cast<size_t>(shape.rows), fn, &task);
}

}  // namespace kvl
