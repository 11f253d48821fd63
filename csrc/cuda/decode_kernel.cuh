// Token generation (and chunks of a few tokens) on tensor cores, fp16/bf16, sm_80 and newer: the
// decode kernel, wired from its phases (decode_cta.cuh says where each lives).
//
// CTA = (key split, batch x kv head), 4 warps (8 in the wide instance). Its rows are the S x G
// (token, query head) rows of one KV group, at most 16: one m16 tile, so every K/V byte is read
// once per group and the scores and P V products run on mma.sync m16n8k16 (a CUDA-core form of
// this kernel was bound by its FMAs and shuffles, not by HBM). Each warp owns every fourth
// (eighth) KS-key step of the split and streams its own rows through DecStages cp.async stages:
// no CTA barrier inside the key loop. At the end the warps merge in shared memory, and with
// several splits the last CTAs to finish merge the splits through DecodeMergeTree (counters kept
// across calls and reset by their last arrival, or the workspace's zeroed by a memset before the
// launch): no combine kernel. On sm_90 a row's splits launched as one thread-block cluster merge
// through its shared memory instead.
//
// The kernel also does the prepare kernel's work for its rows (prepare_rows.cuh): each CTA
// norms, rotates and scales its group's queries itself, the CTA whose key split holds a new row
// appends it to the cache before it issues the loads that read it, and one grid row past the
// B x Nkv rows checks the lengths (LaunchDecodeTc adds it where the op keeps a length record).
// A decode step launches this kernel (plus the counters' memset where they are not kept across
// calls) instead of prepare + decode.
//
// Included once per instantiation file (decode_<dtype>_hd<HD>.cu): each compiles the instances
// of one (element type, head tile), so the build compiles them in parallel.
#pragma once

#include "cuda/decode_cta.cuh"
#include "cuda/decode_dispatch.h"
#include "cuda/decode_keyloop.cuh"
#include "cuda/decode_merge.cuh"
#include "cuda/decode_prologue.cuh"
#include "cuda/plan_rules.h"

namespace kvl {
namespace cu {

static_assert(kDecodeRows == kRowsPerCta, "the plan sizes decode slots in kRowsPerCta rows");

// The grid's checker row (blockIdx.y == B x Nkv): the lengths of every (batch entry, token), as
// the prepare kernel checks them, one item per thread over the row's CTAs. A row of its own: the
// check on a working CTA (split 0 with a full cache) made that CTA's partial the last of its row
// in most launches at B=1, and moving it later in that CTA only moved the wait. Nothing waits on
// it (every kernel clamps what it reads), but the kernel ends with it: each of its threads takes
// B x S / (splits x 128) items one after another, each a chain of loads, so at thousands of
// batch entries with one split (short caches) it can outlast the working CTAs (reasoned, not
// measured; more checker rows would spread it).
template <int kDecThreads>
__device__ __forceinline__ void CheckLengthsRow(const GqaShape& s, const GqaCudaBuffers& buf) {
  const int64_t items = s.batch * s.seq_len;
  for (int64_t i = int64_t(blockIdx.x) * kDecThreads + threadIdx.x; i < items;
       i += int64_t(gridDim.x) * kDecThreads) {
    CheckLengths(s, buf, i / s.seq_len, i % s.seq_len);
  }
}

// The plain instances' shape (DecodePlain): every feature off as a constant (the kernel reads an
// optional input only where the shape's flag says it exists), so its tests fold away.
__device__ __forceinline__ GqaShape PlainShape(GqaShape s, bool one_token) {
  if (one_token) s.seq_len = 1;
  s.has_attention_bias = false;
  s.softcap = 0.0f;
  s.local_window = -1;
  s.sliding_window_cache = false;
  s.has_head_sink = false;
  s.smooth_softmax = false;
  s.has_q_norm = false;
  s.has_k_norm = false;
  if (!one_token) s.has_query_seqlens = false;  // one token: 0 or 1 rows, read at run time
  s.causal = true;
  return s;
}

// C: the cache's element type (T, or the codes of a quantized cache: decode_cta.cuh).
template <typename T, int HD, DecodeForm kForm, int W, typename C = T>
__global__ void __launch_bounds__(W * kWarp)
    DecodeTcKernel(GqaShape s_arg, GqaCudaBuffers buf, KvStrides present_st, int64_t splits,
                   int64_t split_target, int cluster, float* part_o, float* part_m, float* part_l,
                   unsigned* counters, bool scales_early) {
  using Cta = DecodeCta<T, HD, kForm, W, C>;
  const GqaShape s = kForm == DecodeForm::kFull
                         ? s_arg
                         : PlainShape(s_arg, kForm == DecodeForm::kPlainOneToken || Cta::kPack);
  // The checker row (ptxas lays its code right after this branch whatever the source order or
  // a __builtin_expect says: the working CTAs jump over it once).
  if (blockIdx.y >= s.batch * (Cta::kPack ? 1 : s.kv_num_heads)) {
    CheckLengthsRow<Cta::kDecThreads>(s, buf);
    return;
  }
  Cta cta(s, buf, present_st, splits, split_target, cluster, part_o, part_m, part_l, counters,
          scales_early);
  cta.Begin();
  if (!cta.Partition()) return;  // no live keys in this split
  if (!cta.Prologue()) return;
  if (!cta.KeyLoop()) return;
  if (!cta.MergeWarps()) return;  // one live split: the output is written
  cta.MergeSplits();
}

// The instances of head tile HD (decode_geometry.h, DecodeInstanceFor): every form at four
// warps; the one-token plain form at eight where DecWideHd; packed heads at four warps at tiles
// 128 and 192 and at eight at 192. Null for any other (form, warps).
template <typename T, int HD>
DecodeFn DecodeKernelsOfTile(DecodeForm form, int warps) {
  if (warps == kDecWarpsOf4) {
    switch (form) {
      case DecodeForm::kFull:
        return DecodeTcKernel<T, HD, DecodeForm::kFull, kDecWarpsOf4>;
      case DecodeForm::kPlain:
        return DecodeTcKernel<T, HD, DecodeForm::kPlain, kDecWarpsOf4>;
      case DecodeForm::kPlainOneToken:
        return DecodeTcKernel<T, HD, DecodeForm::kPlainOneToken, kDecWarpsOf4>;
      case DecodeForm::kPackedHeads:
        if constexpr (DecPackedTile(HD)) {
          return DecodeTcKernel<T, HD, DecodeForm::kPackedHeads, kDecWarpsOf4>;
        }
        return nullptr;
    }
    return nullptr;
  }
  if (warps != kDecWideWarps) return nullptr;
  if constexpr (DecWideHd(HD)) {
    if (form == DecodeForm::kPlainOneToken) {
      return DecodeTcKernel<T, HD, DecodeForm::kPlainOneToken, kDecWideWarps>;
    }
  }
  if constexpr (HD == 192) {
    if (form == DecodeForm::kPackedHeads) {
      return DecodeTcKernel<T, HD, DecodeForm::kPackedHeads, kDecWideWarps>;
    }
  }
  return nullptr;
}

// The quantized instances of tile HD (DecodeQuantServes, DecodeInstanceFor): the full and the
// one-token plain forms at four warps, for a cache of kBits-bit codes, and the one-token plain
// form at eight warps for 8-bit codes (DecQuantWide). Null for any other (form, warps).
template <typename T, int HD, int kBits>
DecodeFn DecodeQuantKernelsOfTile(DecodeForm form, int warps) {
  using C = std::conditional_t<kBits == 8, int8_t, PackedInt4>;
  if (warps == kDecWideWarps) {
    if constexpr (DecQuantWide(kBits)) {
      if (form == DecodeForm::kPlainOneToken) {
        return DecodeTcKernel<T, HD, DecodeForm::kPlainOneToken, kDecWideWarps, C>;
      }
    }
    return nullptr;
  }
  if (warps != kDecWarpsOf4) return nullptr;
  if (form == DecodeForm::kFull) return DecodeTcKernel<T, HD, DecodeForm::kFull, kDecWarpsOf4, C>;
  if (form == DecodeForm::kPlainOneToken) {
    return DecodeTcKernel<T, HD, DecodeForm::kPlainOneToken, kDecWarpsOf4, C>;
  }
  return nullptr;
}

}  // namespace cu
}  // namespace kvl

// One instantiation file's body: the quantized instances of (T, kBits) at head tiles 64 and 128
// behind DecodeQuantInstanceFn.
#define KVL_DECODE_QUANT_INSTANCES(T, BITS)                                          \
  namespace kvl {                                                                    \
  namespace cu {                                                                     \
  template <>                                                                        \
  DecodeFn DecodeQuantInstanceFn<T, BITS>(int hd, DecodeForm form, int warps) {      \
    return hd == 64    ? DecodeQuantKernelsOfTile<T, 64, BITS>(form, warps)          \
           : hd == 128 ? DecodeQuantKernelsOfTile<T, 128, BITS>(form, warps)         \
                       : nullptr;                                                    \
  }                                                                                  \
  }                                                                                  \
  }

// One instantiation file's body: the instances of (T, HD) behind DecodeInstanceFn.
#define KVL_DECODE_INSTANCES(T, HD)                                                  \
  namespace kvl {                                                                    \
  namespace cu {                                                                     \
  template <>                                                                        \
  DecodeFn DecodeInstanceFn<T, HD>(DecodeForm form, int warps) {                     \
    return DecodeKernelsOfTile<T, HD>(form, warps);                                  \
  }                                                                                  \
  }                                                                                  \
  }
