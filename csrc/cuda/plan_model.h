// A model of the occupancy calculator for the plan rules' host tests (_C.plan_decode,
// tests/op/test_decode_plan.py): CTAs per SM from shared memory, threads and an assumed register
// count, clusters from whole clusters of SMs. Plain C++; the library itself asks the device
// (plan.cu). The model only has to be the same on both sides of a test: it pins the rules, not
// the device.
#pragma once

#include <algorithm>

#include "cuda/plan_rules.h"

namespace kvl {
namespace cu {

class ModelDecodeOccupancy : public DecodeOccupancy {
 public:
  // `smem_per_sm`: shared memory of an SM in bytes (228 KiB on sm_90, 164 KiB on sm_80).
  ModelDecodeOccupancy(const CudaDeviceInfo& dev, int smem_per_sm)
      : dev_(dev), smem_per_sm_(smem_per_sm) {}
  int CtasPerSm(const DecodeInstance& inst) const override {
    const int threads = inst.warps * 32;
    // 1 KiB reserved per CTA by the runtime, plus the kernel's static shared memory (about 1 KiB).
    const int per_cta = static_cast<int>(inst.SmemBytes()) + 2048;
    const int by_smem = smem_per_sm_ / per_cta;
    const int by_threads = 2048 / threads;
    const int by_regs = 65536 / (threads * kRegsPerThread);
    return std::max(1, std::min(by_smem, std::min(by_threads, by_regs)));
  }
  int ActiveClusters(const DecodeInstance& inst, int cluster, int ctas_per_sm) const override {
    if (dev_.cc_major < 9) return 0;
    int per_sm = CtasPerSm(inst);
    if (ctas_per_sm > 0) per_sm = std::min(per_sm, ctas_per_sm);
    return dev_.sm_count * per_sm / cluster;
  }

 private:
  static constexpr int kRegsPerThread = 128;
  CudaDeviceInfo dev_;
  int smem_per_sm_;
};

}  // namespace cu
}  // namespace kvl
