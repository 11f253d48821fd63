// One decode CTA: its sizes (DecodeCtaTile), its state across the kernel's phases and the small
// index helpers they share. The phases are members defined one concern per header:
// decode_prologue.cuh (the lengths, the partition, appends and the first loads),
// decode_keyloop.cuh (the key loop) and decode_merge.cuh (the warps' and the splits' merges);
// decode_kernel.cuh wires them. Every member is inlined into the one kernel: the split is for the
// reader, the code is one function.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/decode_geometry.h"
#include "cuda/decode_instrument.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/prepare_rows.cuh"
#include "cuda/ptx.cuh"
#include "cuda/quant.cuh"

namespace kvl {
namespace cu {

// The kernel's dynamic shared memory: the warps' stage rings, then (after the key loop) the
// merges' partials and weights (decode_geometry.h lays it out).
extern __shared__ __align__(128) unsigned char dec_smem[];

// The compile-time geometry of a decode CTA (DecodeCta's parameters, which it takes through
// using-declarations): its tiles, steps and fragments, a quantized cache's bytes, and its
// static shared memory.
template <typename T, int HD, DecodeForm kForm, int W, typename C = T>
struct DecodeCtaTile {
  static constexpr bool kPack = kForm == DecodeForm::kPackedHeads;
  static constexpr int SH = kPack ? 64 : HD;  // columns of one head in the stage tiles
  static_assert(!kPack || (HD % SH == 0 && HD / SH <= kDecodeRows), "whole heads per tile");
  static constexpr int kDecWarps = W, kDecThreads = W * kWarp;
  // A quantized cache's steps take 16 / bits times the keys (the same bytes per step as T's:
  // a step's loads are what a warp keeps in flight, so fewer steps read the codes faster); its
  // stage slots keep T's geometry (KST rows of pitch P), the codes packed at their start.
  static constexpr bool kQuant = kQuantCache<C>;
  static constexpr int QBITS = kQuant ? kCacheBits<C> : 16;
  static constexpr int KST = DecKeys(HD);
  static constexpr int KS = KST * 16 / QBITS, ST = DecStages(HD), P = DecPitch(HD);
  static constexpr int NT = KS / 8;    // score n-tiles (8 keys each)
  static constexpr int KT = HD / 16;   // k-steps of Q K^T over a stage tile
  static constexpr int DTO = SH / 8;   // output n-tiles (8 dimensions each) of a row
  static constexpr int KTQ = SH / 16;  // k-steps of a row's query
  static constexpr int NH = HD / SH;   // heads per stage tile (1 but packed)
  static constexpr int QR = kDecodeRows / kDecWarps;  // query rows per warp
  static constexpr int QE = HD / kWarp;               // query values per lane
  static constexpr int CPR = HD / 8;  // chunk slots per row; those >= chunks are padding
  // A lane copies the same (row j, chunk c) slots of every step: j and c depend on the lane only.
  static constexpr int kCopies = (KS * CPR + kWarp - 1) / kWarp;
  static constexpr int KE = (SH + kWarp - 1) / kWarp;  // values per lane of a head's row
  static constexpr int RP = DecRedPitch(HD);
  static constexpr int HD4 = SH / 4;

  // A quantized cache (kQuant): bytes of a row (H == HD), its 16-byte chunks, the
  // bytes of a key row each lane of a quad reads for Q K^T (in vectors of QKV bytes) and of a
  // value row each of the eight quads reads for P V.
  static constexpr int QRB = HD * QBITS / 8;
  static constexpr int QCR = QRB / 16;
  static constexpr int QKB = QRB / 4, QKV = QKB < 16 ? QKB : 16, QVB = QRB / 8;
  static_assert(!kQuant || (!kPack && (HD == 64 || HD == 128) && QCR >= 2 && QCR <= 8),
                "quantized decode instances: head sizes 64 and 128, per-head CTAs");
  // 8-bit codes under fp16: the static int8 step feeds the MMAs 1152 + code (no subtraction per
  // code pair) and corrects the products: the scores start at -1152 x each row's query sum
  // (k_bias), and o's extra n-tile o[DTO] sums 1152 x P, taken from O after the key loop
  // (docs/DECISIONS.md, "biased int8 operands").
  static constexpr bool kBiased = kQuant && QBITS == 8 && std::is_same<T, __half>::value;
  static constexpr int kOBias = kBiased ? 1 : 0;
  // A quantized step's shared reads at lane offsets set once (QLaneAt: DecodeCta::qk_at), where
  // a row octet holds whole 128-byte lines (QCR >= 4); QLS bytes per octet.
  static constexpr bool QLaneAt = kQuant && QCR >= 4;
  static constexpr int QLS = 8 * QRB;
  // PER_TOKEN: byte offset of key j's scale in a K (or V) stage tile: after the KS rows of
  // codes (2 x KST x HD bytes), inside the tile's pitch padding (2 x KST x 8 x sizeof(T) bytes).
  static constexpr int kQuantScaleAt = KS * QRB;
  static_assert(!kQuant || KS * 4 <= KST * (P - HD) * int(sizeof(T)), "scales fit the padding");

  // The CTA's static shared memory: the warps' maxima, sums and weights, the rows' merged
  // maxima, sums and scales, and whether this CTA merges the splits.
  struct Shared {
    float red_m[kDecWarps][kDecodeRows], red_l[kDecWarps][kDecodeRows];
    float row_scale[kDecodeRows];
    float red_w[kDecWarps][kDecodeRows], row_m[kDecodeRows], row_l[kDecodeRows];
    bool merges_splits;
  };
  __device__ __forceinline__ static Shared& Sh() {
    __shared__ Shared sh;
    return sh;
  }
};

// T: fp16 or bf16; HD: the head tile (decode_geometry.h); kForm: the instance's form; W: warps,
// four or eight (the wide instance, and packed heads at tile 192).
//
// Packed heads (kPack): a CTA serves every kv head of batch entry blockIdx.y. Seq-major rows of
// one token's kv heads lie side by side, so its stage tiles hold whole token rows of HD = Nkv x
// SH columns (SH = 64, the head size), read contiguously, where the per-head CTAs read 128-byte
// rows Nkv x 128 bytes apart at different times. Its CTA rows are the Nkv x G query heads, row r
// of kv head r / G; Q K^T and P V run once per kv head over that head's SH columns, each row
// keeping its own head's scores and its own head's P V products (the others are computed and
// dropped, never added), so the accumulators are SH wide and every row gets the per-head
// kernel's arithmetic, in its order.
//
// C: the cache's element type: T, or the codes of a quantized cache (int8_t, PackedInt4;
// DecodeQuantServes says where; the int8_t instances also read float8e4m3fn bytes, and both
// PER_TOKEN scales: uniform runtime branches on s.fp8_cache() and s.per_token(), no instances of
// their own). Then the stages hold the raw codes as cp.async lands them (no
// tile of T), and the key loop converts each lane's codes to T in registers right before the MMA
// (StepQuant): K's codes as they are, its scales folded into the query (q . (k o s) =
// (q o s) . k), V's codes as they are, its scales applied to the output columns at the end (P V
// is linear in each column). Codes are small integers, exact in T; the MMA sums over the head
// dimension (Q K^T) and the keys (P V) in any order of the k index, so each lane reads whole
// vectors of its codes and the query's columns follow the same order (QuantKDim); P V's output
// columns come out in a lane order of their own (QuantVDim), undone where they are stored.
// PER_TOKEN scales are per key: each step's K and V scales land by cp.async beside its codes
// (the stage slot's padding, QuantScaleAt), K's multiply the score columns after Q K^T (float32)
// and V's the value fragments (pairs of keys, in T) before P V; a NaN scale (a non-finite row)
// reaches the rows that attend the key through their P (NaN for p != 0), never the others.
template <typename T, int HD, DecodeForm kForm, int W, typename C = T>
struct DecodeCta : DecodeCtaTile<T, HD, kForm, W, C> {
  using Tile = DecodeCtaTile<T, HD, kForm, W, C>;
  using Tile::kPack, Tile::SH, Tile::kDecWarps, Tile::kDecThreads, Tile::kQuant, Tile::QBITS,
        Tile::KST, Tile::KS, Tile::ST, Tile::P, Tile::NT, Tile::KT, Tile::DTO, Tile::KTQ, Tile::NH,
        Tile::QR, Tile::QE, Tile::CPR, Tile::kCopies, Tile::KE, Tile::RP, Tile::HD4, Tile::QRB,
        Tile::QCR, Tile::QKB, Tile::QKV, Tile::QVB, Tile::kBiased, Tile::kOBias, Tile::QLaneAt,
        Tile::QLS, Tile::kQuantScaleAt, Tile::Sh;
  using typename Tile::Shared;

  // The call. The shape, buffers and strides by reference: the kernel's parameters are read
  // where they are used (a copy here kept every field live in registers from the start).
  const GqaShape& s;
  const GqaCudaBuffers& buf;
  const KvStrides& present_st;
  int64_t splits, split_target;
  int cluster;
  float *part_o, *part_m, *part_l;
  unsigned* counters;
  bool scales_early;  // GqaCudaPlan::decode_scales_early
  DecTrace trace, prologue_trace;  // the merge's marks; the prologue's (split 0, the appender)

  // Indices (Begin). Head and row indices in 32 bits (a 64-bit division is a called routine of
  // tens of instructions, and these are on every CTA's path to its first load).
  int Gi, nkv;
  int64_t H, G, N;
  int64_t rows;  // <= kDecodeRows (the dispatch guarantees it)
  // bg: the grid row (batch entry x kv head, or the batch entry where packed), which owns the
  // merge's partial slots and counters. g: the kv head (0 where packed: the token rows' start).
  int64_t bg, b, g;
  float inv_g;
  int64_t split;
  int lane, warp, gq, tq;  // gq, tq: fragment row group, thread in group
  // This warp's stages: [stage][K, V] tiles of KS x P elements, a tile's rows placed by DecKvAt
  // (a swizzled tile fills the first KS x HD). Its free slot (DecSlotElems) holds, until the key
  // loop, the query tile (warp 0's), the raw query rows of the warp and its float scratch.
  T* wsm;
  float* x;      // the warp's float scratch row
  float* q_raw;  // [QR][HD]
  T* q_tile;

  // The partition (Partition).
  T qv[QR][QE];  // the warp's raw query values, until they are stored
  BatchGeometry geo;
  int64_t key_lo, key_hi, k_begin, k_end, chunk, live;
  bool extra;  // a head sink or smooth softmax adds a term to each row's sum

  // The loads (Prologue).
  int64_t steps, my_steps;
  const T* pk;
  const T* pv;
  int64_t seq_stride, row_width;
  int chunks;
  int32_t stride32;
  const unsigned char* code_k;  // a quantized cache's rows of (b, g), in bytes
  const unsigned char* code_v;
  // PER_TOKEN: the scale caches' rows of (b, g) (key j at (j - cache_base) x tok_stride).
  const float* tok_k;
  const float* tok_v;
  int32_t tok_stride;
  bool appended;       // uniform over the CTA
  uint32_t qa[KTQ][4];  // the query tile as A fragments: rows gq and gq + 8

  // The key loop's state (KeyLoop): the thread's two rows.
  bool idle[2], upper;
  KeyRange kr[2];
  const T* bias;
  bool raw_scores;
  float inv_softcap;
  int64_t bias_row[2];
  int head_lo, head_hi;
  float m[2], l[2];
  float o[DTO + kOBias][4];  // o[DTO]: the biased step's 1152 x P sums (kBiased)
  float k_bias[2];           // kBiased: -1152 x the query sums of rows gq and gq + 8
  // A quantized step's shared reads at this lane's offsets, set once before the key loop: K
  // vector v of row 8 n + gq at n QLS + qk_at[v]; V share of key row 8 h + 2 tq + o at
  // h QLS + qv_at[o]. DecQuantAt's swizzle depends on r % 8 alone where a row octet holds whole
  // 128-byte lines (QCR >= 4), so its QLS bytes add per octet (QLaneAt). Computed per step
  // (with the copies' offsets, qc_at), the swizzle arithmetic was about 60 instructions of the
  // static int8 step's loop at head size 128 (sm_90).
  int qk_at[kQuant ? QKB / QKV : 1], qv_at[2];
  // IssueQuant's copies: copy iteration it's shared offset (it / IPO) QLS + qc_at[it % IPO],
  // IPO = QCR / 4 iterations per row octet (32 / QCR rows each).
  int qc_at[kQuant && QCR >= 4 ? QCR / 4 : 1];

  // The merges (MergeWarps).
  DecodeMergeTree tree;
  bool cluster_merge;
  int64_t slot_base, slot0;
  int hs, nrows;
  float *cpart, *cpart_m, *cpart_l;

  __device__ __forceinline__ DecodeCta(const GqaShape& shape, const GqaCudaBuffers& buffers,
                                       KvStrides st, int64_t n_splits, int64_t target,
                                       int cluster_size, float* po, float* pm, float* pl,
                                       unsigned* cnt, bool early)
      : s(shape), buf(buffers), present_st(st), splits(n_splits), split_target(target),
        cluster(cluster_size), part_o(po), part_m(pm), part_l(pl), counters(cnt),
        scales_early(early) {}

  // CTA row r's token, query head, key range, output row and sink; warp step i's stage slot and
  // first key (defined below the struct).
  __device__ __forceinline__ int64_t RowTok(int r) const;
  __device__ __forceinline__ int64_t RowHead(int r) const;
  __device__ __forceinline__ KeyRange RowKeys(int r) const;
  __device__ __forceinline__ T* OutRow(int r) const;
  __device__ __forceinline__ float RowSink(int r) const;
  __device__ __forceinline__ T* StepSlot(int64_t i) const;
  __device__ __forceinline__ int64_t StepKey(int64_t i) const;

  __device__ __forceinline__ void Begin();
  __device__ __forceinline__ bool Partition();
  __device__ __forceinline__ bool Prologue();
  __device__ __forceinline__ void Issue(int64_t i);
  __device__ __forceinline__ bool Appends(int64_t i) const;
  __device__ __forceinline__ bool KeyLoop();
  __device__ __forceinline__ void WaitStep(int64_t i);
  // kBiasTile: o[DTO] is rescaled with o (the biased int8 step's); other steps leave it 0.
  template <bool kBiasTile = false>
  __device__ __forceinline__ void SoftmaxStep(float (&sc)[NT][4], int64_t k0);
  __device__ __forceinline__ void Step(int64_t i);
  __device__ __forceinline__ void IssueQuant(int64_t i);
  // kFp8: float8e4m3fn bytes in an 8-bit instance; kToken: PER_TOKEN scales. Compile-time, so
  // the step's conversions hold no branch (KeyLoop picks the variant once).
  template <bool kFp8, bool kToken>
  __device__ __forceinline__ void StepQuant(int64_t i);
  template <bool kFp8, bool kBiasK>
  __device__ __forceinline__ void QuantScores(float (&sc)[NT][4], const unsigned char* kt);
  template <bool kFp8, bool kToken, bool kBiasV>
  __device__ __forceinline__ void QuantPV(const float (&sc)[NT][4], const unsigned char* vt,
                                          const float* vsc);
  __device__ __forceinline__ int QuantKDim(int kk, int reg, int half) const;
  __device__ __forceinline__ int QuantVDim(int n, int col) const { return col * DTO + n; }
  __device__ __forceinline__ void PV(float (&acc)[DTO][4], int n0, const float (&sc)[NT][4],
                                     const T* vs, unsigned v_lane);
  __device__ __forceinline__ bool MergeWarps();
  __device__ __forceinline__ bool MergeSplits();
  __device__ __forceinline__ void StoreGroupPartial(int64_t dst, int r, int d, const float4& acc,
                                                    float mx, float lsum);
  __device__ __forceinline__ void ClusterValues(int members, int64_t dst);
  __device__ __forceinline__ bool MergeInCluster(int members, int64_t dst);
  __device__ __forceinline__ void Merge(int64_t first, int64_t n, int64_t dst);
  template <int FN, int K>
  __device__ __forceinline__ void MergeFewItems(int nn, int64_t row0, int64_t dst);
  __device__ __forceinline__ bool LastToFinish(unsigned* counter, int64_t count);
};

// CTA row r (< kDecodeRows): token r / G, query head g * G + r % G (packed: one token, and row
// r is query head r). r / G by a float reciprocal, not an integer division per row (about 17
// instructions each, on the path to the query loads): exact for r < kDecodeRows, since
// (r + 0.5) / G lies at least 1 / (2 G) from an integer and the product is off by less than
// 2e-6.
// (CTA rows in 32 bits: their float conversion is then a 32-bit one.)
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ int64_t DecodeCta<T, HD, kForm, W, C>::RowTok(int r) const {
  if constexpr (kPack) return 0;
  return static_cast<int>((static_cast<float>(r) + 0.5f) * inv_g);
}
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ int64_t DecodeCta<T, HD, kForm, W, C>::RowHead(int r) const {
  if constexpr (kPack) return r;
  return g * G + r - static_cast<int>(RowTok(r)) * Gi;
}
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ KeyRange DecodeCta<T, HD, kForm, W, C>::RowKeys(int r) const {
  return r < rows ? QueryKeyRange(s, geo, RowTok(r)) : KeyRange{0, 0};
}
template <typename T, int HD, DecodeForm kForm, int W, typename C>  // the output row of CTA row r
__device__ __forceinline__ T* DecodeCta<T, HD, kForm, W, C>::OutRow(int r) const {
  return static_cast<T*>(buf.output) + ((b * s.seq_len + RowTok(r)) * N + RowHead(r)) * H;
}
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ float DecodeCta<T, HD, kForm, W, C>::RowSink(int r) const {
  return s.has_head_sink ? ToF(static_cast<const T*>(buf.head_sink)[RowHead(r)]) : 0.0f;
}
// This warp's i-th step: its stage slot (in 32 bits: a warp's steps number below 2^27, and a
// 64-bit modulo by the stage count was eight instructions on every step's path) and its first
// key.
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ T* DecodeCta<T, HD, kForm, W, C>::StepSlot(int64_t i) const {
  return wsm + (static_cast<int>(i) % ST) * DecSlotElems(HD);
}
template <typename T, int HD, DecodeForm kForm, int W, typename C>
__device__ __forceinline__ int64_t DecodeCta<T, HD, kForm, W, C>::StepKey(int64_t i) const {
  return k_begin + (warp + i * kDecWarps) * KS;
}

// Element offset of (row j, column d) in a K or V stage tile of head dim HD (DecSwizzled says
// why the swizzle). The swizzled tiles' copies and ldmatrix take a cheaper form: one XOR plus
// an immediate per address (decode_keyloop.cuh).
template <int HD>
__device__ __forceinline__ int DecKvAt(int j, int d) {
  if constexpr (DecSwizzled(HD)) {
    return j * HD + ((((d >> 3) ^ (j & 7))) << 3) + (d & 7);
  } else {
    return j * DecPitch(HD) + d;
  }
}

// A quantized cache's stage tile: chunk c (16 bytes) of row r at this byte offset. 128-byte lines
// of eight chunks hold 128 / QRB rows each, the chunks of a line XOR-swizzled by the row so that
// the reads of the key loop (StepQuant: a quad's 16-byte vectors of one key row; a lane's
// QVB bytes of four keys 1 and 8 apart) fall on distinct banks.
template <int QCR>
__device__ __forceinline__ int DecQuantAt(int r, int c) {
  constexpr int RL = 8 / QCR;  // rows per line
  const int swz = QCR == 8 ? ((r & 6) ^ ((r & 1) << 2)) : QCR == 4 ? (r & 6) : ((r >> 1) & 6);
  return (r / RL) * 128 + ((((r % RL) * QCR + c) ^ swz) << 4);
}

}  // namespace cu
}  // namespace kvl
