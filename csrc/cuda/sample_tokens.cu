// ai.kvlayout::SampleTokens on CUDA (docs/CONTRACT.md section 15). One CTA per row; the row is
// read from global memory once per pass (a 128k-token fp16 row is 256 KB: L2-resident after the
// first). Passes, as a row needs them:
//   1. the row maximum with its lowest index (the greedy token) and the non-finite test;
//   2. top-k: the K-th key of the order, by radix selection on the 32-bit order keys (3 passes
//      of 11, 11 and 10 bits, counting keys in a shared-memory histogram);
//   3. the weight above it (the top-K mass);
//   4. top-p: the cut key, by radix selection on weight (3 passes, weight histograms);
//   5. the kept weight of each warp's contiguous segment of the row (16 segments), then a
//      block-wide scan in index order of the one segment where the running weight passes r: the
//      first kept token at which it exceeds r.
// Weights are integers (core/sample_rule.h), so histogram atomics, reductions and scans are
// exact in any order: the token does not depend on scheduling, and equals the CPU kernel's.
// Every pass keeps four 16-byte loads in flight per thread (one left the passes waiting on L2
// latency). Weight histograms are two 32-bit halves with an explicit carry: shared-memory 64-bit
// atomic adds are compare-and-swap loops, which retry without end on the bins most logits share
// (H100: top-p over 128k logits took 430 us with them). Per-element warp collectives to merge
// a warp's adds (match_any, redux) cost more than they saved (measured).
// Ties at a cut (equal logits) are resolved by index rank: the radix selections give the cut key
// and how many of its elements are kept; the final scan counts them in index order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <string>

#include "core/sample_rule.h"
#include "cuda/sample_tokens.h"

namespace kvl {
namespace cu {
namespace {

constexpr int kThreads = 512;
constexpr int kItems = 8;  // final pass: consecutive elements per thread (16 bytes of fp16)
constexpr uint32_t kTile = kThreads * kItems;
constexpr int kMaxBins = 2048;
constexpr int kWarps = kThreads / 32;  // final pass: one contiguous segment of the row each
constexpr uint32_t kUnroll = 4;        // 16-byte loads in flight per thread in the passes
constexpr unsigned kMaxGrid = 1u << 16;

// Radix digits of the 32-bit order keys, most significant first: bits [21, 32), [10, 21), [0, 10).
constexpr int kPasses = 3;
__device__ __forceinline__ int DigitShift(int pass) {
  return pass == 0 ? 21 : (pass == 1 ? 10 : 0);
}
__device__ __forceinline__ int DigitBits(int pass) { return pass == 2 ? 10 : 11; }
// The key bits earlier passes have fixed.
__device__ __forceinline__ uint32_t FixedMask(int pass) {
  return pass == 0 ? 0u : ~((1u << (DigitShift(pass) + DigitBits(pass))) - 1u);
}

__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }

struct Pair {
  uint64_t mass;  // weight of the elements above the cut key
  uint64_t ties;  // elements of the cut key
};
struct PairSum {
  __device__ __forceinline__ Pair operator()(const Pair& a, const Pair& b) const {
    return Pair{a.mass + b.mass, a.ties + b.ties};
  }
};
struct MaxU64 {
  __device__ __forceinline__ uint64_t operator()(uint64_t a, uint64_t b) const {
    return a > b ? a : b;
  }
};

using BlockReduceU64 = cub::BlockReduce<uint64_t, kThreads>;
using BlockScanU64 = cub::BlockScan<uint64_t, kThreads>;
using BlockScanPair = cub::BlockScan<Pair, kThreads>;

struct Shared {
  union {
    BlockReduceU64::TempStorage reduce;
    BlockScanU64::TempStorage scan;
    BlockScanPair::TempStorage pair_scan;
  } temp;
  union {
    unsigned count[kMaxBins];
    struct {
      unsigned lo[kMaxBins];  // weight sums mod 2^32
      unsigned hi[kMaxBins];  // weight sums / 2^32 (with the carries out of lo)
    } mass;
  } hist;
  uint64_t seg_mass[kWarps];  // final pass: weight above the cut per segment
  uint64_t seg_ties[kWarps];  // final pass: elements of the cut key per segment
  uint64_t broadcast;
  uint64_t digit_above;
  uint32_t digit;
  uint32_t pick;
  uint32_t segment;  // final pass: the segment holding the token
  Pair carry;        // final pass: the kept weight and cut-key elements before that segment
};

// The weight of a logit in the row (sample::FixedWeight).
struct Weigher {
  float x_max;
  float temperature;
  int fixed_bits;
  __device__ __forceinline__ uint64_t operator()(float x) const {
    return sample::FixedWeight(x, x_max, temperature, fixed_bits);
  }
};

// fn(index, value) for every element of the row, each thread a strided share, kUnroll 16-byte
// loads at a time when the row is 16-byte aligned (any order serves: every pass's result is
// order-free).
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachInRow(const T* row, uint32_t n, Fn&& fn) {
  constexpr uint32_t kVec = 16 / sizeof(T);
  uint32_t done = 0;
  if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0) {
    const uint32_t vecs = n / kVec;
    const uint4* v = reinterpret_cast<const uint4*>(row);
    for (uint32_t base = threadIdx.x; base < vecs; base += kThreads * kUnroll) {
      uint4 raw[kUnroll];
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * kThreads;
        if (i < vecs) raw[u] = v[i];
      }
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * kThreads;
        if (i >= vecs) break;
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (uint32_t j = 0; j < kVec; ++j) fn(i * kVec + j, ToF(e[j]));
      }
    }
    done = vecs * kVec;
  }
  for (uint32_t i = done + threadIdx.x; i < n; i += kThreads) fn(i, ToF(row[i]));
}

// The same for one warp over elements [begin, end), lanes on consecutive 16-byte pieces; begin
// a multiple of 16 / sizeof(T) when the row is aligned.
template <typename T, typename Fn>
__device__ __forceinline__ void ForEachInSegment(const T* row, uint32_t begin, uint32_t end,
                                                 Fn&& fn) {
  constexpr uint32_t kVec = 16 / sizeof(T);
  const uint32_t lane = threadIdx.x & 31u;
  uint32_t done = begin;
  if ((reinterpret_cast<uintptr_t>(row) & 15u) == 0 && begin < end) {
    const uint32_t vend = end / kVec;
    const uint4* v = reinterpret_cast<const uint4*>(row);
    for (uint32_t base = begin / kVec + lane; base < vend; base += 32 * kUnroll) {
      uint4 raw[kUnroll];
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * 32;
        if (i < vend) raw[u] = v[i];
      }
#pragma unroll
      for (uint32_t u = 0; u < kUnroll; ++u) {
        const uint32_t i = base + u * 32;
        if (i >= vend) break;
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (uint32_t j = 0; j < kVec; ++j) fn(i * kVec + j, ToF(e[j]));
      }
    }
    done = vend * kVec > begin ? vend * kVec : begin;
  }
  for (uint32_t i = done + lane; i < end; i += 32) fn(i, ToF(row[i]));
}

// hist[bin] += w, exactly, in two 32-bit halves: the low half's atomic returns the sum before
// it, so an add that wraps it carries one into the high half. The halves' final values are the
// exact sum whatever the order (it stays below 2^62).
__device__ __forceinline__ void AddMass(Shared& sh, uint32_t bin, uint64_t w) {
  const uint32_t lo = static_cast<uint32_t>(w);
  uint32_t hi = static_cast<uint32_t>(w >> 32);
  if (lo != 0) {
    const uint32_t old = atomicAdd(&sh.hist.mass.lo[bin], lo);
    hi += old + lo < old ? 1u : 0u;
  }
  if (hi != 0) atomicAdd(&sh.hist.mass.hi[bin], hi);
}

__device__ __forceinline__ uint64_t WarpSum(uint64_t v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Elements [i0, i0 + kItems) of the row (0 past its end).
template <typename T>
__device__ __forceinline__ void LoadItems(const T* row, uint32_t n, uint32_t i0, bool aligned,
                                          float (&v)[kItems]) {
  constexpr int kVec = 16 / sizeof(T);
  if (aligned && i0 + kItems <= n) {  // i0 is a multiple of kItems: 16-byte aligned too
#pragma unroll
    for (int c = 0; c < kItems / kVec; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(row + i0)[c];
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[c * kVec + j] = ToF(e[j]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) v[j] = i0 + j < n ? ToF(row[i0 + j]) : 0.0f;
}

// Block-wide reductions, the result in every thread.
__device__ uint64_t BlockSum(uint64_t v, Shared& sh) {
  const uint64_t total = BlockReduceU64(sh.temp.reduce).Sum(v);
  if (threadIdx.x == 0) sh.broadcast = total;
  __syncthreads();
  const uint64_t out = sh.broadcast;
  __syncthreads();
  return out;
}
__device__ uint64_t BlockMax(uint64_t v, Shared& sh) {
  const uint64_t total = BlockReduceU64(sh.temp.reduce).Reduce(v, MaxU64());
  if (threadIdx.x == 0) sh.broadcast = total;
  __syncthreads();
  const uint64_t out = sh.broadcast;
  __syncthreads();
  return out;
}

template <bool kMass>
__device__ __forceinline__ uint64_t Bin(const Shared& sh, int d) {
  if (kMass) return (uint64_t{sh.hist.mass.hi[d]} << 32) + sh.hist.mass.lo[d];
  return sh.hist.count[d];
}

// In the histogram of `bins` bins (counts or weights), the digit d whose bins above sum to less
// than `target` and whose bins from d up reach it (1 <= target <= all bins): sets sh.digit and
// sh.digit_above (the sum of the bins above d). Thread t holds bins t * per .. t * per + per - 1
// counted from the top digit down, so an exclusive scan gives each its sum above.
template <bool kMass>
__device__ void FindDigit(int bins, uint64_t target, Shared& sh) {
  const int per = bins / kThreads;
  uint64_t local = 0;
  for (int j = 0; j < per; ++j) local += Bin<kMass>(sh, bins - 1 - (threadIdx.x * per + j));
  uint64_t above = 0;
  BlockScanU64(sh.temp.scan).ExclusiveSum(local, above);
  for (int j = 0; j < per; ++j) {
    const int d = bins - 1 - (threadIdx.x * per + j);
    const uint64_t c = Bin<kMass>(sh, d);
    if (above < target && target <= above + c) {  // one bin in the block
      sh.digit = static_cast<uint32_t>(d);
      sh.digit_above = above;
    }
    above += c;
  }
  __syncthreads();
}

// Top-k (1 <= k < n): the key of the k-th element of the order, and how many elements of that
// key the first k hold (the lowest indices among them: the order breaks ties by index).
template <typename T>
__device__ void SelectTopK(const T* row, uint32_t n, uint32_t k, Shared& sh, uint32_t* key_k,
                           uint64_t* take) {
  uint32_t prefix = 0;
  uint64_t need = k;  // rank, from the top, of the wanted element among the prefix's keys
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = DigitShift(pass), bins = 1 << DigitBits(pass);
    const uint32_t fixed = FixedMask(pass);
    for (int i = threadIdx.x; i < bins; i += kThreads) sh.hist.count[i] = 0;
    __syncthreads();
    ForEachInRow(row, n, [&](uint32_t, float v) {
      const uint32_t key = sample::OrderKey(v);
      if ((key & fixed) == prefix) atomicAdd(&sh.hist.count[(key >> shift) & (bins - 1)], 1u);
    });
    __syncthreads();
    FindDigit<false>(bins, need, sh);
    prefix |= sh.digit << shift;
    need -= sh.digit_above;
    __syncthreads();  // sh.digit read by every thread before the next pass writes it
  }
  *key_k = prefix;
  *take = need;
}

// Top-p, within the top-K set (the elements above key_k, and take_k elements of key_k weighing
// w_k each): the greatest key t whose elements from t up weigh at least `target` (1 <= target <=
// the set's weight), and the weight of the set's elements above t.
template <typename T>
__device__ void SelectTopP(const T* row, uint32_t n, const Weigher& weigh, uint32_t key_k,
                           uint64_t take_k, uint64_t w_k, uint64_t target, Shared& sh,
                           uint32_t* cut_key, uint64_t* cut_above) {
  uint32_t prefix = 0;
  uint64_t above = 0;  // weight of the set above the prefix's keys: below target
  for (int pass = 0; pass < kPasses; ++pass) {
    const int shift = DigitShift(pass), bins = 1 << DigitBits(pass);
    const uint32_t fixed = FixedMask(pass);
    for (int i = threadIdx.x; i < bins; i += kThreads) {
      sh.hist.mass.lo[i] = 0;
      sh.hist.mass.hi[i] = 0;
    }
    __syncthreads();
    ForEachInRow(row, n, [&](uint32_t, float v) {
      const uint32_t key = sample::OrderKey(v);
      if (key > key_k && (key & fixed) == prefix)
        AddMass(sh, (key >> shift) & (bins - 1), weigh(v));
    });
    if (threadIdx.x == 0 && take_k > 0 && (key_k & fixed) == prefix) {
      AddMass(sh, (key_k >> shift) & (bins - 1), take_k * w_k);
    }
    __syncthreads();
    FindDigit<true>(bins, target - above, sh);
    prefix |= sh.digit << shift;
    above += sh.digit_above;
    __syncthreads();
  }
  *cut_key = prefix;
  *cut_above = above;
}

// The kept set is every element above cut_key and the first q elements (by index) of cut_key,
// each weighing w_c. Returns the first index at which the running kept weight, in index order,
// exceeds r (< the kept weight). Each warp sums the weight above the cut and the cut-key
// elements of its contiguous segment of the row, thread 0 finds the segment where the running
// weight passes r, and only that segment is scanned, tile by tile: each thread takes kItems
// consecutive elements after a block-wide exclusive scan of (weight above the cut, elements of
// the cut key).
template <typename T>
__device__ uint32_t PickToken(const T* row, uint32_t n, const Weigher& weigh, uint32_t cut_key,
                              uint64_t q, uint64_t w_c, uint64_t r, Shared& sh) {
  // Segments of whole 256-element pieces: every lane's first piece is 16-byte aligned.
  const uint32_t per = (n + kWarps - 1) / kWarps;
  const uint32_t seg_len = (per + 255u) / 256u * 256u;
  {
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t begin = warp * seg_len < n ? warp * seg_len : n;
    const uint32_t end = n - begin < seg_len ? n : begin + seg_len;
    uint64_t mass = 0, ties = 0;
    ForEachInSegment(row, begin, end, [&](uint32_t, float v) {
      const uint32_t key = sample::OrderKey(v);
      if (key > cut_key) mass += weigh(v);
      ties += key == cut_key ? 1 : 0;
    });
    mass = WarpSum(mass);
    ties = WarpSum(ties);
    if ((threadIdx.x & 31u) == 0) {
      sh.seg_mass[warp] = mass;
      sh.seg_ties[warp] = ties;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // The first segment whose end the running weight passes r; the last if none does (not
    // reached: the segments add up to the kept weight exactly, and r is below it).
    const uint32_t segments = (n + seg_len - 1) / seg_len;
    Pair before{0, 0};
    uint32_t s = 0;
    for (; s + 1 < segments; ++s) {
      const Pair after{before.mass + sh.seg_mass[s], before.ties + sh.seg_ties[s]};
      if (after.mass + (after.ties < q ? after.ties : q) * w_c > r) break;
      before = after;
    }
    sh.segment = s;
    sh.carry = before;
    sh.pick = UINT32_MAX;
  }
  __syncthreads();
  const uint32_t begin = sh.segment * seg_len;
  const uint32_t end = n - begin < seg_len ? n : begin + seg_len;
  Pair carry = sh.carry;  // the kept weight and cut-key elements before this tile
  const bool aligned = (reinterpret_cast<uintptr_t>(row) & 15u) == 0;
  uint64_t last_kept = 0;  // 1 + the last kept index this thread saw
  for (uint32_t base = begin; base < end; base += kTile) {
    const uint32_t i0 = base + threadIdx.x * kItems;
    float v[kItems];
    LoadItems(row, end, i0, aligned, v);
    uint64_t w[kItems];
    uint8_t kind[kItems];  // 0: not kept, 1: above the cut, 2: of the cut key
    Pair mine{0, 0};
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      w[j] = 0;
      kind[j] = 0;
      if (i0 + j < end) {
        const uint32_t key = sample::OrderKey(v[j]);
        if (key > cut_key) {
          w[j] = weigh(v[j]);
          kind[j] = 1;
          mine.mass += w[j];
        } else if (key == cut_key) {
          kind[j] = 2;
          ++mine.ties;
        }
      }
    }
    Pair before, tile;
    BlockScanPair(sh.temp.pair_scan).ExclusiveScan(mine, before, Pair{0, 0}, PairSum(), tile);
    uint64_t mass = carry.mass + before.mass, ties = carry.ties + before.ties;
    uint32_t found = UINT32_MAX;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      bool kept = kind[j] == 1;
      mass += w[j];
      if (kind[j] == 2) kept = ties++ < q;
      if (kept) last_kept = i0 + j + 1;
      // Grows only at kept elements, so the first index past r is a kept one.
      const uint64_t running = mass + (ties < q ? ties : q) * w_c;
      if (found == UINT32_MAX && running > r) found = i0 + j;
    }
    if (found != UINT32_MAX) atomicMin(&sh.pick, found);
    __syncthreads();  // also ends this tile's use of sh.temp
    const uint32_t pick = sh.pick;
    if (pick != UINT32_MAX) return pick;
    carry = PairSum()(carry, tile);
  }
  // Not reached (see above). The contract's answer when no running sum exceeds r: the last kept
  // token (of the last segment, which then holds it).
  const uint64_t last = BlockMax(last_kept, sh);
  return last > 0 ? static_cast<uint32_t>(last - 1) : 0u;
}

template <typename T>
__device__ int64_t SampleRow(const T* row, uint32_t n, int fixed_bits, float temperature,
                             int32_t top_k, float top_p, float uniform, Shared& sh) {
  bool bad = false;
  uint64_t best = 0;  // (key, ~index): its maximum is the first element of the order
  ForEachInRow(row, n, [&](uint32_t i, float v) {
    bad |= !sample::IsFinite(v);
    const uint64_t packed = (uint64_t{sample::OrderKey(v)} << 32) | static_cast<uint32_t>(~i);
    best = packed > best ? packed : best;
  });
  if (__syncthreads_or(bad)) return sample::kNonFiniteRow;
  if (!sample::ParamsValid(temperature, top_k, top_p, uniform)) return sample::kInvalidParams;
  best = BlockMax(best, sh);
  if (sample::IsGreedy(temperature, top_k)) return ~static_cast<uint32_t>(best);

  const Weigher weigh{sample::KeyValue(static_cast<uint32_t>(best >> 32)), temperature, fixed_bits};
  // No top-k: key 0 (no finite logit has it) keeps every element.
  uint32_t key_k = 0;
  uint64_t take_k = 0;
  if (top_k > 0 && static_cast<uint32_t>(top_k) < n) {
    SelectTopK(row, n, static_cast<uint32_t>(top_k), sh, &key_k, &take_k);
  }
  uint64_t mine = 0;
  ForEachInRow(row, n, [&](uint32_t, float v) {
    if (sample::OrderKey(v) > key_k) mine += weigh(v);
  });
  const uint64_t above_k = BlockSum(mine, sh);
  const uint64_t w_k = take_k > 0 ? weigh(sample::KeyValue(key_k)) : 0;
  // The kept set: above cut_key, and q elements of cut_key weighing w_c each.
  uint32_t cut_key = key_k;
  uint64_t q = take_k, cut_above = above_k, w_c = w_k;
  if (!sample::TopPIsOne(top_p)) {
    const uint64_t target = sample::MulCeil(top_p, above_k + take_k * w_k);
    SelectTopP(row, n, weigh, key_k, take_k, w_k, target, sh, &cut_key, &cut_above);
    w_c = weigh(sample::KeyValue(cut_key));
    // The cut key's elements weigh more than target - cut_above > 0 together: w_c > 0.
    q = w_c > 0 ? (target - cut_above + w_c - 1) / w_c : 0;
  }
  const uint64_t r = sample::MulFloor(uniform, cut_above + q * w_c);
  return PickToken(row, n, weigh, cut_key, q, w_c, r, sh);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    SampleTokensKernel(const T* logits, int64_t rows, uint32_t vocab, int fixed_bits,
                       const float* temperature, const int32_t* top_k, const float* top_p,
                       const float* uniform, int64_t* token_ids) {
  __shared__ Shared sh;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t token = SampleRow(logits + r * vocab, vocab, fixed_bits, temperature[r], top_k[r],
                                    top_p[r], uniform[r], sh);
    if (threadIdx.x == 0) token_ids[r] = token;
    __syncthreads();  // the next row reuses sh
  }
}

template <typename T>
void Launch(const SampleShape& s, const SampleBuffers& b, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(s.rows < kMaxGrid ? s.rows : kMaxGrid);
  SampleTokensKernel<T><<<grid, kThreads, 0, stream>>>(
      static_cast<const T*>(b.logits), s.rows, static_cast<uint32_t>(s.vocab),
      sample::FixedBits(s.vocab), b.temperature, b.top_k, b.top_p, b.uniform, b.token_ids);
}

}  // namespace
}  // namespace cu

Status LaunchSampleTokens(const SampleShape& shape, const SampleBuffers& buffers, void* stream) {
  if (shape.rows == 0) return Status::Ok();
  const auto s = static_cast<cudaStream_t>(stream);
  switch (shape.dtype) {
    case DType::kFloat32: cu::Launch<float>(shape, buffers, s); break;
    case DType::kFloat16: cu::Launch<__half>(shape, buffers, s); break;
    case DType::kBFloat16: cu::Launch<__nv_bfloat16>(shape, buffers, s); break;
    default:
      return Status::Error("ai.kvlayout::SampleTokens (CUDA): logits of an unsupported type");
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return Status::Error(std::string("ai.kvlayout::SampleTokens (CUDA): kernel launch: ") +
                         cudaGetErrorString(err));
  }
  return Status::Ok();
}

}  // namespace kvl
