// The decode kernel's dispatch: the compiled instance for a call (DecodeInstanceFor picks it,
// the instantiation files hold it) and its launch as the plan says.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/common.cuh"
#include "cuda/decode_dispatch.h"
#include "cuda/kernels.h"

namespace kvl {
namespace cu {
namespace {

template <typename T>
DecodeFn DecodeKernelOfType(const DecodeInstance& inst) {
  if (inst.kv_bits == 8) return DecodeQuantInstanceFn<T, 8>(inst.hd, inst.form, inst.warps);
  if (inst.kv_bits == 4) return DecodeQuantInstanceFn<T, 4>(inst.hd, inst.form, inst.warps);
  switch (inst.hd) {
#define KVL_DECODE_HD(hd) \
  case hd:                \
    return DecodeInstanceFn<T, hd>(inst.form, inst.warps);
    KVL_DECODE_HD(32)
    KVL_DECODE_HD(64)
    KVL_DECODE_HD(96)
    KVL_DECODE_HD(128)
    KVL_DECODE_HD(160)
    KVL_DECODE_HD(192)
    KVL_DECODE_HD(224)
    KVL_DECODE_HD(256)
#undef KVL_DECODE_HD
    default:
      return nullptr;
  }
}

}  // namespace

DecodeFn DecodeKernelOf(DType dtype, const DecodeInstance& inst) {
  return dtype == DType::kFloat16 ? DecodeKernelOfType<__half>(inst)
                                  : DecodeKernelOfType<__nv_bfloat16>(inst);
}

template <typename T>
Status LaunchDecodeTc(const GqaShape& s, const GqaCudaBuffers& buf, KvStrides present_st,
                      const AttnPlan& plan, const Workspace& ws, cudaStream_t stream) {
  const int threads = plan.decode_threads;
  DecodeInstance inst;
  const DecodeFn fn = DecodeInstanceFor(s, threads, plan.decode_packed, &inst)
                          ? DecodeKernelOfType<T>(inst)
                          : nullptr;
  if (fn == nullptr) {
    return Status::Error(
        "ai.kvlayout::GroupQueryAttention (CUDA): no decode instance for head_size " +
        std::to_string(s.head_size) + " at " + std::to_string(threads) + " threads per CTA" +
        (plan.decode_packed ? " with packed heads" : ""));
  }
  // Padded where the plan allows fewer CTAs per SM than fit (plan.decode_ctas_per_sm: waves of
  // one split per row that fill the SMs better).
  size_t smem = inst.SmemBytes();
  KVL_RETURN_IF_ERROR(SmemForCtasPerSm(reinterpret_cast<const void*>(fn), threads, smem,
                                       plan.decode_ctas_per_sm, &smem));
  KVL_RETURN_IF_ERROR(EnsureSmemLimit(reinterpret_cast<const void*>(fn), smem));
  if (ws.counter_count > 0 && !ws.counters_zero) {  // a memset node under graph capture
    KVL_RETURN_IF_ERROR(CudaCheck(
        cudaMemsetAsync(ws.counters, 0, sizeof(unsigned) * ws.counter_count, stream),
        "decode counters memset"));
  }
  // One more row of CTAs checks the lengths where the op keeps a record (CheckLengthsRow): at
  // most 65535 rows (CheckCudaSupport bounds B x Nkv by 65534).
  const int64_t check_rows = buf.length_record != nullptr ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(plan.splits),
                  static_cast<unsigned>(DecodeGridRows(s, plan.decode_packed) + check_rows));
  const int cluster = static_cast<int>(plan.cluster);
  if (cluster > 1) {  // one cluster per row (plan.splits == cluster) or per group of its splits
    const ClusterLaunch launch(grid, dim3(threads), smem, stream, cluster);
    return CudaCheck(cudaLaunchKernelEx(&launch.config, fn, s, buf, present_st, plan.splits,
                                        plan.split_target, cluster, ws.part_o, ws.part_m,
                                        ws.part_l, ws.counters, plan.decode_scales_early),
                     "decode launch (clusters)");
  }
  fn<<<grid, threads, smem, stream>>>(s, buf, present_st, plan.splits, plan.split_target, 0,
                                      ws.part_o, ws.part_m, ws.part_l, ws.counters,
                                      plan.decode_scales_early);
  return CudaCheck(cudaGetLastError(), "decode launch");
}

#define KVL_DECODE_LAUNCH(T)                                                              \
  template Status LaunchDecodeTc<T>(const GqaShape&, const GqaCudaBuffers&, KvStrides,     \
                                    const AttnPlan&, const Workspace&, cudaStream_t);
KVL_DECODE_LAUNCH(__half)
KVL_DECODE_LAUNCH(__nv_bfloat16)
#undef KVL_DECODE_LAUNCH

}  // namespace cu
}  // namespace kvl
