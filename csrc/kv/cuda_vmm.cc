// CUDA virtual memory for growable KV caches (see cuda_vmm.h). Driver entry points are resolved
// from libcuda.so.1 with dlopen/dlsym; cuda.h only provides the types and the versioned names.
#include "kv/cuda_vmm.h"

#include <cuda.h>
#include <dlfcn.h>

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

namespace kvl::vmm {
namespace {

// "cuMemcpyDtoH" -> "cuMemcpyDtoH_v2": cuda.h maps API names to their versioned symbols with
// macros; stringifying after expansion gives the symbol to dlsym.
#define KVL_STR_(x) #x
#define KVL_SYMBOL(x) KVL_STR_(x)

struct Driver {
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuGetErrorString) GetErrorString = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) PrimaryCtxRetain = nullptr;
  decltype(&::cuDevicePrimaryCtxRelease) PrimaryCtxRelease = nullptr;
  decltype(&::cuCtxPushCurrent) CtxPush = nullptr;
  decltype(&::cuCtxPopCurrent) CtxPop = nullptr;
  decltype(&::cuCtxSynchronize) CtxSynchronize = nullptr;
  decltype(&::cuMemGetAllocationGranularity) GetGranularity = nullptr;
  decltype(&::cuMemAddressReserve) AddressReserve = nullptr;
  decltype(&::cuMemAddressFree) AddressFree = nullptr;
  decltype(&::cuMemCreate) Create = nullptr;
  decltype(&::cuMemRelease) Release = nullptr;
  decltype(&::cuMemMap) Map = nullptr;
  decltype(&::cuMemUnmap) Unmap = nullptr;
  decltype(&::cuMemSetAccess) SetAccess = nullptr;
  decltype(&::cuMemcpyDtoH) CopyDtoH = nullptr;
  decltype(&::cuMemcpyHtoD) CopyHtoD = nullptr;
  decltype(&::cuMemcpyDtoD) CopyDtoD = nullptr;
  std::string load_error;  // empty when every symbol resolved and cuInit succeeded
};

template <typename F>
bool Resolve(void* lib, const char* name, F* fn, std::string* error) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  if (*fn == nullptr && error->empty()) *error = std::string("libcuda.so.1 lacks ") + name;
  return *fn != nullptr;
}

const Driver& GetDriver() {
  static Driver driver;
  static std::once_flag once;
  std::call_once(once, [] {
    Driver& d = driver;
    // Never dlclose'd: the driver stays loaded for the process (CUDA needs that anyway).
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      d.load_error = std::string("cannot load the CUDA driver libcuda.so.1 (") +
                     (why ? why : "unknown") + "): no NVIDIA driver on this machine?";
      return;
    }
    std::string& e = d.load_error;
    Resolve(lib, KVL_SYMBOL(cuInit), &d.Init, &e);
    Resolve(lib, KVL_SYMBOL(cuGetErrorName), &d.GetErrorName, &e);
    Resolve(lib, KVL_SYMBOL(cuGetErrorString), &d.GetErrorString, &e);
    Resolve(lib, KVL_SYMBOL(cuDeviceGet), &d.DeviceGet, &e);
    Resolve(lib, KVL_SYMBOL(cuDevicePrimaryCtxRetain), &d.PrimaryCtxRetain, &e);
    Resolve(lib, KVL_SYMBOL(cuDevicePrimaryCtxRelease), &d.PrimaryCtxRelease, &e);
    Resolve(lib, KVL_SYMBOL(cuCtxPushCurrent), &d.CtxPush, &e);
    Resolve(lib, KVL_SYMBOL(cuCtxPopCurrent), &d.CtxPop, &e);
    Resolve(lib, KVL_SYMBOL(cuCtxSynchronize), &d.CtxSynchronize, &e);
    Resolve(lib, KVL_SYMBOL(cuMemGetAllocationGranularity), &d.GetGranularity, &e);
    Resolve(lib, KVL_SYMBOL(cuMemAddressReserve), &d.AddressReserve, &e);
    Resolve(lib, KVL_SYMBOL(cuMemAddressFree), &d.AddressFree, &e);
    Resolve(lib, KVL_SYMBOL(cuMemCreate), &d.Create, &e);
    Resolve(lib, KVL_SYMBOL(cuMemRelease), &d.Release, &e);
    Resolve(lib, KVL_SYMBOL(cuMemMap), &d.Map, &e);
    Resolve(lib, KVL_SYMBOL(cuMemUnmap), &d.Unmap, &e);
    Resolve(lib, KVL_SYMBOL(cuMemSetAccess), &d.SetAccess, &e);
    Resolve(lib, KVL_SYMBOL(cuMemcpyDtoH), &d.CopyDtoH, &e);
    Resolve(lib, KVL_SYMBOL(cuMemcpyHtoD), &d.CopyHtoD, &e);
    Resolve(lib, KVL_SYMBOL(cuMemcpyDtoD), &d.CopyDtoD, &e);
    if (e.empty()) {
      const CUresult rc = d.Init(0);
      if (rc != CUDA_SUCCESS) {
        const char* name = nullptr;
        d.GetErrorName(rc, &name);
        e = std::string("cuInit failed: ") + (name ? name : "unknown CUDA error");
      }
    }
  });
  return driver;
}

// "cuMemCreate(2097152 bytes, device 0) failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
Status CudaStatus(CUresult rc, const std::string& call) {
  if (rc == CUDA_SUCCESS) return Status::Ok();
  const Driver& d = GetDriver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.GetErrorName) d.GetErrorName(rc, &name);
  if (d.GetErrorString) d.GetErrorString(rc, &text);
  return Status::Error(call + " failed: " + (name ? name : "CUDA error " + std::to_string(rc)) +
                       (text ? std::string(" (") + text + ")" : std::string()));
}

#define KVL_CU(expr, what) KVL_RETURN_IF_ERROR(CudaStatus((expr), (what)))

Status DriverOrError(const Driver** out) {
  const Driver& d = GetDriver();
  if (!d.load_error.empty()) return Status::Error(d.load_error);
  *out = &d;
  return Status::Ok();
}

// Makes `context` current for the scope (the driver's VMM calls act on the current context).
class ScopedContext {
 public:
  ScopedContext(const Driver& d, void* context) : d_(d) {
    status_ = CudaStatus(d_.CtxPush(static_cast<CUcontext>(context)), "cuCtxPushCurrent");
  }
  ~ScopedContext() {
    if (status_.ok()) {
      CUcontext popped = nullptr;
      d_.CtxPop(&popped);
    }
  }
  const Status& status() const { return status_; }

 private:
  const Driver& d_;
  Status status_;
};

std::mutex g_stats_mutex;
Stats g_stats;
std::atomic<int> g_fail_after{-1};

void AddStats(int64_t reservations, int64_t reserved, int64_t mapped, int64_t handles) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats.reservations += reservations;
  g_stats.reserved_bytes += reserved;
  g_stats.mapped_bytes += mapped;
  g_stats.handles += handles;
}

constexpr size_t kDriverCalls = static_cast<size_t>(DriverCall::kCount);
std::array<std::atomic<int64_t>, kDriverCalls> g_driver_calls{};
std::array<std::atomic<int64_t>, kDriverCalls> g_driver_ns{};

// Runs one driver call and adds its wall time to `call`'s totals.
template <typename F>
CUresult Timed(DriverCall call, F&& fn) {
  const auto start = std::chrono::steady_clock::now();
  const CUresult rc = fn();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  const size_t i = static_cast<size_t>(call);
  g_driver_calls[i].fetch_add(1, std::memory_order_relaxed);
  g_driver_ns[i].fetch_add(static_cast<int64_t>(ns), std::memory_order_relaxed);
  return rc;
}

// Consumes the failure hook: true when this cuMemCreate must fail.
bool SimulatedCreateFailure() {
  int current = g_fail_after.load();
  while (current >= 0) {
    if (g_fail_after.compare_exchange_weak(current, current - 1)) return current == 0;
  }
  return false;
}

CUmemAllocationProp DeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

}  // namespace

Stats GetStats() {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  return g_stats;
}

const char* DriverCallName(DriverCall call) {
  switch (call) {
    case DriverCall::kCreate: return "cuMemCreate";
    case DriverCall::kMap: return "cuMemMap";
    case DriverCall::kSetAccess: return "cuMemSetAccess";
    case DriverCall::kUnmap: return "cuMemUnmap";
    case DriverCall::kRelease: return "cuMemRelease";
    case DriverCall::kSynchronize: return "cuCtxSynchronize";
    case DriverCall::kCount: break;
  }
  return "unknown";
}

DriverTime GetDriverTime(DriverCall call) {
  const size_t i = static_cast<size_t>(call);
  if (i >= kDriverCalls) return {};
  return {g_driver_calls[i].load(std::memory_order_relaxed),
          g_driver_ns[i].load(std::memory_order_relaxed)};
}

void FailCreateAfter(int after) { g_fail_after.store(after < 0 ? -1 : after); }

namespace {

Status CopyInContext(const Driver& d, uint64_t dst, uint64_t src, size_t bytes) {
  // Work queued by ORT on its own streams must be done before the copy reads or writes.
  KVL_CU(d.CtxSynchronize(), "cuCtxSynchronize");
  KVL_CU(d.CopyDtoD(static_cast<CUdeviceptr>(dst), static_cast<CUdeviceptr>(src), bytes),
         "cuMemcpyDtoD(" + std::to_string(bytes) + " bytes)");
  KVL_CU(d.CtxSynchronize(), "cuCtxSynchronize");
  return Status::Ok();
}

}  // namespace

Status CopyDeviceToDevice(int device, uint64_t dst, uint64_t src, size_t bytes) {
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  CUdevice dev = 0;
  KVL_CU(d->DeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")");
  // The device's primary context (onnxruntime's), current for the copy whatever the calling
  // thread has current (possibly none).
  CUcontext context = nullptr;
  KVL_CU(d->PrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
  Status st;
  {
    ScopedContext scope(*d, context);
    st = scope.status().ok() ? CopyInContext(*d, dst, src, bytes) : scope.status();
  }
  Status released = CudaStatus(d->PrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease");
  return st.ok() ? released : st;
}

Status Reservation::Create(int device, size_t size, std::unique_ptr<Reservation>* out) {
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  if (size == 0) return Status::Error("a reservation needs a positive size");
  std::unique_ptr<Reservation> r(new Reservation());
  r->device_ = device;
  CUdevice dev = 0;
  KVL_CU(d->DeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")");
  r->cu_device_ = static_cast<int>(dev);
  CUcontext context = nullptr;
  KVL_CU(d->PrimaryCtxRetain(&context, dev), "cuDevicePrimaryCtxRetain");
  r->context_ = context;  // from here on ~Reservation releases what was acquired
  ScopedContext scope(*d, r->context_);
  KVL_RETURN_IF_ERROR(scope.status());

  const CUmemAllocationProp prop = DeviceProp(device);
  size_t granularity = 0;
  KVL_CU(d->GetGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
         "cuMemGetAllocationGranularity");
  if (granularity == 0) return Status::Error("cuMemGetAllocationGranularity returned 0");
  r->granularity_ = granularity;
  r->size_ = (size + granularity - 1) / granularity * granularity;
  CUdeviceptr ptr = 0;
  KVL_CU(d->AddressReserve(&ptr, r->size_, 0, 0, 0),
         "cuMemAddressReserve(" + std::to_string(r->size_) + " bytes)");
  r->ptr_ = static_cast<uint64_t>(ptr);
  r->handles_.assign(r->size_ / granularity, 0);
  AddStats(1, static_cast<int64_t>(r->size_), 0, 0);
  *out = std::move(r);
  return Status::Ok();
}

Reservation::~Reservation() { Close(); }

Status Reservation::Map(size_t offset, size_t size, size_t* added) {
  *added = 0;
  if (closed()) return Status::Error("the reservation is closed");
  if (offset % granularity_ || size % granularity_ || offset > size_ || size > size_ - offset) {
    return Status::Error("map [" + std::to_string(offset) + ", +" + std::to_string(size) +
                         ") is not granule-aligned inside the " + std::to_string(size_) +
                         "-byte reservation (granularity " + std::to_string(granularity_) + ")");
  }
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  ScopedContext scope(*d, context_);
  KVL_RETURN_IF_ERROR(scope.status());
  const CUmemAllocationProp prop = DeviceProp(device_);
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const std::string what =
      std::to_string(granularity_) + " bytes, device " + std::to_string(device_) + ")";
  // Each run of unmapped granules: created and mapped granule by granule, then opened by one
  // cuMemSetAccess over the run (it takes a range of whole mapped allocations): fewer driver
  // calls per commit. driver_times() measures what each kind costs.
  const size_t last = (offset + size) / granularity_;
  std::vector<CUmemGenericAllocationHandle> pending;
  for (size_t g = offset / granularity_; g < last;) {
    if (handles_[g] != 0) {
      ++g;
      continue;
    }
    const size_t first = g;
    pending.clear();
    Status st;
    for (; g < last && handles_[g] == 0; ++g) {
      CUmemGenericAllocationHandle handle = 0;
      if (SimulatedCreateFailure()) {
        st = CudaStatus(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate(" + what + " [simulated]");
        break;
      }
      st = CudaStatus(
          Timed(DriverCall::kCreate, [&] { return d->Create(&handle, granularity_, &prop, 0); }),
          "cuMemCreate(" + what);
      if (!st.ok()) break;
      const CUdeviceptr at = static_cast<CUdeviceptr>(ptr_ + g * granularity_);
      st = CudaStatus(
          Timed(DriverCall::kMap, [&] { return d->Map(at, granularity_, 0, handle, 0); }),
          "cuMemMap(" + what);
      if (!st.ok()) {
        d->Release(handle);
        break;
      }
      pending.push_back(handle);
    }
    // The granules mapped before an error stay mapped (the contract), so they get access too.
    if (!pending.empty()) {
      const CUdeviceptr at = static_cast<CUdeviceptr>(ptr_ + first * granularity_);
      const size_t bytes = pending.size() * granularity_;
      const Status access_st = CudaStatus(
          Timed(DriverCall::kSetAccess, [&] { return d->SetAccess(at, bytes, &access, 1); }),
          "cuMemSetAccess(" + std::to_string(bytes) + " bytes, device " +
              std::to_string(device_) + ")");
      if (!access_st.ok()) {
        for (size_t i = 0; i < pending.size(); ++i) {
          d->Unmap(at + i * granularity_, granularity_);
          d->Release(pending[i]);
        }
        return access_st;
      }
      for (size_t i = 0; i < pending.size(); ++i) handles_[first + i] = pending[i];
      const size_t added_now = pending.size() * granularity_;
      mapped_bytes_ += added_now;
      *added += added_now;
      AddStats(0, 0, static_cast<int64_t>(added_now), static_cast<int64_t>(pending.size()));
    }
    if (!st.ok()) return st;
  }
  return Status::Ok();
}

Status Reservation::Unmap(size_t offset, size_t size) {
  if (closed()) return Status::Error("the reservation is closed");
  if (offset % granularity_ || size % granularity_ || offset > size_ || size > size_ - offset) {
    return Status::Error("unmap range is not granule-aligned inside the reservation");
  }
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  ScopedContext scope(*d, context_);
  KVL_RETURN_IF_ERROR(scope.status());
  // no kernel may still use these pages
  KVL_CU(Timed(DriverCall::kSynchronize, [&] { return d->CtxSynchronize(); }), "cuCtxSynchronize");
  for (size_t g = offset / granularity_; g < (offset + size) / granularity_; ++g) {
    if (handles_[g] == 0) continue;
    const CUdeviceptr at = static_cast<CUdeviceptr>(ptr_ + g * granularity_);
    KVL_CU(Timed(DriverCall::kUnmap, [&] { return d->Unmap(at, granularity_); }), "cuMemUnmap");
    const CUmemGenericAllocationHandle handle = handles_[g];
    handles_[g] = 0;
    mapped_bytes_ -= granularity_;
    AddStats(0, 0, -static_cast<int64_t>(granularity_), -1);
    KVL_CU(Timed(DriverCall::kRelease, [&] { return d->Release(handle); }), "cuMemRelease");
  }
  return Status::Ok();
}

Status Reservation::CheckMapped(size_t offset, size_t bytes) const {
  if (closed()) return Status::Error("the reservation is closed");
  if (offset > size_ || bytes > size_ - offset) {
    return Status::Error("copy range outside the reservation");
  }
  for (size_t g = offset / granularity_; bytes && g <= (offset + bytes - 1) / granularity_; ++g) {
    if (handles_[g] == 0) {
      return Status::Error("copy range [" + std::to_string(offset) + ", +" + std::to_string(bytes) +
                           ") touches an unmapped granule");
    }
  }
  return Status::Ok();
}

Status Reservation::CopyToHost(size_t offset, void* dst, size_t bytes) const {
  KVL_RETURN_IF_ERROR(CheckMapped(offset, bytes));
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  ScopedContext scope(*d, context_);
  KVL_RETURN_IF_ERROR(scope.status());
  KVL_CU(d->CtxSynchronize(), "cuCtxSynchronize");
  KVL_CU(d->CopyDtoH(dst, static_cast<CUdeviceptr>(ptr_ + offset), bytes), "cuMemcpyDtoH");
  return Status::Ok();
}

Status Reservation::CopyFromHost(size_t offset, const void* src, size_t bytes) {
  KVL_RETURN_IF_ERROR(CheckMapped(offset, bytes));
  const Driver* d = nullptr;
  KVL_RETURN_IF_ERROR(DriverOrError(&d));
  ScopedContext scope(*d, context_);
  KVL_RETURN_IF_ERROR(scope.status());
  KVL_CU(d->CtxSynchronize(), "cuCtxSynchronize");
  KVL_CU(d->CopyHtoD(static_cast<CUdeviceptr>(ptr_ + offset), src, bytes), "cuMemcpyHtoD");
  return Status::Ok();
}

Status Reservation::Close() {
  if (context_ == nullptr) return Status::Ok();
  const Driver& d = GetDriver();  // loaded: a context exists only after a successful load
  Status first;
  auto keep = [&first](Status st) {
    if (first.ok() && !st.ok()) first = std::move(st);
  };
  {
    ScopedContext scope(d, context_);
    // Without the context nothing can be unmapped or freed: keep every handle, the range and
    // the retained context so that a later Close() (or the destructor) can retry.
    if (!scope.status().ok()) return scope.status();
    {
      keep(CudaStatus(d.CtxSynchronize(), "cuCtxSynchronize"));
      for (size_t g = 0; g < handles_.size(); ++g) {
        if (handles_[g] == 0) continue;
        keep(CudaStatus(d.Unmap(static_cast<CUdeviceptr>(ptr_ + g * granularity_), granularity_),
                        "cuMemUnmap"));
        keep(CudaStatus(d.Release(handles_[g]), "cuMemRelease"));
        handles_[g] = 0;
        AddStats(0, 0, -static_cast<int64_t>(granularity_), -1);
      }
      if (ptr_ != 0) {
        keep(CudaStatus(d.AddressFree(static_cast<CUdeviceptr>(ptr_), size_), "cuMemAddressFree"));
        AddStats(-1, -static_cast<int64_t>(size_), 0, 0);
      }
    }
  }
  keep(CudaStatus(d.PrimaryCtxRelease(static_cast<CUdevice>(cu_device_)),
                  "cuDevicePrimaryCtxRelease"));
  context_ = nullptr;
  ptr_ = 0;
  mapped_bytes_ = 0;
  return first;
}

}  // namespace kvl::vmm
