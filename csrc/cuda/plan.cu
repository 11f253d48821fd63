// Plan and dispatch: which kernel serves a call, its splits and workspace, and the launch
// sequence (copy past, prepare, attention; the decode kernel prepares its own rows). Host code
// only; the kernels live one family per file.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "core/env.h"
#include "cuda/common.cuh"
#include "cuda/kernels.h"

namespace kvl {
namespace cu {
namespace {

// 16-byte row loads (cp.async) need 16-byte aligned caches (rows are, since H % 8 == 0); a cache
// bound at an odd offset takes the portable kernel, which has an element-load path.
bool CachesAligned16(const GqaCudaBuffers& buf) {
  return Aligned16({buf.present_key, buf.present_value});
}

AttnKernel ChooseKernel(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev) {
  const bool half = s.dtype == DType::kFloat16 || s.dtype == DType::kBFloat16;
  if (!half || !CachesAligned16(buf)) return AttnKernel::kPortable;
  // Tensor-core prefill stores output pairs: a 4-byte aligned output (IO binding can bind odd
  // offsets).
  const bool out_aligned4 = reinterpret_cast<uintptr_t>(buf.output) % 4 == 0;
  if (s.seq_len >= 16 && out_aligned4 && PrefillTcFits(s, 2, dev)) return AttnKernel::kPrefillTc;
  if (s.seq_len * s.group_size() <= kDecodeRows && DecodeTcFits(s, 2, dev)) {
    return AttnKernel::kDecodeTc;
  }
  return AttnKernel::kPortable;
}

// Prefill of at least this many new rows goes to cuDNN (ORT_KVLAYOUT_CUDNN_MIN_ROWS overrides
// it, read once): below it our kernel takes microseconds. Each new shape costs cuDNN a graph
// build on its first call (docs/BENCHMARKS.md: ~70 ms, ~1 s for the process's first); a
// process that sees many one-off prompt lengths can raise the bar.
int64_t CudnnMinRows() {
  static const int64_t rows = [] {
    const int64_t n = EnvPositiveInt("ORT_KVLAYOUT_CUDNN_MIN_ROWS");
    return n > 0 ? n : int64_t(64);
  }();
  return rows;
}

// The decode kernel's split target, when ORT_KVLAYOUT_DECODE_SPLITS=N (read once) sets one: a
// tuning and benchmarking knob (docs/BENCHMARKS.md); 0 = the one-wave rule of MakePlan.
int64_t DecodeSplitsOverride() {
  static const int64_t splits =
      std::min<int64_t>(EnvPositiveInt("ORT_KVLAYOUT_DECODE_SPLITS"), kMaxDecodeSplits);
  return splits;
}

// ORT_KVLAYOUT_DECODE_CLUSTERS=0 (read once) launches the decode kernel without clusters, so its
// splits merge through global partials everywhere (the path of sm_80): a benchmarking and
// testing knob (docs/BENCHMARKS.md).
bool DecodeClustersAllowed() {
  static const bool allowed = EnvNotZero("ORT_KVLAYOUT_DECODE_CLUSTERS");
  return allowed;
}
// Where group clusters serve (MakePlan), read once from ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS, a
// benchmarking knob: 0 nowhere (rows of more than kMaxDecodeCluster splits merge in global memory
// only), unset or 1 the shapes whose merge takes two rounds of loads (the default, measured),
// 2 every few-row shape, 3 every few-row shape with one CTA per SM (shared memory padded); never
// the calls the wide instance serves (MakePlan; ORT_KVLAYOUT_DECODE_WIDE=0 gives them back).
enum class GroupClusters { kOff = 0, kTwoRounds = 1, kAll = 2, kAllPadded = 3 };
GroupClusters DecodeGroupClusters() {
  static const GroupClusters mode = [] {
    const char* v = std::getenv("ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS");
    if (v != nullptr && std::strcmp(v, "0") == 0) return GroupClusters::kOff;
    const int64_t n = EnvPositiveInt("ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS");
    return n >= 1 && n <= 3 ? static_cast<GroupClusters>(n) : GroupClusters::kTwoRounds;
  }();
  return mode;
}

// ORT_KVLAYOUT_DECODE_WIDE=0 (read once) keeps the decode kernel at four warps where the plan
// would take the wide instance (MakePlan: one token, at most one row per SM, a merge of two
// rounds or more than 16 rows), and so turns off the default packed heads (DecodePackedRule:
// per-head CTAs) and runs forced ones (ORT_KVLAYOUT_DECODE_PACKED=2) at four warps: a
// benchmarking and testing knob (docs/BENCHMARKS.md).
bool DecodeWideAllowed() {
  static const bool allowed = EnvNotZero("ORT_KVLAYOUT_DECODE_WIDE");
  return allowed;
}

// ORT_KVLAYOUT_DECODE_PACKED (read once): packed heads (DecodePackedServes) where
// DecodePackedRule says, the default (unset or 1); never with 0; wherever they serve with 2 (a
// testing value: four warps where the eight-warp instance does not serve or
// ORT_KVLAYOUT_DECODE_WIDE=0).
int DecodePackedMode() {
  static const int mode = [] {
    if (!EnvNotZero("ORT_KVLAYOUT_DECODE_PACKED")) return 0;
    return EnvPositiveInt("ORT_KVLAYOUT_DECODE_PACKED") == 2 ? 2 : 1;
  }();
  return mode;
}

// Where packed heads serve by default: kv_layout=1 (DecodePackedServes), 3 kv heads of size 64
// (the 192-column tile) and more (batch, kv head) rows than SMs, at eight warps (the instance
// must serve: one CTA of 200 KB per SM), and (MakePlan) CTAs that fill their last round of SMs.
// Measured on the H200 at 9/3/64 kv_layout=1 (docs/BENCHMARKS.md, twenty-ninth session), kernel
// us, per-head -> packed at four warps -> packed at eight: B=64 L=1k 16.9 -> 20.4 -> 18.2, L=4k
// 53.7 -> 55.5 -> 53.9, L=16k 189.5 -> 184.6 -> 184.2, L=32k 367.5 -> 357.8 -> 358.2
// (kv_layout=0 17.0, 52.7, 183.6, 355.1); B=128 L=1k 30.6 -> 32.3 -> 30.3, L=32k 723.8 -> 707.3 ->
// 701.8. Four warps left one warp per scheduler (Nsight Compute: 3.94 active warps per SM at B=64
// L=1k, twenty-eighth session). Fewer rows lose: B=32 (96 rows) L=1k 10.0 -> 12.2, L=16k 97.3 ->
// 100.6; so do the batches whose packed CTAs fill their last round badly: B=48 (96 CTAs) L=4k
// 44.1 -> 46.1, B=96 (96) L=32k 590.2 -> 626.0. At 2 kv heads (14/2/64) per-head CTAs read alike
// in both layouts and packed ones lost everywhere at four warps (twenty-eighth session). The
// plan picks by shape class, never by length (the bits must not depend on the capacity).
bool DecodePackedRule(const GqaShape& s, const CudaDeviceInfo& dev) {
  return s.kv_num_heads == 3 && s.batch * s.kv_num_heads > std::max(1, dev.sm_count) &&
         DecodeWideAllowed() && DecodeTcWideServes(s, dev, true);
}

// With more (batch, kv head) rows than one wave of decode CTAs holds (one split each), the CTAs
// per SM whose waves the rows fill best: `fit` or one fewer, never below two (ties: more). A
// CTA's reads are bounded by its loads in flight, so a wave the CTAs fill in part reads slower:
// 32/8/128 B=64 (512 rows) in waves of 396 CTAs (three per SM) took 13% longer than in waves of
// 264 (two per SM) on the H200 (docs/BENCHMARKS.md, fourteenth session). Fewer than that would
// fill some waves better on paper (600 rows: five waves of 132), but one CTA per SM holds a third
// of the loads in flight (at B=8, 9/3/64 lost 15% with one CTA per SM): not measured, not taken.
int DecodeWaveCtasPerSm(int64_t rows, int64_t sms, int fit) {
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

// Counters of the decode kernel's split merge tree for a plan (DecodeMergeTree sizes them for
// any live split count; the kernel builds its row's tree).
int64_t DecodeCountersPerRow(const GqaShape& s, const AttnPlan& p) {
  return DecodeMergeTree::CountersPerRow(p.splits, DecodeCtaRows(s, p.decode_packed),
                                         s.head_size, p.cluster);
}

// `allow_packed` false: the per-head plan (the packed rule's fallback, below).
AttnPlan MakePlan(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
                  bool allow_packed = true) {
  AttnPlan p;
  p.kernel = ChooseKernel(s, buf, dev);
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  const bool aligned16 = (reinterpret_cast<uintptr_t>(buf.output) % 16 == 0) && CachesAligned16(buf);
  if (p.kernel == AttnKernel::kPrefillTc && s.seq_len >= CudnnMinRows() && aligned16) {
    const KvStrides present_st =
        MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, s.head_size);
    p.cudnn = FindCudnnPrefill(s, dev, present_st);
    if (p.cudnn != nullptr) {
      p.kernel = AttnKernel::kPrefillCudnn;
      p.q_storage_bytes = align(sizeof(uint16_t) * s.batch * s.seq_len * s.num_heads * s.head_size);  // fp16 / bf16
      p.seq_len_bytes = align(sizeof(int32_t) * s.batch);
      p.cudnn_bytes = align(CudnnPrefillWorkspaceBytes(*p.cudnn));
      return p;
    }
  }
  const int64_t sms = std::max(1, dev.sm_count);
  // Rows of the buffer the attention reads: with a sliding window cache, the staging rows
  // (sliding.cu), whose live keys can outnumber the cache's C.
  const int64_t attn_rows = s.sliding_window_cache ? SlidingStageRows(s) : s.present_capacity;
  if (p.kernel == AttnKernel::kDecodeTc) {
    // With few (batch, kv head) rows, the last merge of a row ends the kernel and each split
    // adds a fixed prologue and merge work to it: one CTA per SM (measured on the H200 at B=1:
    // every CTA slot filled took 20 to 40% longer, docs/BENCHMARKS.md). With many rows their
    // merges overlap the other rows' reads: one wave of every CTA slot (at B=8, 9/3/64 lost 15%
    // with one CTA per SM; at B=64, 192 rows in 396 slots of 3 CTAs per SM with 2 splits read
    // 6 to 10% faster than one split in 264 slots of 2), never a second wave of splits (in waves of
    // short splits each CTA's prologue is on the path: 9/3/64 B=32 L=1k took 70% longer). More
    // rows than slots: one split each, in waves they fill (DecodeWaveCtasPerSm). At least 128
    // keys per split (two steps per warp at four warps). (These measurements, and those of the
    // split slots below, were of four-warp CTAs; since the twenty-sixth session the one-token
    // calls of at most one row per SM at head tiles 64 and 128 run eight warps: the wide rule.)
    const int mode = DecodePackedMode();
    p.decode_packed = allow_packed && mode != 0 && DecodePackedServes(s, dev) &&
                      (mode == 2 || DecodePackedRule(s, dev));
    const bool packed = p.decode_packed;
    const int64_t base = DecodeGridRows(s, packed);
    const bool few = base < kFewDecodeRows;
    const bool two_rounds = DecodeMergeTwoRounds(DecodeCtaRows(s, packed), s.head_size);
    // Few rows of one token whose merge takes two rounds at four warps: eight warps (the wide
    // instance, head tiles 128 and 64), the same split target, no group clusters. With one CTA per
    // SM each scheduler then has two warps to issue from, and the merge takes half the rounds (one
    // at G <= 8). Measured on the H200 (kernel us, docs/BENCHMARKS.md, twenty-fifth session) at
    // 28/4/128 B=1 only (4 rows, G = 7), 24 splits without group clusters at four warps -> eight
    // (an all-eight-warp build): L=4k 11.4 -> 10.3, 16k 17.5 -> 14.0, 32k 27.6 -> 25.4; this
    // instance against the plan before (four warps, group clusters) L=4k 10.35 -> 10.1, 16k 16.4 ->
    // 14.2, but 32k 26.1 -> 24.8 to 27.4 (the same process's two sessions can differ by 2.6 us
    // there). 5 to 15 rows, G = 9 to 16 and head sizes 97 to 120 take it unmeasured (tested for
    // correctness). Not at one-round shapes: eight warps measured 3% slower at 32/8/128 B=1 L=16k
    // and 6% at 9/3/64 B=1 L=4k. (Eight warps with every slot's splits, 33: steadier at 32k, 24.0
    // to 24.7, but 0.96x to 1.02x of ORT at L=4k by session.)
    // With more than 16 rows up to one per SM (one token, head tile 64 or 128; two-round merges
    // from 16 rows on), eight warps too, the CTA slots counted at eight warps (one CTA per SM,
    // so fewer, longer splits). Measured on the H200 against four warps (kernel us, medians of
    // both layouts in two or three processes, docs/BENCHMARKS.md, twenty-sixth session) at 18
    // to 128 rows, 0.86x to 1.003x of the time: 32/8/128 B=8 (64 rows) L=1k 12.9 -> 12.3, 4k
    // 40.5 -> 38.1, 32k 248.2 -> 245.5; 28/4/128 B=32 (128 rows) L=4k 69.2 -> 67.6, 16k 246.7 ->
    // 243.4; 9/3/64 B=32 (96 rows) L=1k 11.1 -> 10.0, 4k 32.2 -> 30.1. At 16 rows only where the
    // merge takes two rounds: 28/4/128 B=4 L=4k 15.2 -> 13.3, but 32/8/128 B=2 and 16/8/64 B=2
    // (one round) 0.97x to 1.04x, mostly slower. Not with more rows than SMs (waves of one CTA
    // per SM): 32/8/128 B=64 L=1k 72.0 -> 83.3, 9/3/64 B=64 L=1k 16.9 -> 23.2. Head tile 64 at
    // few rows (G >= 9): 32/2/64 B=1 L=4k 9.9 -> 10.4 but 16k 13.0 -> 12.4, B=4 L=4k 11.7 -> 10.2.
    // Packed heads: eight warps wherever that instance serves (one CTA per SM; DecodePackedRule).
    if (DecodeWideAllowed() &&
        (packed || (few && two_rounds) || (base <= sms && (two_rounds || base > kFewDecodeRows))) &&
        DecodeTcWideServes(s, dev, packed)) {
      p.decode_threads = kDecodeWideCtaThreads;
    }
    const bool wide = p.decode_threads == kDecodeWideCtaThreads;
    const int fit = few ? 1 : DecodeTcCtasPerSm(s, dev, p.decode_threads, packed);  // per SM
    const int64_t slots = sms * fit;
    // Where a row's merge takes two rounds of loads per 8 splits (DecodeMergeTwoRounds: 28/4/128,
    // 4/1/256), fewer splits: with few rows three quarters of the SMs, with many two CTAs per SM
    // rather than every slot. Measured on the H200 by ORT_KVLAYOUT_DECODE_SPLITS sweeps (kernel
    // us, docs/BENCHMARKS.md, eighteenth session): 28/4/128 B=1 L=4k 12.5 (32 splits) -> 11.7
    // (24), B=8 L=4k 28.0 (12) -> 27.2 (8), B=32 L=4k 72.5 (3) -> 70.3 (2); 4/1/256 B=8 L=16k
    // 46.5 (16) -> 44.8 (12). (At 32/8/128, one round, two CTAs per SM gained 1 to 2% at B=8,
    // within the spread: not taken; at 9/3/64, one CTA per SM lost 15%, fourteenth session.)
    // With many rows but at most one per two SMs, one CTA per SM: each row's merge takes half
    // the partials (28/4/128 B=8, 4 splits rather than 8: L=1k 11.7 -> 11.3 us, 4k 26.8 -> 25.2,
    // 16k 72.2 -> 70.9, 32k 132.3 -> 130.6; but B=32, 1 split rather than 2 in 132 slots: 1%
    // slower at L >= 16k; twenty-fourth session).
    const int64_t split_slots = !two_rounds ? slots
                                : few       ? sms * 3 / 4
                                : 2 * base <= sms ? sms
                                                  : sms * std::min(fit, 2);
    p.split_target = std::min(std::max<int64_t>(1, split_slots / base), kMaxDecodeSplits);
    if (!few && base > slots) {
      const int ctas = DecodeWaveCtasPerSm(base, sms, fit);
      if (ctas < fit) p.decode_ctas_per_sm = ctas;
    }
    const int64_t max_splits =
        std::max<int64_t>(1, (attn_rows + kMinDecodeSplitKeys - 1) / kMinDecodeSplitKeys);
    if (DecodeSplitsOverride() > 0) {  // a tuning run: its splits, every CTA slot
      p.split_target = DecodeSplitsOverride();
      p.decode_ctas_per_sm = 0;
    }
    // With few rows and more splits targeted than one cluster holds, the splits go in clusters
    // of kMaxDecodeCluster, each merging its group through its shared memory before a global
    // merge of the groups (decode.cu), where every row's clusters run at once: the target is
    // cut to the clusters the device holds together. A choice of the shape class and device,
    // never of the capacity: the merge tree (and so the bits) follows it for every capacity.
    // Only where the row's merge takes two rounds of loads: measured on the H200 (kernel us,
    // docs/BENCHMARKS.md, twenty-first session) 28/4/128 B=1 L=4k 11.3 -> 10.7, 4/1/256 B=1
    // L=16k 17.1 -> 14.9, but 32/8/128 B=1 L=32k 40.1 -> 42.7 and 9/3/64 B=1 L=32k 13.2 -> 14.9.
    // ORT_KVLAYOUT_DECODE_GROUP_CLUSTERS picks other shapes (DecodeGroupClusters).
    const GroupClusters gc = DecodeGroupClusters();
    bool group_clusters = false;
    if (few && !wide && p.split_target > kMaxDecodeCluster && DecodeClustersAllowed() &&
        (gc == GroupClusters::kAll || gc == GroupClusters::kAllPadded ||
         (gc == GroupClusters::kTwoRounds && two_rounds))) {
      const int pad = gc == GroupClusters::kAllPadded ? 1 : 0;
      const int64_t per_row = DecodeTcActiveClusters(s, dev, kMaxDecodeCluster, pad,
                                                     p.decode_threads, packed) /
                              base;
      if (per_row >= 2) {
        p.split_target = std::min(p.split_target, per_row * kMaxDecodeCluster);
        p.decode_ctas_per_sm = pad;
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
               DecodeClustersAllowed() &&
               DecodeTcClustersFit(s, dev, p.splits, p.decode_threads, packed)) {
      // With few rows (one CTA per SM, the latency-bound decode) and at most 8 splits, each
      // row's splits are one thread-block cluster where the device has them: they merge through
      // its shared memory (decode.cu). Not with more rows: CTAs scheduled a cluster at a time
      // filled the SMs worse (32/8/128 B=8 L=4k: 46 -> 83 us on the H200 with clusters of 8 and
      // half their CTAs without keys, docs/BENCHMARKS.md, ninth session). The kernel's merge
      // gives the same bits either way, so this choice may follow the capacity.
      p.cluster = p.splits;
    }
    // The packed rule's second half: its CTAs (B x the split target, never the capacity's
    // splits) fill their last round of one CTA per SM to 90% or more. Measured at 9/3/64 on the
    // H200 (docs/BENCHMARKS.md): at four warps (twenty-eighth session) B=64 (128 CTAs on 132 SMs)
    // and B=128 (256) gained at L >= 16k, B=48 (96) and B=96 (192: 60 in the second round) lost
    // everywhere (B=48 L=32k 299.7 -> 334.0 us); at eight warps (twenty-ninth) B=64 (two splits,
    // 128 CTAs) and B=128 (one split, 128) gained, B=48 and B=96 (96 each) lost.
    if (packed && mode == 1) {
      const int64_t last = (s.batch * p.split_target) % sms;
      if (last != 0 && last * 10 < sms * 9) return MakePlan(s, buf, dev, false);
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
    const int64_t slots =  // per (b, kv head, row block), or per decode grid row
        decode ? DecodeMergeTree::SlotsPerRow(p.splits, DecodeCtaRows(s, p.decode_packed),
                                              s.head_size, p.cluster)
               : p.splits;
    const int64_t grid_rows =
        decode ? DecodeGridRows(s, p.decode_packed) : s.batch * s.kv_num_heads * p.row_blocks;
    const size_t rows = size_t(grid_rows) * slots * kRowsPerCta;
    p.part_o_bytes = align(sizeof(float) * rows * s.head_size);
    p.part_ml_bytes = align(sizeof(float) * rows);
    if (decode) {
      p.counter_bytes = align(sizeof(unsigned) * DecodeGridRows(s, p.decode_packed) *
                              DecodeCountersPerRow(s, p));
    }
  }
  return p;
}

Workspace CarveWorkspace(const GqaShape& s, const AttnPlan& p, void* workspace) {
  char* base = static_cast<char*>(workspace);
  Workspace ws;
  ws.q = p.q_bytes > 0 ? reinterpret_cast<float*>(base) : nullptr;
  base += p.q_bytes;
  ws.part_o = reinterpret_cast<float*>(base);
  base += p.part_o_bytes;
  ws.part_m = reinterpret_cast<float*>(base);
  base += p.part_ml_bytes;
  ws.part_l = reinterpret_cast<float*>(base);
  base += p.part_ml_bytes;
  ws.counters = reinterpret_cast<unsigned*>(base);
  ws.counter_count = p.counter_bytes > 0
                         ? DecodeGridRows(s, p.decode_packed) * DecodeCountersPerRow(s, p)
                         : 0;
  base += p.counter_bytes;
  if (p.stage_bytes > 0) {
    ws.stage_k = base;
    ws.stage_v = base + p.stage_bytes;
  }
  base += 2 * p.stage_bytes;
  if (p.q_storage_bytes > 0) {
    ws.q = nullptr;  // the cuDNN path keeps its queries in the storage type
    ws.q_storage = base;
    base += p.q_storage_bytes;
    ws.seq_len_q = reinterpret_cast<int32_t*>(base);
    base += p.seq_len_bytes;
    ws.seq_len_kv = reinterpret_cast<int32_t*>(base);
    base += p.seq_len_bytes;
    ws.cudnn = p.cudnn_bytes > 0 ? base : nullptr;
  }
  return ws;
}

// New rows into `kv_st` rows of buf.present_* (prepare, or the decode kernel itself), and the
// attention reading them.
template <typename T>
Status Attend(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
              KvStrides kv_st, const AttnPlan& plan, const Workspace& ws, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    // The decode kernel prepares its own rows (one launch per step).
    if (plan.kernel == AttnKernel::kDecodeTc) {
      return LaunchDecodeTc<T>(s, buf, kv_st, plan, ws, stream);
    }
  }
  KVL_RETURN_IF_ERROR(LaunchPrepare<T>(s, buf, kv_st, ws, stream));
  if (plan.kernel == AttnKernel::kPrefillCudnn) {
    return LaunchCudnnPrefill(*plan.cudnn, dev, buf, ws, stream);
  }
  if constexpr (sizeof(T) == 2) {
    if (plan.kernel == AttnKernel::kPrefillTc) return LaunchPrefillTc<T>(s, buf, kv_st, ws, stream);
  }
  return LaunchPortable<T>(s, buf, kv_st, plan, ws, stream);
}

template <typename T>
Status Launch(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
              const AttnPlan& plan, void* workspace, unsigned* decode_counters,
              cudaStream_t stream) {
  Workspace ws = CarveWorkspace(s, plan, workspace);
  if (decode_counters != nullptr && ws.counter_count > 0) {
    ws.counters = decode_counters;
    ws.counters_zero = true;
  }
  const KvStrides past_st = MakeKvStrides(s.layout, s.kv_num_heads, s.past_capacity, s.head_size);
  const KvStrides present_st =
      MakeKvStrides(s.layout, s.kv_num_heads, s.present_capacity, s.head_size);
  if (s.sliding_window_cache) {
    // Prepare and the attention work on the staging rows (sliding.cu); present is written last.
    KVL_RETURN_IF_ERROR(LaunchSlidingStage<T>(s, buf, past_st, ws, dev, stream));
    GqaCudaBuffers staged = buf;
    staged.present_key = ws.stage_k;
    staged.present_value = ws.stage_v;
    KVL_RETURN_IF_ERROR(Attend<T>(s, staged, dev, SlidingStageStrides(s), plan, ws, stream));
    return LaunchSlidingPresent<T>(s, buf, present_st, ws, dev, stream);
  }
  // A first prompt has no past rows and writes its S rows, so with a present of S rows there is
  // nothing to copy or zero: the launch is skipped (it cost 1.4 to 40 us at the benchmark's
  // prefill points, H200, docs/BENCHMARKS.md, sixteenth session).
  const bool nothing_to_copy = s.is_first_prompt() && s.present_capacity <= s.seq_len;
  if (!buf.shared() && !nothing_to_copy) {
    KVL_RETURN_IF_ERROR(LaunchCopyPast<T>(s, buf, past_st, present_st, dev, stream));
  }
  return Attend<T>(s, buf, dev, present_st, plan, ws, stream);
}

// Host-side facts that do not change for a (device, kernel): computed once per process.
std::mutex g_cache_mutex;
std::map<std::tuple<int, const void*>, size_t> g_smem_limits;            // raised limit
std::map<std::tuple<int, const void*, int, size_t>, int> g_ctas_per_sm;  // occupancy
std::map<std::tuple<int, const void*>, int> g_ptx_versions;
std::map<std::tuple<int, const void*, size_t, int>, size_t> g_smem_for_ctas;  // padded smem
std::map<std::tuple<int, const void*, int, size_t, int>, int> g_active_clusters;

// A hint cached per (current device, key...): `query(&value)` on the key's first call. Hints
// only size or enable a path, so a failed query gives `fallback` and clears its own error,
// never an earlier one (a failed device lookup gives `fallback` uncached).
template <typename Cache, typename Query, typename... Key>
int CachedHint(Cache& cache, int fallback, Query query, Key... key) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return fallback;
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  const auto k = std::make_tuple(device, key...);
  auto it = cache.find(k);
  if (it != cache.end()) return it->second;
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  int value = fallback;
  if (query(&value) != cudaSuccess) {
    if (clean) (void)cudaGetLastError();
    value = fallback;
  }
  cache.emplace(k, value);
  return value;
}

}  // namespace

Status EnsureSmemLimit(const void* fn, size_t smem) {
  if (smem <= 48 * 1024) return Status::Ok();  // within the default limit
  int device = 0;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  size_t& limit = g_smem_limits[{device, fn}];
  if (limit >= smem) return Status::Ok();
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)),
      "shared memory attribute"));
  limit = smem;
  return Status::Ok();
}

Status SmemForCtasPerSm(const void* fn, int threads, size_t smem, int ctas, size_t* launch_smem) {
  *launch_smem = smem;
  if (ctas <= 0 || CachedCtasPerSm(fn, threads, smem) <= ctas) return Status::Ok();
  int device = 0;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&device), "cudaGetDevice"));
  const auto key = std::make_tuple(device, fn, smem, ctas);
  {
    std::lock_guard<std::mutex> lock(g_cache_mutex);
    const auto it = g_smem_for_ctas.find(key);
    if (it != g_smem_for_ctas.end()) {
      *launch_smem = it->second;
      return Status::Ok();
    }
  }
  // A hint, as CachedHint's: where a query fails, the launch takes `smem` unpadded (more CTAs
  // per SM, the same results) and only this search's own error is cleared. Not through
  // CachedHint: it holds g_cache_mutex while it queries, and EnsureSmemLimit takes it.
  const bool clean = cudaPeekAtLastError() == cudaSuccess;
  size_t found = smem;
  // The most a CTA may opt in to, less the kernel's static shared memory: the limit raised to it
  // makes every size below launchable (and counted by the occupancy calculator).
  cudaFuncAttributes attr = {};
  int optin = 0, n = 0;
  auto fits = [&](size_t bytes) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, bytes) == cudaSuccess;
  };
  bool ok = cudaFuncGetAttributes(&attr, fn) == cudaSuccess &&
            cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
                cudaSuccess;
  if (ok && size_t(optin) > attr.sharedSizeBytes + smem) {
    const size_t most = size_t(optin) - attr.sharedSizeBytes;
    ok = EnsureSmemLimit(fn, most).ok() && fits(most);
    if (ok && n <= ctas) {
      // The smallest size in 1 KB steps with at most `ctas` per SM: the occupancy falls as the
      // size grows, so a bisection over [smem, most].
      size_t lo = smem, hi = most;  // fits(lo) > ctas >= fits(hi)
      while (ok && hi - lo > 1024) {
        const size_t mid = lo + std::max<size_t>(1, (hi - lo) / 2048) * 1024;  // in (lo, hi)
        ok = fits(mid);
        (n <= ctas ? hi : lo) = mid;
      }
      if (ok) found = hi;
    }
  }
  if (!ok) {
    if (clean) (void)cudaGetLastError();
    found = smem;
  }
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  g_smem_for_ctas.emplace(key, found);
  *launch_smem = found;
  return Status::Ok();
}

int CachedCtasPerSm(const void* fn, int threads, size_t smem) {
  const int n = CachedHint(g_ctas_per_sm, 1, [&](int* v) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, fn, threads, smem);
  }, fn, threads, smem);
  return std::max(n, 1);
}

ClusterLaunch::ClusterLaunch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             int cluster) {
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
}

int CachedPtxVersion(const void* fn) {
  return CachedHint(g_ptx_versions, 0, [&](int* v) {
    cudaFuncAttributes attr = {};
    const cudaError_t err = cudaFuncGetAttributes(&attr, fn);
    if (err == cudaSuccess) *v = attr.ptxVersion;
    return err;
  }, fn);
}

int CachedMaxActiveClusters(const void* fn, int threads, size_t smem, int cluster) {
  return CachedHint(g_active_clusters, 0, [&](int* v) {
    // Above 8 CTAs (sm_90 allows 16), once per kernel: the launches that follow rely on it.
    if (cluster > 8) {
      const cudaError_t err =
          cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (err != cudaSuccess) return err;
    }
    const ClusterLaunch launch(dim3(static_cast<unsigned>(cluster)),
                               dim3(static_cast<unsigned>(threads)), smem, nullptr, cluster);
    return cudaOccupancyMaxActiveClusters(v, fn, &launch.config);
  }, fn, threads, smem, cluster);
}

}  // namespace cu

Status QueryCudaDevice(CudaDeviceInfo* info) {
  using cu::CudaCheck;
  KVL_RETURN_IF_ERROR(CudaCheck(cudaGetDevice(&info->device), "cudaGetDevice"));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaDeviceGetAttribute(&info->sm_count, cudaDevAttrMultiProcessorCount, info->device),
      "cudaDeviceGetAttribute(multiprocessor count)"));
  KVL_RETURN_IF_ERROR(CudaCheck(
      cudaDeviceGetAttribute(&info->cc_major, cudaDevAttrComputeCapabilityMajor, info->device),
      "cudaDeviceGetAttribute(compute capability)"));
  return CudaCheck(cudaDeviceGetAttribute(&info->max_smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, info->device),
                   "cudaDeviceGetAttribute(shared memory per block)");
}

Status CheckCudaSupport(const GqaShape& s) {
  const char* op = "ai.kvlayout::GroupQueryAttention (CUDA): ";
  // The kernels put batch x kv head (and batch, num_heads) on a grid axis limited to 65535;
  // the decode kernel adds one row to it (the length checks): batch x kv head at most 65534.
  constexpr int64_t kMaxGridYZ = 65535, kMaxBatchKvHeads = kMaxGridYZ - 1;
  if (s.batch * s.kv_num_heads > kMaxBatchKvHeads) {
    return Status::Error(std::string(op) + "batch x kv_num_heads = " +
                         std::to_string(s.batch * s.kv_num_heads) + " exceeds " +
                         std::to_string(kMaxBatchKvHeads) +
                         " on CUDA in v1 (a grid axis): split the batch");
  }
  if (s.num_heads > kMaxGridYZ) {
    return Status::Error(std::string(op) + "num_heads = " + std::to_string(s.num_heads) +
                         " exceeds " + std::to_string(kMaxGridYZ) + " on CUDA in v1 (a grid axis)");
  }
  if (s.head_size % 8 != 0 || s.head_size > cu::kMaxHeadSize) {
    return Status::Error(std::string(op) + "head_size " + std::to_string(s.head_size) +
                         " is not supported on CUDA: it must be a multiple of 8 and <= " +
                         std::to_string(cu::kMaxHeadSize));
  }
  return Status::Ok();
}

GqaCudaPlan PlanGqaCuda(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev) {
  GqaCudaPlan plan = cu::MakePlan(s, buf, dev);
  plan.stage_bytes = cu::SlidingStageBytes(s);
  return plan;
}

Status LaunchGqaCuda(const GqaShape& s, const GqaCudaBuffers& buf, const CudaDeviceInfo& dev,
                     const GqaCudaPlan& plan, void* workspace, void* stream,
                     unsigned* decode_counters) {
  KVL_RETURN_IF_ERROR(CheckCudaSupport(s));
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (s.dtype) {
    case DType::kFloat32:
      return cu::Launch<float>(s, buf, dev, plan, workspace, decode_counters, st);
    case DType::kFloat16:
      return cu::Launch<__half>(s, buf, dev, plan, workspace, decode_counters, st);
    case DType::kBFloat16:
      return cu::Launch<__nv_bfloat16>(s, buf, dev, plan, workspace, decode_counters, st);
    default:
      return Status::Error(std::string("ai.kvlayout::GroupQueryAttention (CUDA): unsupported type ") +
                           DTypeName(s.dtype));
  }
}

}  // namespace kvl
