// CUDA GroupQueryAttention: launchers callable from plain C++ (no CUDA headers needed).
//
// Every kernel reads seqlens_k / query_seqlens on the device and clamps them
// (ClampedBatchGeometry), takes its grid from sizes and capacities only, and runs on the given
// stream: the same launches are valid under CUDA graph capture at any length.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "core/gqa_buffers.h"
#include "core/gqa_types.h"
#include "core/length_rules.h"
#include "core/status.h"

namespace kvl {

// On CUDA every pointer of GqaBuffers is device memory (total_sequence_length, read on the
// host, is not among them).
using GqaCudaBuffers = GqaBuffers;

struct CudaDeviceInfo {
  int device = 0;
  int cc_major = 0;  // compute capability
  int sm_count = 0;
  int max_smem_optin = 0;  // bytes of shared memory one CTA may opt in to
};
Status QueryCudaDevice(CudaDeviceInfo* info);

// Shapes the device path cannot serve (v1), as a Status naming the feature.
Status CheckCudaSupport(const GqaShape& shape);

// The attention kernel serving a call.
enum class GqaCudaAttention { kPrefillTc, kDecodeTc, kPortable, kPrefillCudnn };

namespace cu {
struct CudnnPrefill;  // a built cuDNN attention graph (prefill_cudnn.cc)
}

// The plan of one call: which kernel, its splits and its workspace layout, from the shape, the
// buffers' alignment and the device only (never from the current lengths), so the same plan
// serves every replay of a captured graph. Made once per call, by PlanGqaCuda.
struct GqaCudaPlan {
  GqaCudaAttention kernel = GqaCudaAttention::kPortable;
  int64_t row_blocks = 1;  // per (b, kv head): ceil(S * G / 16) (portable kernel)
  int64_t splits = 1;      // key splits launched: min(split_target, ceil(capacity / min keys))
  // The splits the live keys are spread over, from the batch, heads and device only: never
  // from the capacity, so caches of different capacities (a bucket cache and a preallocated
  // one) partition the same live keys the same way and give bit-identical results.
  int64_t split_target = 1;
  // Decode: CTAs per thread-block cluster along the splits (sm_90: a row whose live splits fit
  // one cluster merges them through its shared memory), 0 without clusters. Either `splits` (one
  // cluster per row) or kMaxDecodeCluster with more splits (group clusters: each cluster merges
  // its group of the row's splits, DecodeMergeTree).
  int64_t cluster = 0;
  // Decode: the CTAs per SM its launch allows, below what fits (its shared memory padded, so
  // waves of one split per row fill the slots, or, as a knob, group clusters of one CTA per SM:
  // cuda/plan_rules.h); 0: as many as fit.
  int decode_ctas_per_sm = 0;
  // Decode: threads per CTA, 128 (four warps) or 256 (the wide instance: cuda/plan_rules.h).
  int decode_threads = 128;
  // Decode: one CTA row per batch entry serving all its kv heads (packed heads, kv_layout=1:
  // cuda/plan_rules.h), not one per (batch entry, kv head).
  bool decode_packed = false;
  // Decode of a cache of codes with static scales (the bytes plan, cuda/plan_rules.h): each CTA
  // asks for its kv head's K and V scales at its start, ahead of its first steps' copies.
  bool decode_scales_early = false;
  size_t q_bytes = 0, part_o_bytes = 0, part_ml_bytes = 0, counter_bytes = 0;
  // A window-sized cache: K (and again V) staging rows the attention reads (csrc/cuda/sliding.cu).
  size_t stage_bytes = 0;
  // cuDNN prefill: its graph, the queries in the storage type, the two length vectors, and
  // cuDNN's own workspace.
  std::shared_ptr<const cu::CudnnPrefill> cudnn;
  size_t q_storage_bytes = 0, seq_len_bytes = 0, cudnn_bytes = 0;

  // Bytes of device workspace the call needs (queries in float32 or the storage type, split
  // partials, counters, sliding-window staging, cuDNN's lengths and workspace).
  size_t WorkspaceBytes() const {
    return q_bytes + part_o_bytes + 2 * part_ml_bytes + counter_bytes + 2 * stage_bytes +
           q_storage_bytes + 2 * seq_len_bytes + cudnn_bytes;
  }
};
GqaCudaPlan PlanGqaCuda(const GqaShape& shape, const GqaCudaBuffers& buffers,
                        const CudaDeviceInfo& device);

// Enqueues the whole op on `stream` (a cudaStream_t) as `plan` says. `workspace` holds
// plan.WorkspaceBytes() bytes, 256-byte aligned. `decode_counters`: at least
// plan.counter_bytes of zeroed counters that outlive the call (CudaDecodeCounters), or null: the
// decode kernel then uses the workspace's, zeroed by a memset before it.
Status LaunchGqaCuda(const GqaShape& shape, const GqaCudaBuffers& buffers,
                     const CudaDeviceInfo& device, const GqaCudaPlan& plan, void* workspace,
                     void* stream, unsigned* decode_counters = nullptr);

// The decode kernel's split counters kept across calls, one buffer per stream of a kernel
// instance: zeroed once when allocated, and returned to zero by the kernel itself (the last CTA
// to count a counter resets it), so a decode step needs no memset (one CUDA graph node less).
// Concurrent Runs use different streams, hence one buffer each; a stream's launches are
// ordered. A buffer outgrown by a larger shape is kept until the kernel goes (a captured graph
// replays with its address). The kernel relies on the stream order: a graph captured with a
// buffer must replay on that stream (ORT's do). Get gives null where a call cannot use them: the
// buffer is missing or too small while the stream is capturing (no allocation then), or the
// allocation failed (out of memory; no stream-ordered allocator on the device); the call then
// falls back to the workspace's counters and a memset. Buffers of streams that are gone stay
// until the kernel goes (4 KiB each at least).
class CudaDecodeCounters {
 public:
  CudaDecodeCounters() = default;
  ~CudaDecodeCounters();
  CudaDecodeCounters(const CudaDecodeCounters&) = delete;
  CudaDecodeCounters& operator=(const CudaDecodeCounters&) = delete;
  Status Get(void* stream, size_t bytes, unsigned** counters);

 private:
  struct Buffer {
    unsigned* ptr = nullptr;
    size_t bytes = 0;
  };
  std::mutex mutex_;
  std::map<void*, Buffer> by_stream_;
  std::vector<unsigned*> retired_;  // outgrown buffers: a captured graph may still use them
  bool unavailable_ = false;  // no stream-ordered allocation here: always the memset path
};

// The length record of one CUDA kernel instance (core/length_rules.h): a LengthRecord in
// host-mapped pinned memory and the device word that elects its writer. Allocated once, when
// the kernel is created, and fixed for its life: the launches of every Run, and of a captured
// CUDA graph's replays, write into the same record; the host reads it without synchronizing.
class CudaLengthRecord {
 public:
  static Status Create(std::unique_ptr<CudaLengthRecord>* out);
  ~CudaLengthRecord();
  CudaLengthRecord(const CudaLengthRecord&) = delete;
  CudaLengthRecord& operator=(const CudaLengthRecord&) = delete;

  LengthRecord* host() const { return host_; }      // what the host reads and clears
  LengthRecord* device() const { return device_; }  // GqaBuffers::length_record
  uint32_t* claim() const { return claim_; }        // GqaBuffers::length_claim

 private:
  CudaLengthRecord() = default;
  LengthRecord* host_ = nullptr;
  LengthRecord* device_ = nullptr;
  uint32_t* claim_ = nullptr;
};

// Strict mode (ORT_KVLAYOUT_STRICT_LENGTHS=1): copies seqlens_k, query_seqlens and position_ids
// to the host on `stream`, waits for the stream, and runs CheckLengthsOnHost, so the Run fails
// with the CPU op's message before anything is launched. Refused while `stream` is capturing.
Status CheckLengthsStrict(const GqaShape& shape, const GqaCudaBuffers& buffers, void* stream);

// The values of k_scale / v_scale of a quantized cache (CheckKvScales: finite and > 0), copied
// to the host on `stream`, which is then synchronized. Skipped while `stream` is capturing
// (*checked false: nothing was read). No-op without quantization.
Status CheckKvScalesOnDevice(const GqaShape& shape, const GqaCudaBuffers& buffers, void* stream,
                             bool* checked);

}  // namespace kvl
