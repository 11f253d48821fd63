// KvStrides: the one place where the KV-cache layout becomes arithmetic.
//
// The declared shape of past/present is (B, Nkv, C, H) in both layouts; the layout decides where
// logical element (b, h, s, d) lives:
//   head-major BNSH: b*Nkv*C*H + h*C*H + s*H + d
//   seq-major  BSNH: b*C*Nkv*H + s*Nkv*H + h*H + d
// In BSNH the address of token s of batch b does not depend on C beyond the batch stride, so a
// cache can grow in place. Every CPU and CUDA kernel indexes the cache only through this struct;
// python/ort_kvlayout/op/layout.py mirrors it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVL_HOST_DEVICE inline
#endif

namespace kvl {

enum class KvLayout : int { kHeadMajorBnsh = 0, kSeqMajorBsnh = 1 };

// Element strides of batch, kv head and sequence position; the head dimension is contiguous.
// An element is one stored value of the cache: a T, an int8 code, or a byte of two int4 codes
// (then the strides are byte strides and a row is KvRowElements(H, 4) bytes).
struct KvStrides {
  int64_t batch;
  int64_t head;
  int64_t seq;

  KVL_HOST_DEVICE int64_t Offset(int64_t b, int64_t h, int64_t s) const {
    return b * batch + h * head + s * seq;
  }
};

// Stored elements of one cache row of `head_dim` values: head_dim, or (head_dim + 1) / 2 bytes
// for a packed int4 cache (kv_bits 4: two codes per byte, even channel in the low nibble).
KVL_HOST_DEVICE int64_t KvRowElements(int64_t head_dim, int64_t kv_bits) {
  return kv_bits == 4 ? (head_dim + 1) / 2 : head_dim;
}

// `head_dim`: stored elements per row (KvRowElements).
KVL_HOST_DEVICE KvStrides MakeKvStrides(KvLayout layout, int64_t kv_heads, int64_t capacity,
                                        int64_t head_dim) {
  if (layout == KvLayout::kSeqMajorBsnh) {
    return KvStrides{capacity * kv_heads * head_dim, head_dim, kv_heads * head_dim};
  }
  return KvStrides{kv_heads * capacity * head_dim, capacity * head_dim, head_dim};
}

// Strides of a PER_TOKEN scale cache, declared (B, Nkv, C): the cache's arithmetic with one
// value per row, so (b, h, s) lives where a one-element cache row would.
KVL_HOST_DEVICE KvStrides MakeKvScaleStrides(KvLayout layout, int64_t kv_heads, int64_t capacity) {
  return MakeKvStrides(layout, kv_heads, capacity, /*head_dim=*/1);
}

inline const char* KvLayoutName(KvLayout layout) {
  return layout == KvLayout::kSeqMajorBsnh ? "seq_major_bsnh" : "head_major_bnsh";
}

}  // namespace kvl
