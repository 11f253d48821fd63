// What kv_layout=1 costs the memory system alone, without attention: the decode kernel's read
// pattern (cp.async stages per warp, KS-row steps, every fourth step a warp's) over a
// [B, L, Nkv, H] cache, in variants that differ only in which CTA reads which bytes and when.
// Written to test one hypothesis for kv_layout=1's 3 to 6% cost at 9/3/64 (docs/PERFORMANCE.md,
// "Layout"): the three KV heads' CTAs of a batch entry read the rows of one token
// (three 128-byte rows side by side) at different times, so the DRAM pages holding them open
// several times where a head-major stream opens each once.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o kv_read_pattern tools/perf/kv_read_pattern.cu
//   ./kv_read_pattern [B L NKV [SPLITS]]     (default 64 32768 3 1)
//
// Variants (each reads K and V of every (batch, kv head, token) once; head size 64, fp16):
//   kv0        head-major: CTA (split, b x nkv + g) streams its head's contiguous rows.
//   kv1        seq-major: the same CTAs, rows of 128 bytes at a stride of nkv x 128.
//   kv1-clu    kv1 launched as clusters of nkv CTAs along y (a batch entry's heads on one GPC).
//   kv1-sync   kv1-clu with a cluster barrier after every round of steps: a batch entry's heads
//              read the same tokens within about one step of each other.
//   kv1-sync4  the same barrier every fourth round.
//   kv1-grp    one CTA of nkv x 4 warps per (split, batch entry), warp group g reads head g:
//              the heads' rows of a token requested from one SM at about the same time.
//   kv1-row    one CTA of 4 warps per (split, batch entry) reading whole token rows (nkv x 128
//              contiguous bytes), the layout's own contiguity (the virtual-heads kernel's reads).
//   kv1-256    kv1 with the copies' L2 prefetch hint at 256 bytes (.L2::256B; the others: none).
//   kv1-pf     kv1, and lane 0 of each warp prefetches into L2 the whole token rows (all heads,
//              cp.async.bulk.prefetch.L2) of the step it issues: the DRAM reads whole rows once,
//              the other heads' CTAs find their rows in L2.
//   kv1-pfa    the same prefetch one step ahead of the copies.
//   kv1-pf0    kv1-pfa by head 0's CTAs only.
//   kv0-pfa    kv0 with its own rows prefetched one step ahead (a control: nothing to share).
// Prints the median of 15 timed launches (CUDA events) and TB/s of K+V bytes read.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                  \
                   cudaGetErrorString(e_));                                           \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

namespace {

constexpr int kWarp = 32, kHd = 64, kKs = 32, kSt = 2;  // the decode kernel's HD 64 constants
constexpr int kRowBytes = kHd * 2;                       // 128

enum Variant {
  kKv0, kKv1, kKv1Clu, kKv1Sync, kKv1Sync4, kKv1Grp, kKv1Row, kKv1L2x256, kKv1Pf, kKv1Pfa,
  kKv1Pf0, kKv0Pfa
};

__device__ __forceinline__ void CpAsync16(unsigned smem, const void* g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(g));
}
__device__ __forceinline__ void CpAsync16L2x256(unsigned smem, const void* g) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem), "l"(g));
}
__device__ __forceinline__ void PrefetchL2(const void* g, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(g), "r"(bytes) : "memory");
}
__device__ __forceinline__ void Commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void Wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ClusterArrive() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
}

struct Args {
  const unsigned char* k;
  const unsigned char* v;
  long long L, nkv, splits;
  int row_bytes;  // bytes a warp's step row holds: 128, or nkv x 128 for kv1-row
  int sync_every; // rounds between cluster barriers (0: none)
  float* sink;
};

// The prefetch of a variant: none (ahead < 0), or the token rows [back bytes before a step's
// first row, + bytes) of step i + ahead, issued with step i's copies.
struct Prefetch {
  int ahead = -1;
  long long back = 0, bytes = 0;
  bool hint256 = false;
};

// One warp's stream: steps w, w + warps, ... of KS rows, each row `row_bytes` bytes at `stride`
// from the previous, K and V alike; ST stages in flight. `rounds`: the most steps any warp of the
// CTA takes (every warp runs them all when a cluster barrier needs every thread).
template <int kRowChunks>
__device__ void Stream(const unsigned char* k, const unsigned char* v, long long stride,
                       long long keys, int warp, int warps, int sync_every, unsigned char* smem,
                       float* sink, Prefetch pf = {}) {
  const int lane = threadIdx.x % kWarp;
  constexpr int kStepBytes = kKs * kRowChunks * 16;
  unsigned base = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const long long steps = (keys + kKs - 1) / kKs;
  const long long rounds = (steps + warps - 1) / warps;
  auto issue = [&](long long i) {
    const long long step = warp + i * warps;
    if (i >= rounds || step >= steps) return;
    const unsigned slot = base + unsigned((i % kSt) * 2 * kStepBytes);
    if (pf.ahead >= 0 && lane == 0) {
      const long long ps = warp + (i + pf.ahead) * warps;  // the step prefetched
      if (ps < steps) {
        const long long rows = keys - ps * kKs < kKs ? keys - ps * kKs : kKs;
        const long long off = ps * kKs * stride - pf.back;
        const unsigned n = unsigned((rows - 1) * stride + pf.bytes);
        PrefetchL2(k + off, n);
        PrefetchL2(v + off, n);
      }
    }
    for (int idx = lane; idx < kKs * kRowChunks; idx += kWarp) {
      const int j = idx / kRowChunks, c = idx % kRowChunks;
      const long long off = (step * kKs + j) * stride + c * 16;
      if (pf.hint256) {
        CpAsync16L2x256(slot + idx * 16, k + off);
        CpAsync16L2x256(slot + kStepBytes + idx * 16, v + off);
      } else {
        CpAsync16(slot + idx * 16, k + off);
        CpAsync16(slot + kStepBytes + idx * 16, v + off);
      }
    }
  };
  float acc = 0.0f;
  for (int i = 0; i < kSt - 1; ++i) {
    issue(i);
    Commit();
  }
  for (long long i = 0; i < rounds; ++i) {
    if (sync_every > 0 && i > 0 && i % sync_every == 0) ClusterWait();
    issue(i + kSt - 1);
    Commit();
    Wait<kSt - 1>();
    __syncwarp();
    const unsigned char* s = smem + (i % kSt) * 2 * kStepBytes;
    acc += static_cast<float>(s[lane * 16]) + static_cast<float>(s[kStepBytes + lane * 16]);
    __syncwarp();
    if (sync_every > 0 && (i + 1) % sync_every == 0 && i + 1 < rounds) ClusterArrive();
  }
  if (acc == -1.0f) *sink = acc;  // keeps the reads
}

template <int kRowChunks>
__global__ void ReadKernel(Args a, int variant) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / kWarp;
  const long long split = blockIdx.x;
  const long long chunk = (a.L + a.splits - 1) / a.splits;
  const long long k0 = split * chunk, keys = (a.L < k0 + chunk ? a.L : k0 + chunk) - k0;
  if (keys <= 0) return;
  constexpr int kWarpSmem = 2 * kSt * kKs * kRowChunks * 16;
  if (variant == kKv1Grp) {  // y = b; warp group g = warp / 4 reads head g
    const long long b = blockIdx.y, g = warp / 4;
    const long long off = ((b * a.L + k0) * a.nkv + g) * kRowBytes;
    Stream<kRowChunks>(a.k + off, a.v + off, a.nkv * kRowBytes, keys, warp % 4, 4, 0,
                       smem + warp * kWarpSmem, a.sink);
    return;
  }
  if (variant == kKv1Row) {  // y = b; whole token rows
    const long long b = blockIdx.y;
    const long long off = (b * a.L + k0) * a.nkv * kRowBytes;
    Stream<kRowChunks>(a.k + off, a.v + off, a.nkv * kRowBytes, keys, warp, 4, 0,
                       smem + warp * kWarpSmem, a.sink);
    return;
  }
  const long long b = blockIdx.y / a.nkv, g = blockIdx.y % a.nkv;
  long long off, stride;
  Prefetch pf;
  pf.hint256 = variant == kKv1L2x256;
  if (variant == kKv1Pf || variant == kKv1Pfa || (variant == kKv1Pf0 && g == 0)) {
    pf.ahead = variant == kKv1Pf ? 0 : 1;
    pf.back = g * kRowBytes;  // the token row's start
    pf.bytes = a.nkv * kRowBytes;
  }
  if (variant == kKv0Pfa) {
    pf.ahead = 1;
    pf.bytes = kRowBytes;
  }
  if (variant == kKv0 || variant == kKv0Pfa) {
    off = ((b * a.nkv + g) * a.L + k0) * kRowBytes;
    stride = kRowBytes;
  } else {
    off = ((b * a.L + k0) * a.nkv + g) * kRowBytes;
    stride = a.nkv * kRowBytes;
  }
  Stream<kRowChunks>(a.k + off, a.v + off, stride, keys, warp, 4, a.sync_every,
                     smem + warp * kWarpSmem, a.sink, pf);
}

const char* kNames[] = {"kv0",     "kv1",    "kv1-clu", "kv1-sync", "kv1-sync4", "kv1-grp",
                        "kv1-row", "kv1-256", "kv1-pf", "kv1-pfa",  "kv1-pf0",   "kv0-pfa"};

}  // namespace

int main(int argc, char** argv) {
  const long long B = argc > 1 ? std::atoll(argv[1]) : 64;
  const long long L = argc > 2 ? std::atoll(argv[2]) : 32768;
  const long long nkv = argc > 3 ? std::atoll(argv[3]) : 3;
  const long long splits = argc > 4 ? std::atoll(argv[4]) : 1;
  const size_t bytes = size_t(B) * L * nkv * kRowBytes;
  unsigned char *k = nullptr, *v = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&k, bytes));
  CHECK(cudaMalloc(&v, bytes));
  CHECK(cudaMalloc(&sink, sizeof(float)));
  CHECK(cudaMemset(k, 1, bytes));
  CHECK(cudaMemset(v, 2, bytes));
  // A buffer larger than the L2 written between launches, so each launch reads from DRAM.
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("B=%lld L=%lld nkv=%lld H=64 splits=%lld K+V %.1f MiB\n", B, L, nkv, splits,
              2.0 * bytes / (1 << 20));
  for (int variant = kKv0; variant <= kKv0Pfa; ++variant) {
    const bool group = variant == kKv1Grp, row = variant == kKv1Row;
    const bool clu = variant == kKv1Clu || variant == kKv1Sync || variant == kKv1Sync4;
    if (row && nkv != 3) continue;  // compiled for 3 x 128-byte rows only
    const int warps = group ? int(4 * nkv) : 4;
    const int chunks = row ? 24 : 8;
    const size_t smem = size_t(warps) * 2 * kSt * kKs * chunks * 16;
    const void* fn = row ? reinterpret_cast<const void*>(&ReadKernel<24>)
                         : reinterpret_cast<const void*>(&ReadKernel<8>);
    if (smem > 227 * 1024) {
      std::printf("%-10s skipped: %zu bytes of shared memory\n", kNames[variant], smem);
      continue;
    }
    CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    Args a{k, v, L, nkv, splits, row ? int(nkv) * kRowBytes : kRowBytes,
           variant == kKv1Sync ? 1 : variant == kKv1Sync4 ? 4 : 0, sink};
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(unsigned(splits), unsigned(group || row ? B : B * nkv));
    cfg.blockDim = dim3(unsigned(warps * kWarp));
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr[1];
    if (clu) {
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = 1;
      attr[0].val.clusterDim.y = unsigned(nkv);
      attr[0].val.clusterDim.z = 1;
      cfg.attrs = attr;
      cfg.numAttrs = 1;
    }
    int var = variant;
    void* params[] = {&a, &var};
    std::vector<float> ms;
    for (int rep = 0; rep < 18; ++rep) {
      CHECK(cudaMemsetAsync(flush, rep, flush_bytes));
      CHECK(cudaEventRecord(e0));
      CHECK(cudaLaunchKernelExC(&cfg, fn, params));
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float t = 0.0f;
      CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (rep >= 3) ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("%-10s %8.1f us  %.3f TB/s  (p10 %.1f, p90 %.1f)\n", kNames[variant],
                med * 1e3f, 2.0 * bytes / (med * 1e-3) / 1e12, ms[1] * 1e3f,
                ms[ms.size() - 2] * 1e3f);
  }
  return 0;
}
