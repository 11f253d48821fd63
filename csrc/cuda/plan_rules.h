// The plan's rules as pure functions of (shape, buffer alignment, device facts, knobs): which
// kernel serves a call, its splits, clusters, warps, packed heads and workspace. Plain C++ (no
// CUDA headers): plan.cu feeds them the device's answers, and _C's plan_decode feeds them a
// model of the device for the CPU tests (tests/op/test_decode_plan.py). A plan never depends on the
// current lengths, and its splits never on the capacity (GqaCudaPlan says why).
// docs/DECISIONS.md holds the measurements behind each rule.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/decode_geometry.h"
#include "cuda/gqa_cuda.h"
#include "cuda/prefill_geometry.h"

namespace kvl {
namespace cu {

// The portable kernel's rows per CTA (token x head of one KV group), also the rows of a combine
// slot.
constexpr int kRowsPerCta = 16;
constexpr int64_t kMaxSplits = 1024;   // the combine kernel keeps one weight per split
constexpr int64_t kMinSplitKeys = 64;  // a split below ~64 keys is not worth its combine

using AttnKernel = GqaCudaAttention;
using AttnPlan = GqaCudaPlan;

// The buffers' alignment, the only facts of a call's buffers the plan reads.
struct PlanBuffers {
  // K and V caches 16-byte aligned: 16-byte row loads (cp.async). Rows are, since H % 8 == 0;
  // a cache bound at an odd offset takes the portable kernel, which has an element-load path.
  bool caches_aligned16 = true;
  bool output_aligned4 = true;   // tensor-core prefill stores output pairs
  bool output_aligned16 = true;  // cuDNN's prefill
};

// The knobs the plan reads (core/knobs.h: ORT_KVLAYOUT_DECODE_*, ORT_KVLAYOUT_CUDNN_MIN_ROWS).
struct PlanKnobs {
  int64_t decode_splits = 0;           // 0: the plan's rule; else the split target
  bool decode_clusters = true;         // thread-block clusters on sm_90
  bool decode_group_clusters = true;   // group clusters where the merge takes two rounds
  bool decode_wide = true;             // eight warps where the wide rule says
  int64_t decode_packed = 1;  // packed heads: 0 never, 1 by the rule, 2 wherever they serve
  bool decode_quant_bytes = true;  // a cache of codes: its own plan (DecodeQuantBytesPlan)
  int64_t cudnn_min_rows = 64;         // prefill of at least this many new rows tries cuDNN
};

// What only the device answers about a compiled decode instance (the occupancy calculator).
class DecodeOccupancy {
 public:
  virtual ~DecodeOccupancy() = default;
  // CTAs of the instance per SM at its shared memory (at least 1).
  virtual int CtasPerSm(const DecodeInstance& inst) const = 0;
  // Clusters of `cluster` CTAs of the instance resident at once, its shared memory padded so at
  // most `ctas_per_sm` share an SM (0: unpadded); 0 where the code running on the device was not
  // compiled for sm_90 or newer (no cluster code) or they do not fit.
  virtual int ActiveClusters(const DecodeInstance& inst, int cluster, int ctas_per_sm) const = 0;
};

// ---- which kernels can serve a shape ----------------------------------------------------------

inline bool PrefillTcFits(const GqaShape& s, size_t elem, const CudaDeviceInfo& dev) {
  return s.group_size() <= kTcRows &&
         TcSmemBytes(TcHeadDim(s.head_size), elem) <= size_t(dev.max_smem_optin);
}
inline bool DecodeTcFits(const GqaShape& s, size_t elem, const CudaDeviceInfo& dev) {
  return DecSmemBytes(static_cast<int>(DecHeadDim(s.head_size)), elem, kDecWarpsOf4) <=
         size_t(dev.max_smem_optin);
}
// The compiled instance at `threads` per CTA whose shared memory fits the device.
inline bool DecodeInstanceFits(const GqaShape& s, const CudaDeviceInfo& dev, int threads,
                               bool packed, DecodeInstance* inst) {
  return DecodeInstanceFor(s, threads, packed, inst) &&
         inst->SmemBytes() <= size_t(dev.max_smem_optin);
}
// Whether the wide (eight-warp) instance serves this shape on this device (`packed`: packed
// heads at the 192-column tile).
inline bool DecodeTcWideServes(const GqaShape& s, const CudaDeviceInfo& dev, bool packed) {
  DecodeInstance inst;
  return DecodeInstanceFits(s, dev, kDecodeWideCtaThreads, packed, &inst);
}
// Packed heads (GqaCudaPlan::decode_packed): one decode CTA per (split, batch entry) serving
// all its kv heads, whose rows it reads as whole seq-major token rows. Serves kv_layout=1, the
// one-token plain form, head size 64, 2 or 3 kv heads (the tiles compiled), Nkv x G <=
// kDecodeRows query rows, where its shared memory fits.
inline bool DecodePackedServes(const GqaShape& s, const CudaDeviceInfo& dev) {
  DecodeInstance inst;
  return s.layout == KvLayout::kSeqMajorBsnh && !s.sliding_window_cache &&
         s.kv_num_heads * s.group_size() <= kDecodeRows &&
         DecodeInstanceFits(s, dev, kDecodeCtaThreads, true, &inst);
}
// Clusters of `cluster` decode CTAs the device holds at once (0 without an instance, below
// sm_90 or outside 2 .. kMaxDecodeCluster).
inline int DecodeActiveClusters(const GqaShape& s, const CudaDeviceInfo& dev,
                                const DecodeOccupancy& occ, int64_t cluster, int ctas_per_sm,
                                int threads, bool packed) {
  DecodeInstance inst;
  if (!DecodeInstanceFits(s, dev, threads, packed, &inst) || dev.cc_major < 9 || cluster < 2 ||
      cluster > kMaxDecodeCluster) {
    return 0;
  }
  return occ.ActiveClusters(inst, static_cast<int>(cluster), ctas_per_sm);
}
inline int DecodeCtasPerSm(const GqaShape& s, const CudaDeviceInfo& dev,
                           const DecodeOccupancy& occ, int threads, bool packed) {
  DecodeInstance inst;
  return DecodeInstanceFits(s, dev, threads, packed, &inst) ? occ.CtasPerSm(inst) : 1;
}

// ---- the rules ----------------------------------------------------------------------------------

inline AttnKernel ChooseKernel(const GqaShape& s, const PlanBuffers& buf,
                               const CudaDeviceInfo& dev) {
  const bool half = s.dtype == DType::kFloat16 || s.dtype == DType::kBFloat16;
  if (!half || !buf.caches_aligned16) return AttnKernel::kPortable;
  // A quantized cache: the tensor-core prefill and the decode kernel where their instances of
  // its cache type serve the shape (head sizes 64 and 128: DecodeQuantServes; the prefill not
  // for PER_TOKEN or fp8: PrefillQuantServes), else the portable kernel; each dequantizes what
  // it loads (cuDNN reads T only: TriesCudnn).
  if (s.quantized()) {
    if (!DecodeQuantServes(s)) return AttnKernel::kPortable;
    if (s.seq_len >= 16 && buf.output_aligned4 && PrefillQuantServes(s) &&
        PrefillTcFits(s, 2, dev)) {
      return AttnKernel::kPrefillTc;
    }
    return s.seq_len * s.group_size() <= kDecodeRows && DecodeTcFits(s, 2, dev)
               ? AttnKernel::kDecodeTc
               : AttnKernel::kPortable;
  }
  if (s.seq_len >= 16 && buf.output_aligned4 && PrefillTcFits(s, 2, dev)) {
    return AttnKernel::kPrefillTc;
  }
  if (s.seq_len * s.group_size() <= kDecodeRows && DecodeTcFits(s, 2, dev)) {
    return AttnKernel::kDecodeTc;
  }
  return AttnKernel::kPortable;
}

// Whether a call the tensor-core prefill serves asks cuDNN first: prefill of at least
// cudnn_min_rows new rows (below it our kernel takes microseconds, and each new shape costs
// cuDNN a graph build on its first call, docs/DECISIONS.md "cuDNN prefill bar") with 16-byte
// aligned buffers, and a cache of T (cuDNN cannot read a quantized one).
inline bool TriesCudnn(const GqaShape& s, AttnKernel kernel, const PlanBuffers& buf,
                       const PlanKnobs& knobs) {
  return kernel == AttnKernel::kPrefillTc && !s.quantized() &&
         s.seq_len >= knobs.cudnn_min_rows && buf.output_aligned16 && buf.caches_aligned16;
}

// Where packed heads serve by default: 3 kv heads of size 64 (the 192-column tile) and more
// (batch, kv head) rows than SMs, at eight warps (the instance must serve: one CTA per SM), and
// (DecodePlanRules) CTAs that fill their last round of SMs. By shape class, never by length (the
// bits must not depend on the capacity). docs/DECISIONS.md, "packed heads".
inline bool DecodePackedRule(const GqaShape& s, const CudaDeviceInfo& dev, const PlanKnobs& k) {
  return s.kv_num_heads == 3 && s.batch * s.kv_num_heads > std::max(1, dev.sm_count) &&
         k.decode_wide && DecodeTcWideServes(s, dev, true);
}

// With more (batch, kv head) rows than one wave of decode CTAs holds (one split each), the CTAs
// per SM whose waves the rows fill best: `fit` or one fewer, never below two (ties: more). A
// CTA's reads are bounded by its loads in flight, so a wave the CTAs fill in part reads slower;
// one CTA per SM holds too few loads in flight (docs/DECISIONS.md, "decode waves").
inline int DecodeWaveCtasPerSm(int64_t rows, int64_t sms, int fit) {
  int best = fit;
  int64_t best_fill = 0;  // in 1/1000 of the waves' slots
  for (int c = fit; c >= std::max(2, fit - 1); --c) {
    const int64_t slots = sms * c, waves = (rows + slots - 1) / slots;
    const int64_t fill = rows * 1000 / (waves * slots);
    if (fill > best_fill) {
      best = c;
      best_fill = fill;
    }
  }
  return best;
}

// A cache of codes: the plan from the bytes a CTA reads (knobs.decode_quant_bytes; off: the plan
// of a cache of T, for comparison). The codes: a step holds 16 / bits times T's keys, so a step
// and a warp's loads in flight are T's bytes (DecodeCtaTile::KS), and DecodePlanRules' splits
// and warps stand: at B = 1 every SM has a CTA, and past a fixed part the cold int8 reads ran at
// the HBM's peak (32/8/128, L = 16k to 32k: 3.4 TB/s), so other splits of the same bytes would
// empty SMs (fp16's bytes per CTA) or add merge work. The static scales (2 x H floats of the kv
// head): every CTA reads them at three points of its path, the appending CTA one value per
// dependent trip (StoreQuantRows stores between them), each trip to HBM after a flush of the L2,
// behind the first steps' copies: each CTA asks for them at its start.
inline void DecodeQuantBytesPlan(const GqaShape& s, const PlanKnobs& knobs, AttnPlan* p) {
  p->decode_scales_early = knobs.decode_quant_bytes && s.quantized() && !s.per_token();
}

// The decode kernel's splits, warps, clusters and packed heads (p.kernel == kDecodeTc).
// `allow_packed` false: the per-head plan (the packed rule's fallback). `attn_rows`: rows of the
// buffer the attention reads. Returns false where the packed rule falls back to per-head CTAs.
inline bool DecodePlanRules(const GqaShape& s, const CudaDeviceInfo& dev,
                            const DecodeOccupancy& occ, const PlanKnobs& knobs, bool allow_packed,
                            int64_t attn_rows, AttnPlan* plan) {
  AttnPlan& p = *plan;
  const int64_t sms = std::max(1, dev.sm_count);
  // With few (batch, kv head) rows, the last merge of a row ends the kernel and each split adds
  // a fixed prologue and merge work to it: one CTA per SM. With many rows their merges overlap
  // the other rows' reads: one wave of every CTA slot, never a second wave of splits (in waves
  // of short splits each CTA's prologue is on the path). More rows than slots: one split each,
  // in waves they fill (DecodeWaveCtasPerSm). At least 128 keys per split.
  // docs/DECISIONS.md, "decode splits".
  const int64_t mode = knobs.decode_packed;
  p.decode_packed = allow_packed && mode != 0 && DecodePackedServes(s, dev) &&
                    (mode == 2 || DecodePackedRule(s, dev, knobs));
  const bool packed = p.decode_packed;
  const int64_t base = DecodeGridRows(s, packed);
  const bool few = base < kFewDecodeRows;
  const bool two_rounds = DecodeMergeTwoRounds(DecodeCtaRows(s, packed), s.head_size);
  // Eight warps (the wide instance, head tiles 128 and 64) for one-token calls of few rows whose
  // merge takes two rounds at four warps, and of more than 16 rows up to one per SM: with one
  // CTA per SM each scheduler then has two warps to issue from, and the merge takes half the
  // rounds. Not at one-round shapes of few rows, nor with more rows than SMs. Packed heads:
  // eight warps wherever that instance serves. docs/DECISIONS.md, "wide instance". A quantized
  // cache (DecQuantWide): eight warps for every one-token call of at most one row per SM, whose
  // key loop is bound by its warps' issue (docs/DECISIONS.md, "quantized decode warps").
  if (knobs.decode_wide &&
      (packed || (few && two_rounds) || (base <= sms && (two_rounds || base > kFewDecodeRows)) ||
       (s.quantized() && base <= sms)) &&
      DecodeTcWideServes(s, dev, packed)) {
    p.decode_threads = kDecodeWideCtaThreads;
  }
  const bool wide = p.decode_threads == kDecodeWideCtaThreads;
  const int fit = few ? 1 : DecodeCtasPerSm(s, dev, occ, p.decode_threads, packed);  // per SM
  const int64_t slots = sms * fit;
  // Where a row's merge takes two rounds of loads per 8 splits (DecodeMergeTwoRounds: 28/4/128,
  // 4/1/256), fewer splits: with few rows three quarters of the SMs, with many two CTAs per SM
  // rather than every slot; with many rows but at most one per two SMs, one CTA per SM (each
  // row's merge takes half the partials). docs/DECISIONS.md, "two-round merges".
  const int64_t split_slots = !two_rounds        ? slots
                              : few              ? sms * 3 / 4
                              : 2 * base <= sms  ? sms
                                                 : sms * std::min(fit, 2);
  p.split_target = std::min(std::max<int64_t>(1, split_slots / base), kMaxDecodeSplits);
  if (!few && base > slots) {
    const int ctas = DecodeWaveCtasPerSm(base, sms, fit);
    if (ctas < fit) p.decode_ctas_per_sm = ctas;
  }
  const int64_t max_splits =
      std::max<int64_t>(1, (attn_rows + kMinDecodeSplitKeys - 1) / kMinDecodeSplitKeys);
  const int64_t splits_knob = std::min<int64_t>(knobs.decode_splits, kMaxDecodeSplits);
  if (splits_knob > 0) {  // a tuning run: its splits, every CTA slot
    p.split_target = splits_knob;
    p.decode_ctas_per_sm = 0;
  }
  // With few rows and more splits targeted than one cluster holds, the splits go in clusters of
  // kMaxDecodeCluster, each merging its group through its shared memory before a global merge of
  // the groups, where every row's clusters run at once: the target is cut to the clusters the
  // device holds together. A choice of the shape class and device, never of the capacity: the
  // merge tree (and so the bits) follows it for every capacity. Only where the row's merge takes
  // two rounds of loads, and never at eight warps. docs/DECISIONS.md, "group clusters".
  bool group_clusters = false;
  if (few && !wide && p.split_target > kMaxDecodeCluster && knobs.decode_clusters &&
      knobs.decode_group_clusters && two_rounds) {
    const int64_t per_row = DecodeActiveClusters(s, dev, occ, kMaxDecodeCluster, 0,
                                                 p.decode_threads, packed) /
                            base;
    if (per_row >= 2) {
      p.split_target = std::min(p.split_target, per_row * kMaxDecodeCluster);
      group_clusters = true;
    }
  }
  p.splits = std::min(p.split_target, max_splits);
  if (group_clusters && p.splits > kMaxDecodeCluster) {
    // Whole clusters: the splits past the live ones leave at once. (A grid of at most 8 splits
    // holds at most 8 live ones, one group: the one-cluster branch below gives its bits.)
    p.splits = (p.splits + kMaxDecodeCluster - 1) / kMaxDecodeCluster * kMaxDecodeCluster;
    p.cluster = kMaxDecodeCluster;
  } else if (base < kFewDecodeRows && p.splits > 1 && p.splits <= kMaxDecodeCluster &&
             knobs.decode_clusters &&
             DecodeActiveClusters(s, dev, occ, p.splits, 0, p.decode_threads, packed) > 0) {
    // With few rows (one CTA per SM, the latency-bound decode) and at most 8 splits, each row's
    // splits are one thread-block cluster where the device has them: they merge through its
    // shared memory. Not with more rows: CTAs scheduled a cluster at a time fill the SMs worse
    // (docs/DECISIONS.md, "one-cluster merge"). The kernel's merge gives the same bits either
    // way, so this choice may follow the capacity.
    p.cluster = p.splits;
  }
  DecodeQuantBytesPlan(s, knobs, &p);
  // The packed rule's second half: its CTAs (B x the split target, never the capacity's splits)
  // fill their last round of one CTA per SM to 90% or more.
  if (packed && mode == 1) {
    const int64_t last = (s.batch * p.split_target) % sms;
    if (last != 0 && last * 10 < sms * 9) return false;
  }
  return true;
}

// The plan of a call the cuDNN prefill does not serve (plan.cu tries cuDNN first where
// TriesCudnn says): kernel, splits and workspace sizes.
inline AttnPlan PlanRules(const GqaShape& s, const PlanBuffers& buf, const CudaDeviceInfo& dev,
                          const DecodeOccupancy& occ, const PlanKnobs& knobs,
                          bool allow_packed = true) {
  AttnPlan p;
  p.kernel = ChooseKernel(s, buf, dev);
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const int64_t sms = std::max(1, dev.sm_count);
  // Rows of the buffer the attention reads: with a sliding window cache, the staging rows
  // (sliding.cu: past capacity + S), whose live keys can outnumber the cache's C.
  const int64_t attn_rows =
      s.sliding_window_cache ? s.past_capacity + s.seq_len : s.present_capacity;
  if (p.kernel == AttnKernel::kDecodeTc) {
    if (!DecodePlanRules(s, dev, occ, knobs, allow_packed, attn_rows, &p)) {
      return PlanRules(s, buf, dev, occ, knobs, false);
    }
  } else if (p.kernel == AttnKernel::kPortable) {
    p.row_blocks = (s.seq_len * s.group_size() + kRowsPerCta - 1) / kRowsPerCta;
    const int64_t base = s.batch * s.kv_num_heads * p.row_blocks;
    // The portable kernel waits on each of its tiles: eight CTAs per SM keep loads in flight.
    // A split below ~64 keys is not worth its combine.
    const int64_t target = 8 * sms;
    p.split_target = base >= target ? 1 : std::min((target + base - 1) / base, kMaxSplits);
    const int64_t max_splits =
        std::max<int64_t>(1, (attn_rows + kMinSplitKeys - 1) / kMinSplitKeys);
    p.splits = std::min(p.split_target, max_splits);
  }
  // The float queries of prepare (the decode kernel keeps its own in shared memory).
  if (p.kernel != AttnKernel::kDecodeTc) {
    p.q_bytes = align(sizeof(float) * s.batch * s.num_heads * s.seq_len * s.head_size);
  }
  if (p.splits > 1) {
    const bool decode = p.kernel == AttnKernel::kDecodeTc;
    const int64_t cta_rows = DecodeCtaRows(s, p.decode_packed);
    const int64_t slots =  // per (b, kv head, row block), or per decode grid row
        decode ? DecodeMergeTree::SlotsPerRow(p.splits, cta_rows, s.head_size, p.cluster)
               : p.splits;
    const int64_t grid_rows =
        decode ? DecodeGridRows(s, p.decode_packed) : s.batch * s.kv_num_heads * p.row_blocks;
    const size_t rows = size_t(grid_rows) * slots * kRowsPerCta;
    p.part_o_bytes = align(sizeof(float) * rows * s.head_size);
    p.part_ml_bytes = align(sizeof(float) * rows);
    if (decode) {
      p.counter_bytes =
          align(sizeof(unsigned) * grid_rows *
                DecodeMergeTree::CountersPerRow(p.splits, cta_rows, s.head_size, p.cluster));
    }
  }
  return p;
}

}  // namespace cu
}  // namespace kvl
