// CUDA virtual memory for growable KV caches: a fixed device address range whose physical
// granules are created and mapped on demand (cuMemAddressReserve / cuMemCreate / cuMemMap /
// cuMemSetAccess; released by cuMemUnmap / cuMemRelease / cuMemAddressFree, in that order).
//
// The driver is reached through dlopen("libcuda.so.1") at first use: the module links no CUDA
// library and imports on machines without a driver. Every call returns a Status naming the CUDA
// call and its error (cuGetErrorName / cuGetErrorString). Built only with KVL_WITH_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"

namespace kvl::vmm {

// Process-wide totals over every live Reservation (back to zero once all are closed).
struct Stats {
  int64_t reservations = 0;
  int64_t reserved_bytes = 0;
  int64_t mapped_bytes = 0;
  int64_t handles = 0;  // live physical allocations (cuMemCreate'd granules)
};
Stats GetStats();

// Process-wide time spent in the driver's memory calls since the process began (cumulative,
// never reset): what committing and releasing granules costs the host, call by call. Read twice
// and subtract to time a span of work.
enum class DriverCall { kCreate, kMap, kSetAccess, kUnmap, kRelease, kSynchronize, kCount };
const char* DriverCallName(DriverCall call);
struct DriverTime {
  int64_t calls = 0;
  int64_t ns = 0;
};
DriverTime GetDriverTime(DriverCall call);

// Test hook: the (after+1)-th next cuMemCreate fails as CUDA_ERROR_OUT_OF_MEMORY would;
// after < 0 disarms it.
void FailCreateAfter(int after);

// dst and src are device addresses on `device` (e.g. two reservations); synchronous, with the
// device's primary context pushed for the copy.
Status CopyDeviceToDevice(int device, uint64_t dst, uint64_t src, size_t bytes);

class Reservation {
 public:
  // Reserves `size` bytes (rounded up to the granularity) on `device`; nothing mapped yet.
  static Status Create(int device, size_t size, std::unique_ptr<Reservation>* out);
  ~Reservation();  // Close(), errors ignored
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;

  uint64_t ptr() const { return ptr_; }
  size_t size() const { return size_; }
  size_t granularity() const { return granularity_; }
  size_t mapped_bytes() const { return mapped_bytes_; }
  bool closed() const { return ptr_ == 0; }

  // Creates and maps every unmapped granule of [offset, offset+size) (granule aligned): a
  // cuMemCreate and cuMemMap per granule, one cuMemSetAccess per run of them. On an error the
  // granules mapped before it stay mapped (and counted); *added = new bytes mapped.
  Status Map(size_t offset, size_t size, size_t* added);
  // Unmaps and releases the mapped granules of [offset, offset+size) (granule aligned).
  Status Unmap(size_t offset, size_t size);
  // Synchronous copies between mapped bytes and host memory.
  Status CopyToHost(size_t offset, void* dst, size_t bytes) const;
  Status CopyFromHost(size_t offset, const void* src, size_t bytes);
  // Waits for the device, unmaps and releases every granule, frees the range, releases the
  // context. Idempotent; continues past errors and returns the first, except when the context
  // cannot be made current: then nothing is released and a later Close() can retry.
  Status Close();

 private:
  Reservation() = default;
  Status CheckMapped(size_t offset, size_t bytes) const;

  int device_ = 0;           // ordinal
  int cu_device_ = 0;        // CUdevice handle of the ordinal
  void* context_ = nullptr;  // CUcontext: the device's primary context, retained
  uint64_t ptr_ = 0;
  size_t size_ = 0;
  size_t granularity_ = 0;
  size_t mapped_bytes_ = 0;
  std::vector<unsigned long long> handles_;  // per granule; 0 = not mapped
};

}  // namespace kvl::vmm
