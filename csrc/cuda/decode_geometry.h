// The decode kernel's sizes as pure constexpr arithmetic: rows, threads, tiles, stages, shared
// memory, the split merge tree and which instances are compiled. Shared by the kernel
// (decode_*.cuh), its dispatch (decode_dispatch.cu) and the plan rules (plan_rules.h); plain
// C++, so the plan rules and their unit tests (tests/op/test_decode_plan.py) build without CUDA.
// docs/DECISIONS.md holds the measurements behind the numbers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "core/gqa_types.h"

#if defined(__CUDACC__)
#define KVL_DEC_HD __host__ __device__
#else
#define KVL_DEC_HD
#endif

namespace kvl {
namespace cu {

// ---- rows, splits and clusters ---------------------------------------------------------------

// Rows (token x head of one KV group) per CTA: one m16 tile of mma.sync.
constexpr int kDecodeRows = 16;
constexpr int64_t kMaxDecodeSplits = 256;  // the merging CTA keeps 16 x splits weights
// The largest thread-block cluster of decode CTAs (one row's splits, or a group of them).
// 8 is the portable cluster size; KVL_DECODE_MAX_CLUSTER=16 (a diagnostic build knob) allows the
// non-portable 16 of sm_90 (cudaFuncAttributeNonPortableClusterSizeAllowed).
#ifndef KVL_DECODE_MAX_CLUSTER
#define KVL_DECODE_MAX_CLUSTER 8
#endif
constexpr int64_t kMaxDecodeCluster = KVL_DECODE_MAX_CLUSTER;
// The splits of a (batch, kv head) merge in a tree of at most two levels: the last CTA of each
// group of `group` splits merges the group into a group partial (with group clusters, the CTAs
// of each cluster of kMaxDecodeCluster together, through its shared memory), and the last group
// merger (the row's last arrival) merges the groups. One merging CTA reads all of its partials
// alone (one SM, an L2 round trip per eight loads of each thread), so a flat merge of many
// partials takes longer than the reads it follows: past kDecodeFlatMergeFloats floats of live
// partials, groups of ceil(sqrt(live)) splits; else one level (group == live). The bound is
// where a level's fixed cost (an arrival, a weights pass, a values pass) meets four rounds of
// value loads (docs/DECISIONS.md, "flat merge bound").
// The tree follows the live splits (those holding keys, a prefix of the grid set by the lengths
// and the split target), never the capacity, which only bounds how many splits are launched:
// caches of different capacities merge the same partials in the same groups and order, so
// decode output stays bit-identical across capacities. The kernel builds the tree of its row's
// live splits; the plan sizes slots and counters for the largest tree any live count <= the
// launched splits gives (SlotsPerRow, CountersPerRow). One place owns the arithmetic.
#ifndef KVL_DECODE_FLAT_MERGE_FLOATS  // a tuning build knob: the bound above
#define KVL_DECODE_FLAT_MERGE_FLOATS 32768
#endif
constexpr int64_t kDecodeFlatMergeFloats = KVL_DECODE_FLAT_MERGE_FLOATS;
// A second merge level adds a group merge, a fence and a counter to the row's path: the live
// keys take at most the splits of one level while each of those reads at most
// kDecodeFlatSplitBytes of K and V (docs/DECISIONS.md, "one merge level").
constexpr int64_t kDecodeFlatSplitBytes = 256 * 1024;
struct DecodeMergeTree {
  int64_t group = 1, groups = 1;  // splits per group (the last may hold fewer), groups
  // `cluster`: the launch's thread-block cluster size (0 without clusters; 2 to 8 for a row's one
  // cluster, which holds every live split: one group). At kMaxDecodeCluster, more live splits
  // than one cluster merge in groups of one cluster each (the cluster's shared memory), then the
  // groups in global memory. The plan launches such clusters for a shape class, never for a
  // capacity, so the tree still follows the live splits only.
  KVL_DEC_HD static DecodeMergeTree For(int64_t live, int64_t rows, int64_t head_size,
                                        int64_t cluster) {
    DecodeMergeTree t;
    t.group = live;
    if (cluster == kMaxDecodeCluster && live > cluster) {
      t.group = kMaxDecodeCluster;
      t.groups = (live + kMaxDecodeCluster - 1) / kMaxDecodeCluster;  // a shift
      return t;
    }
    if (live * rows * head_size > kDecodeFlatMergeFloats) {
      t.group = CeilSqrt(live);
    }
    t.groups = (live + t.group - 1) / t.group;
    return t;
  }
  // Partial slots of one (batch, kv head) for `splits` launched splits: one per split, then one
  // per group of the largest tree (ceil(live / ceil(sqrt(live))) <= ceil(sqrt(live)); with
  // cluster groups ceil(live / cluster)).
  KVL_DEC_HD static int64_t SlotsPerRow(int64_t splits, int64_t rows, int64_t head_size,
                                        int64_t cluster) {
    return splits + MaxGroups(splits, rows, head_size, cluster);
  }
  // Counters of one (batch, kv head): the top merge's (index 0), then one per group.
  KVL_DEC_HD static int64_t CountersPerRow(int64_t splits, int64_t rows, int64_t head_size,
                                           int64_t cluster) {
    return 1 + MaxGroups(splits, rows, head_size, cluster);
  }
  // The split target for `keys` live keys of `rows` rows (the kernel's partition; the plan's
  // target sized the grid): at most the splits of a one-level merge while each of those reads at
  // most kDecodeFlatSplitBytes (fp16/bf16 K and V rows), else the plan's target. In the integer
  // type I of the caller (SplitChunk says why).
  template <typename I>
  KVL_DEC_HD static I SplitTarget(I target, I keys, I rows, I head_size) {
    const I flat_max = static_cast<I>(kDecodeFlatMergeFloats) / (rows * head_size);
    const I flat = flat_max > 1 ? flat_max : 1;
    if (target <= flat) return target;
    // ceil(keys / flat) splits' K and V rows within the byte bound, without a division by the
    // live keys (it is on the decode kernel's path to its first load; this one is not):
    // ceil(k / f) <= m exactly when k <= f m.
    const I max_keys = static_cast<I>(kDecodeFlatSplitBytes / 4) / head_size;
    return keys <= flat * max_keys ? flat : target;
  }
  KVL_DEC_HD static int64_t CeilSqrt(int64_t n) {  // n <= kMaxDecodeSplits
    int64_t g = 1;
    while (g * g < n) ++g;
    return g;
  }

 private:
  KVL_DEC_HD static int64_t MaxGroups(int64_t splits, int64_t rows, int64_t head_size,
                                      int64_t cluster) {
    const int64_t by_size =
        splits * rows * head_size > kDecodeFlatMergeFloats ? CeilSqrt(splits) : 0;
    const int64_t by_cluster =
        cluster == kMaxDecodeCluster && splits > cluster
            ? (splits + kMaxDecodeCluster - 1) / kMaxDecodeCluster  // a shift, not a division
            : 0;
    return by_size > by_cluster ? by_size : by_cluster;
  }
};
// At least two KS steps per warp at four warps (one at eight), so the merge stays small against
// the reads.
constexpr int64_t kMinDecodeSplitKeys = 128;
// Below this many (batch, kv head) rows the plan puts one decode CTA per SM, else it fills
// every CTA slot in one wave, or past one wave takes one split per row, with fewer CTAs per SM
// (padded shared memory) where the rows fill those waves better; fewer splits where the merge
// takes two rounds (DecodeMergeTwoRounds). plan_rules.h says why.
constexpr int64_t kFewDecodeRows = 16;
// Threads of a decode CTA: four warps. A row's split merge writes its rows x head size values
// four per thread: past one item per thread (28/4/128: 7 rows x 128 / 4 = 224; 4/1/256: 256) each
// 8 splits add two rounds of loads to the merge, not one, and the plan targets fewer splits.
constexpr int kDecodeCtaThreads = 128;
// The wide instance's threads: eight warps, for calls of one token at head tile 128 or 64 with
// at most one row per SM, where the merge takes two rounds at four warps or the rows are more
// than 16, and for packed heads at the 192-column tile (plan_rules.h says why).
constexpr int kDecodeWideCtaThreads = 256;
KVL_DEC_HD constexpr bool DecodeMergeTwoRounds(int64_t rows, int64_t head_size) {
  return rows * head_size / 4 > kDecodeCtaThreads;
}
// The decode grid's rows (batch entry x kv head; packed: batch entry), which own the split
// merge's partial slots and counters, and the query rows of each (S x G; packed: Nkv x G).
inline int64_t DecodeGridRows(const GqaShape& s, bool packed) {
  return packed ? s.batch : s.batch * s.kv_num_heads;
}
inline int64_t DecodeCtaRows(const GqaShape& s, bool packed) {
  return packed ? s.kv_num_heads * s.group_size() : s.seq_len * s.group_size();
}

// ---- a CTA's tiles and shared memory ----------------------------------------------------------

// Warps of a decode CTA: four, or eight in the wide instance (the kernel's W).
constexpr int kDecWarpsOf4 = kDecodeCtaThreads / 32;
constexpr int kDecWideWarps = kDecodeWideCtaThreads / 32;
static_assert(kDecodeRows % kDecWarpsOf4 == 0 && kDecodeRows % kDecWideWarps == 0,
              "each warp prepares kDecodeRows / warps rows");
// The head tiles the wide instance is compiled for: 128 and 64, the tiles of the shapes it was
// measured at; packed heads have their own eight-warp instance at tile 192 (DecodeInstanceFor).
constexpr bool DecWideHd(int64_t hd) { return hd == 128 || hd == 64; }
// The packed-heads instances' tiles: Nkv x 64 columns for 2 or 3 kv heads of head size 64
// (9/3/64, SmolLM2; 14/2/64, Qwen2.5-0.5B; the tiles of the shapes measured).
constexpr bool DecPackedTile(int64_t tile) { return tile == 128 || tile == 192; }

// The tile width of a head size: rounded up to a multiple of 32 (padding columns are zero).
constexpr int64_t DecHeadDim(int64_t head_size) { return (head_size + 31) / 32 * 32; }
// Keys per warp step: 16 (one P V k-step) for wide heads, 32 for narrow ones, so a step moves
// 4 to 16 KB of K and V.
KVL_DEC_HD constexpr int DecKeys(int hd) { return hd <= 64 ? 32 : 16; }
// cp.async stages per warp, both in flight while the oldest is waited for (the next step is
// issued before the wait). Two, not three: at many rows more CTAs per SM read faster than more
// stages per warp (each CTA's reads are bounded by its loads in flight; docs/DECISIONS.md,
// "two stages").
KVL_DEC_HD constexpr int DecStages(int) { return 2; }
// Row pitch in elements: 16 bytes of padding put the 8 rows an ldmatrix reads on distinct banks.
KVL_DEC_HD constexpr int DecPitch(int hd) { return hd + 8; }
// K and V stage tiles at head sizes that are multiples of 64: rows of HD elements, unpadded, row
// j's 16-byte chunk c stored at chunk c ^ (j % 8), so the 8 rows an ldmatrix reads still fall on
// distinct banks and every 8 lanes of a copy write one aligned 128-byte line (with the padded
// pitch a warp's copy wrote lines it shared with the next row: 1.5x the L2 traffic,
// docs/DECISIONS.md, "swizzled stage tiles"). Other head sizes keep the padded rows.
KVL_DEC_HD constexpr bool DecSwizzled(int hd) { return hd % 64 == 0; }

// The slot a warp's stage ring leaves free until its key loop starts (slot ST - 1: the prologue
// fills slots 0 .. ST - 2) holds, before that: in warp 0's, the CTA's query tile (kDecodeRows
// rows of pitch DecPitch, at its start); in every warp's, at its end, the warp's raw query rows
// (kDecodeRows / warps x HD floats) then its float scratch (HD floats).
KVL_DEC_HD constexpr size_t DecSlotElems(int hd) { return size_t(2) * DecKeys(hd) * DecPitch(hd); }
constexpr bool DecSlotHoldsPrologue(int hd, int warps) {  // fp16/bf16 elements (2 bytes)
  return kDecodeRows * DecPitch(hd) * 2 + (kDecodeRows / warps + 1) * hd * sizeof(float) <=
         DecSlotElems(hd) * 2;
}
static_assert(DecSlotHoldsPrologue(32, kDecWarpsOf4) && DecSlotHoldsPrologue(64, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(96, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(128, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(160, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(192, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(224, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(256, kDecWarpsOf4) &&
                  DecSlotHoldsPrologue(128, kDecWideWarps) &&
                  DecSlotHoldsPrologue(64, kDecWideWarps) &&
                  DecSlotHoldsPrologue(192, kDecWideWarps),
              "the query tile, raw rows and scratch fit one free stage slot");

// After the key loop: the warps' partials (red_o, rows of DecRedPitch floats), then the CTA's
// partial for a merge through the cluster's shared memory: kDecodeRows x hd values, then the
// rows' maxima and sums. The pitch puts the 8-byte fragment stores of a half warp (rows
// gq = 0..3, columns 2 tq) on 32 distinct banks: at a pitch of hd a warp's 8 rows fell on the
// same banks.
KVL_DEC_HD constexpr int DecRedPitch(int hd) { return hd + 8; }
KVL_DEC_HD constexpr size_t DecClusterPartialOffset(int hd, int warps) {
  return size_t(warps) * kDecodeRows * DecRedPitch(hd);
}
// The global merge's copies of the slots' m and l: [slot][row] at this pitch (odd, so a warp
// reading one row's slots hits 32 banks).
constexpr int kDecMergeRowPitch = kDecodeRows + 1;
constexpr size_t DecSmemBytes(int hd, size_t elem, int warps) {
  const size_t stages = size_t(warps) * DecStages(hd) * DecSlotElems(hd) * elem;
  const size_t merge =
      sizeof(float) * (DecClusterPartialOffset(hd, warps) + kDecodeRows * (hd + 2));
  const size_t weights =
      sizeof(float) * (kDecodeRows * kMaxDecodeSplits + 2 * kMaxDecodeSplits * kDecMergeRowPitch);
  return std::max(stages, std::max(merge, weights));
}

// ---- which instance serves a call -------------------------------------------------------------

// The plain instances serve the calls that use none of the features below: their shape says so
// as constants (PlainShape), so every test of a feature folds away and the code on a CTA's path
// is shorter (a B=1 call is a prologue and a merge run once per CTA, whose code is fetched cold:
// docs/DECISIONS.md, "plain instances"). A one-token call (S = 1, every decode step) takes the
// instance whose shape also says S = 1, where the per-row token arithmetic folds away. That
// form also serves query_seqlens (0 or 1 rows an entry: a served graph with packed tokens feeds
// it to every decode step), read at run time.
KVL_DEC_HD inline bool DecodePlain(const GqaShape& s) {
  return !s.has_attention_bias && !(s.softcap > 0.0f) && s.local_window < 0 &&
         !s.sliding_window_cache && !s.has_head_sink && !s.smooth_softmax && !s.has_q_norm &&
         !s.has_k_norm && (!s.has_query_seqlens || s.seq_len == 1) && s.causal;
}
// Which instance serves a call: the full one, the plain one, or the plain one for one token;
// or, where the plan packs heads (GqaCudaPlan::decode_packed), the plain one for one token with
// all kv heads of a batch entry in one CTA.
enum class DecodeForm : int { kFull, kPlain, kPlainOneToken, kPackedHeads };
KVL_DEC_HD inline DecodeForm DecodeFormOf(const GqaShape& s) {
  if (!DecodePlain(s)) return DecodeForm::kFull;
  return s.seq_len == 1 ? DecodeForm::kPlainOneToken : DecodeForm::kPlain;
}

// Quantized caches (int8 codes, packed int4): the decode kernel reads the codes and converts
// them in registers right before the MMA (decode_keyloop.cuh). Compiled for head sizes 64 and
// 128 (no padding columns), four warps (and eight: DecQuantWide), the full and the one-token
// plain forms, per-head CTAs only; other quantized shapes take the portable kernel, which
// dequantizes its tiles. The 8-bit instances also read float8e4m3fn caches, and every instance
// PER_TOKEN scales (a key-loop step compiled per variant: StepQuant).
KVL_DEC_HD inline bool DecodeQuantServes(const GqaShape& s) {
  return (s.kv_bits == 8 || s.kv_bits == 4) && (s.head_size == 64 || s.head_size == 128);
}
// The quantized instances at eight warps: the one-token plain form of 8-bit codes (int8, and
// float8e4m3fn through the same instances), head tiles 64 and 128. Their key loop converts every
// code in registers (about 2.5x the instructions per key of T's ldmatrix path), so at one CTA per
// SM four warps (one per scheduler) issue too slowly to keep the loads coming: the plan gives
// them eight (plan_rules.h, docs/DECISIONS.md "quantized decode warps").
KVL_DEC_HD constexpr bool DecQuantWide(int bits) { return bits == 8; }
// The tensor-core prefill's quantized tiles: int8 / int4 codes with static scales (PER_TOKEN
// scales and fp8 caches take the portable kernel for prompts).
KVL_DEC_HD inline bool PrefillQuantServes(const GqaShape& s) {
  return DecodeQuantServes(s) && !s.per_token() && !s.fp8_cache();
}

// One compiled instance of the decode kernel: its tile, form, warps and cache (kv_bits: 0 for a
// cache of T, 8 or 4 for codes).
struct DecodeInstance {
  int hd = 0;
  DecodeForm form = DecodeForm::kFull;
  int warps = 0;
  int kv_bits = 0;
  size_t SmemBytes() const { return DecSmemBytes(hd, 2, warps); }  // fp16 / bf16
};
// The instance for a shape at `threads` per CTA, or false where none is compiled: four warps
// for every form and head tile; eight (the wide instance) only for the one-token plain form at
// head tiles 128 and 64 (DecWideHd), the class the plan gives them; the packed-heads form
// (`packed`) at four warps and tiles DecPackedTile, and at eight at tile 192 (the packed rule's
// instance). Each instance adds to the build, so only those measured to win are compiled.
inline bool DecodeInstanceFor(const GqaShape& s, int threads, bool packed, DecodeInstance* out) {
  const DecodeForm form = DecodeFormOf(s);
  if (s.quantized()) {  // DecodeQuantServes: per-head CTAs, full or one-token plain
    if (packed || !DecodeQuantServes(s)) return false;
    const DecodeForm qform = form == DecodeForm::kPlainOneToken ? form : DecodeForm::kFull;
    const bool wide = threads == kDecodeWideCtaThreads && qform == DecodeForm::kPlainOneToken &&
                      DecQuantWide(static_cast<int>(s.kv_bits));
    if (threads != kDecodeCtaThreads && !wide) return false;
    *out = {static_cast<int>(s.head_size), qform, threads / 32, static_cast<int>(s.kv_bits)};
    return true;
  }
  if (packed) {
    const int64_t tile = s.kv_num_heads * s.head_size;
    if (form != DecodeForm::kPlainOneToken || s.head_size != 64 || !DecPackedTile(tile) ||
        (threads != kDecodeCtaThreads && !(threads == kDecodeWideCtaThreads && tile == 192))) {
      return false;
    }
    *out = {static_cast<int>(tile), DecodeForm::kPackedHeads, threads / 32};
    return true;
  }
  const int64_t tile = DecHeadDim(s.head_size);
  if (threads == kDecodeWideCtaThreads) {
    if (form != DecodeForm::kPlainOneToken || !DecWideHd(tile)) return false;
    *out = {static_cast<int>(tile), form, kDecWideWarps};
    return true;
  }
  if (threads != kDecodeCtaThreads || tile < 32 || tile > 256) return false;
  *out = {static_cast<int>(tile), form, kDecWarpsOf4};
  return true;
}

}  // namespace cu
}  // namespace kvl
