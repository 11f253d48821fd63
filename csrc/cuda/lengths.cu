// Host side of the CUDA op's length checks: the per-kernel record the prepare/decode kernel writes
// (host-mapped memory plus a device claim word) and the opt-in strict check before launching.
#include <cstdio>
#include <vector>

#include "core/check_inputs.h"
#include "core/length_rules.h"
#include "cuda/common.cuh"

namespace kvl {

Status CudaLengthRecord::Create(std::unique_ptr<CudaLengthRecord>* out) {
  using cu::CudaCheck;
  std::unique_ptr<CudaLengthRecord> r(new CudaLengthRecord());
  void* host = nullptr;
  // Portable: the record stays valid whatever device is current when a kernel writes it.
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaHostAlloc(&host, sizeof(LengthRecord), cudaHostAllocMapped | cudaHostAllocPortable),
      "cudaHostAlloc(length record)"));
  r->host_ = static_cast<LengthRecord*>(host);
  r->host_->written = 0;
  r->host_->taken = 0;
  r->host_->violation = NoLengthViolation();
  void* device = nullptr;
  KVL_RETURN_IF_ERROR(
      CudaCheck(cudaHostGetDevicePointer(&device, host, 0), "cudaHostGetDevicePointer"));
  r->device_ = static_cast<LengthRecord*>(device);
  void* claim = nullptr;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaMalloc(&claim, sizeof(uint32_t)), "cudaMalloc(length claim)"));
  r->claim_ = static_cast<uint32_t*>(claim);
  // Synchronous (kernel creation, never a Run): the claim starts at generation 0 = `taken`.
  KVL_RETURN_IF_ERROR(CudaCheck(cudaMemset(claim, 0, sizeof(uint32_t)), "cudaMemset(length claim)"));
  *out = std::move(r);
  return Status::Ok();
}

CudaLengthRecord::~CudaLengthRecord() {
  // At session teardown; both calls wait for the device, so no kernel writes a freed record.
  if (claim_ != nullptr) (void)cudaFree(claim_);
  if (host_ != nullptr) (void)cudaFreeHost(host_);
}

Status CheckLengthsStrict(const GqaShape& s, const GqaCudaBuffers& buf, void* stream) {
  using cu::CudaCheck;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaStreamIsCapturing(st, &capture), "cudaStreamIsCapturing"));
  if (capture != cudaStreamCaptureStatusNone) {
    // ORT still ends the capture after a failed Run and, were the capture valid, would replay
    // the graph without this node's kernels from then on. A synchronization is illegal during
    // capture and invalidates it (the call returns cudaErrorStreamCaptureUnsupported), so the
    // capture fails as a whole and ORT tries again, and fails again, at the next Run.
    (void)cudaStreamSynchronize(st);
    (void)cudaGetLastError();
    const char* message =
        "ai.kvlayout::GroupQueryAttention (CUDA): strict length checks "
        "(ORT_KVLAYOUT_STRICT_LENGTHS=1) copy the lengths to the host and synchronize, which a "
        "CUDA graph capture cannot contain; unset ORT_KVLAYOUT_STRICT_LENGTHS to capture (bad "
        "lengths are then reported by the device-side record, ort_kvlayout.take_length_error())";
    // ORT may report its own end-of-capture failure instead of this node's status (seen with
    // onnxruntime-gpu 1.31): the reason goes to stderr too, so it is never lost.
    std::fprintf(stderr, "%s\n", message);
    return Status::Error(message);
  }
  std::vector<int32_t> seqlens(s.batch), query_len(s.has_query_seqlens ? s.batch : 0);
  const bool positions = s.rotary_dim > 0 && s.has_position_ids;
  // A first prompt reads only position_ids[0, 0] (RotaryPosition).
  const int64_t position_count = !positions ? 0 : (s.is_first_prompt() ? 1 : s.batch * s.seq_len);
  std::vector<int64_t> position_ids(position_count);
  auto copy = [st](void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return Status::Ok();
    return CudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st),
                     "strict length check: copy to the host");
  };
  KVL_RETURN_IF_ERROR(copy(seqlens.data(), buf.seqlens_k, sizeof(int32_t) * seqlens.size()));
  KVL_RETURN_IF_ERROR(
      copy(query_len.data(), buf.query_seqlens, sizeof(int32_t) * query_len.size()));
  KVL_RETURN_IF_ERROR(
      copy(position_ids.data(), buf.position_ids, sizeof(int64_t) * position_ids.size()));
  KVL_RETURN_IF_ERROR(CudaCheck(cudaStreamSynchronize(st), "strict length check: synchronize"));
  return CheckLengthsOnHost(s, seqlens.data(), s.has_query_seqlens ? query_len.data() : nullptr,
                            positions ? position_ids.data() : nullptr, buf.shared());
}

Status CheckKvScalesOnDevice(const GqaShape& s, const GqaCudaBuffers& buf, void* stream,
                             bool* checked) {
  using cu::CudaCheck;
  *checked = false;
  // PER_TOKEN scales are computed on the device: nothing to check (or read on the host).
  if (!s.quantized() || s.per_token()) return Status::Ok();
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaStreamIsCapturing(st, &capture), "cudaStreamIsCapturing"));
  if (capture != cudaStreamCaptureStatusNone) return Status::Ok();  // no copy while capturing
  auto count = [&](KvQuant q) {
    return q == KvQuant::kNone ? 0 : q == KvQuant::kPerTensor ? 1 : s.kv_num_heads * s.head_size;
  };
  std::vector<float> k(count(s.k_quant)), v(count(s.v_quant));
  auto copy = [st](std::vector<float>* dst, const float* src) {
    if (dst->empty()) return Status::Ok();
    return CudaCheck(cudaMemcpyAsync(dst->data(), src, sizeof(float) * dst->size(),
                                     cudaMemcpyDeviceToHost, st),
                     "scale check: copy to the host");
  };
  KVL_RETURN_IF_ERROR(copy(&k, buf.k_scale));
  KVL_RETURN_IF_ERROR(copy(&v, buf.v_scale));
  KVL_RETURN_IF_ERROR(CudaCheck(cudaStreamSynchronize(st), "scale check: synchronize"));
  *checked = true;
  return CheckKvScales(s, k.data(), v.data());
}

}  // namespace kvl
