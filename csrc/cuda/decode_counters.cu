// Host side of the decode kernel's split counters kept across calls (CudaDecodeCounters in
// gqa_cuda.h): one stream-ordered buffer per stream, zeroed when allocated; the kernel returns
// every counter it used to zero, so later calls launch without a memset.
#include <algorithm>

#include "cuda/common.cuh"

namespace kvl {

namespace {
constexpr size_t kMinCounterBytes = 4096;  // 1024 counters: growth stays rare
}

CudaDecodeCounters::~CudaDecodeCounters() {
  // cudaFree takes stream-ordered memory too (it synchronizes); the streams may be gone by now.
  for (auto& [stream, buffer] : by_stream_) {
    if (buffer.ptr != nullptr) (void)cudaFree(buffer.ptr);
  }
  for (unsigned* ptr : retired_) (void)cudaFree(ptr);
  (void)cudaGetLastError();  // at process exit the runtime may already be unloading
}

Status CudaDecodeCounters::Get(void* stream, size_t bytes, unsigned** counters) {
  using cu::CudaCheck;
  *counters = nullptr;
  std::lock_guard<std::mutex> lock(mutex_);
  if (unavailable_) return Status::Ok();
  Buffer& buffer = by_stream_[stream];
  if (buffer.bytes >= bytes) {
    *counters = buffer.ptr;
    return Status::Ok();
  }
  // Where the buffer cannot be made now, this call takes the memset path: no allocation in a
  // capture (or when the capture state cannot be read: another thread capturing in global mode
  // makes the query fail), none when the device is out of memory (the next call tries again),
  // and never again on a device without stream-ordered allocation.
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(st, &capture) != cudaSuccess) {
    (void)cudaGetLastError();
    return Status::Ok();
  }
  if (capture != cudaStreamCaptureStatusNone) return Status::Ok();
  const size_t want = std::max({bytes, kMinCounterBytes, 2 * buffer.bytes});  // rare growth
  void* ptr = nullptr;
  const cudaError_t allocated = cudaMallocAsync(&ptr, want, st);
  if (allocated != cudaSuccess) {
    (void)cudaGetLastError();
    unavailable_ = allocated == cudaErrorNotSupported;
    return Status::Ok();
  }
  const cudaError_t zeroed = cudaMemsetAsync(ptr, 0, want, st);
  if (zeroed != cudaSuccess) {
    (void)cudaFreeAsync(ptr, st);
    return CudaCheck(zeroed, "decode counters: cudaMemsetAsync");
  }
  // The old buffer is kept (still zero at rest) until the kernel instance goes: a CUDA graph
  // captured with it replays with its address.
  if (buffer.ptr != nullptr) retired_.push_back(buffer.ptr);
  buffer.ptr = static_cast<unsigned*>(ptr);
  buffer.bytes = want;
  *counters = buffer.ptr;
  return Status::Ok();
}

}  // namespace kvl
